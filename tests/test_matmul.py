"""attnquant.matmul: the SM90 split-K guard, the row-split product and the row padding.

Whether the split avoids MAX 26.7's uncompilable configuration is a compile
for sm_90a (bench/sm90_matmul_shapes.py, minutes per shape, recorded in
docs/throughput.md), and whether padded rows avoid its wrong partial row
tiles is a run on the H200 (bench/max_gpu_patterns_check.py); here: when each
applies, that the split product is the product, and that padding hands the
kernel the row count it should and gives back the first M rows.
"""

from __future__ import annotations

import functools

import pytest
import torch
from max.dtype import DType

from attnquant import matmul


@pytest.mark.parametrize(
    ("n", "k", "dtype", "api", "static_m", "expected"),
    [
        (5376, 21504, DType.bfloat16, "cuda", False, True),  # Gemma 4 31B down_proj
        (43008, 5376, DType.bfloat16, "cuda", False, True),  # its fused gate|up
        (5376, 21504, DType.bfloat16, "cuda", True, False),  # static M compiles
        (5376, 21504, DType.float32, "cuda", False, False),  # bf16 tables only
        (5376, 21504, DType.bfloat16, "cpu", False, False),
        (5376, 21504, DType.bfloat16, "hip", False, False),
        (16384, 5376, DType.bfloat16, "cuda", False, False),  # not tabled: compiles
        (1152, 6912, DType.bfloat16, "cuda", False, False),  # Gemma 3 1B
    ],
)
def test_needs_row_split(n: int, k: int, dtype: DType, api: str, static_m: bool, expected: bool) -> None:
    assert matmul.needs_row_split(n, k, dtype, api, static_m) is expected


def test_split_halves_leave_the_table() -> None:
    for n, k in matmul.SM90_SPLIT_K_SHAPES:
        assert (n // 2, k) not in matmul.SM90_SPLIT_K_SHAPES
        assert (n - n // 2, k) not in matmul.SM90_SPLIT_K_SHAPES


@pytest.mark.parametrize(
    ("dtype", "api", "arch", "m", "expected"),
    [
        (DType.bfloat16, "cuda", "sm_90a", "m", True),  # a decoder graph's token count
        (DType.bfloat16, "cuda", "sm_90a", 3, True),
        (DType.bfloat16, "cuda", "sm_90a", 1, False),  # MAX's GEMV: right
        (DType.bfloat16, "cuda", "sm_90a", 128, False),  # full tiles only
        (DType.bfloat16, "cuda", "sm_100a", "m", False),  # seen on sm_90 only
        (DType.bfloat16, "cuda", "sm_80", "m", False),
        (DType.float32, "cuda", "sm_90a", "m", False),
        (DType.bfloat16, "cpu", "", "m", False),
    ],
)
def test_needs_row_padding(dtype: DType, api: str, arch: str, m: object, expected: bool) -> None:
    assert matmul.needs_row_padding(dtype, api, arch, m) is expected


@pytest.mark.parametrize(
    ("api", "arch", "m", "mode", "expected"),
    [
        ("cuda", "sm_90a", "m", False, False),  # ATTNQUANT_ROW_PADDING=0: never
        ("cuda", "sm_90a", 3, False, False),
        ("cpu", "", "m", True, True),  # =1: any device, any dtype
        ("cuda", "sm_100a", 3, True, True),
        ("cpu", "", 1, True, False),  # ... but never the GEMV's single row
        ("cpu", "", 128, True, False),  # ... nor full tiles
    ],
)
def test_row_padding_setting_overrides_the_device(api: str, arch: str, m: object, mode: bool, expected: bool) -> None:
    assert matmul.needs_row_padding(DType.float32, api, arch, m, mode) is expected


def test_padded_row_count_fills_the_last_tile_and_keeps_one_row() -> None:
    from max.graph import Dim

    tile = matmul.SM90_ROW_TILE
    for m in range(1, 3 * tile + 2):
        expected = 1 if m == 1 else -(-m // tile) * tile
        assert int(matmul.padded_row_count(Dim(m))) == expected, m


def test_is_static_dim() -> None:
    assert matmul.is_static_dim(3)
    assert not matmul.is_static_dim("m")


@pytest.mark.max
def test_row_split_and_padded_rows_give_the_product() -> None:
    """Odd N (unequal halves), symbolic M, leading dims: same as x @ W.T; and
    with padded rows: the same product, the function handed the padded count."""
    from max.driver import CPU
    from max.experimental import compilation
    from max.experimental import functional as F
    from max.experimental.sharding import TensorLayout
    from max.experimental.tensor import Tensor

    device, f32 = CPU(), DType.float32
    n, k = 7, 12

    def rows_seen(r):  # every element: the row count fn was handed
        count = F.cast(F.shape_to_tensor([r.shape[0]]), f32).reshape([1, 1])
        return F.broadcast_to(count, [r.shape[0], n])

    def forward(x, x3, w):
        padded = matmul.with_padded_rows(functools.partial(matmul.linear_as_given, weight=w), x)
        try:  # ATTNQUANT_ROW_PADDING as a load sets it: read while the graph is traced
            matmul.set_row_padding(True)
            forced = matmul.linear(x, w), matmul.on_full_row_tiles(rows_seen, x)
        finally:
            matmul.set_row_padding(None)
        return (
            matmul.row_split_linear(x, w), matmul.row_split_linear(x3, w), matmul.linear(x, w),
            padded, matmul.with_padded_rows(rows_seen, x), *forced, matmul.on_full_row_tiles(rows_seen, x),
        )  # fmt: skip

    types = [
        TensorLayout(f32, ["m", k], device),
        TensorLayout(f32, [2, "s", k], device),
        TensorLayout(f32, [n, k], device),
    ]
    run = compilation.compile(forward)(*types)
    for m, padded_to in ((1, 1), (5, 64), (64, 64), (65, 128)):
        x, x3, w = torch.randn(m, k), torch.randn(2, m, k), torch.randn(n, k)
        outputs = run(*(Tensor.from_dlpack(t) for t in (x, x3, w)))
        y, y3, plain, padded, seen, forced, forced_seen, auto_seen = (torch.from_dlpack(o).clone() for o in outputs)
        for got in (y, plain, padded, forced):
            torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y3, x3 @ w.T, rtol=1e-5, atol=1e-5)
        for rows, expected in ((seen, padded_to), (forced_seen, padded_to), (auto_seen, m)):  # auto: not on CPU
            assert rows.shape == (m, n) and bool((rows == expected).all()), (m, rows[0, 0], expected)
