"""attnquant.graph.matmul and the sm_90 decisions in attnquant.max_compat:
the split-K guard, the row-split product and the row padding.

Whether the split avoids MAX 26.7's uncompilable configuration is a compile
for sm_90a (bench/checks/sm90_matmul_shapes.py), and whether padded rows
avoid its wrong partial row tiles is a run on the H200
(bench/checks/max_gpu_patterns_check.py); here: when each applies, that the
split product is the product, and that padding hands the kernel the row
count it should and gives back the first M rows.
"""

from __future__ import annotations

import functools

import pytest
import torch
from max.dtype import DType

from attnquant.graph import matmul
from attnquant.max_compat import SM90_ROW_TILE, SM90_SPLIT_K_SHAPES, RowPadding, needs_row_split, row_padding


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
    assert needs_row_split(n, k, dtype, api, static_m) is expected


def test_split_halves_leave_the_table() -> None:
    for n, k in SM90_SPLIT_K_SHAPES:
        assert (n // 2, k) not in SM90_SPLIT_K_SHAPES
        assert (n - n // 2, k) not in SM90_SPLIT_K_SHAPES


@pytest.mark.parametrize(
    ("mode", "dtype", "api", "arch", "capture", "expected"),
    [
        (None, DType.bfloat16, "cuda", "sm_90a", True, RowPadding.BRANCH),  # captured: one row skips it
        (None, DType.bfloat16, "cuda", "sm_90a", False, RowPadding.FIXED),  # uncaptured: no host branch
        (None, DType.bfloat16, "cuda", "sm_90a", None, RowPadding.FIXED),
        (None, DType.bfloat16, "cuda", "sm_100a", True, RowPadding.OFF),  # seen on sm_90 only
        (None, DType.bfloat16, "cuda", "sm_80", True, RowPadding.OFF),
        (None, DType.float32, "cuda", "sm_90a", True, RowPadding.OFF),
        (None, DType.float32, "cpu", "", None, RowPadding.OFF),
        (False, DType.bfloat16, "cuda", "sm_90a", True, RowPadding.OFF),  # ATTNQUANT_ROW_PADDING=0
        (True, DType.float32, "cpu", "", None, RowPadding.FIXED),  # =1: any device, any dtype
        (True, DType.bfloat16, "cuda", "sm_100a", True, RowPadding.BRANCH),
    ],
)
def test_row_padding_decision(
    mode: bool | None, dtype: DType, api: str, arch: str, capture: bool | None, expected: RowPadding
) -> None:
    assert row_padding(mode, dtype, api, arch, capture) is expected


def test_padded_row_count_fills_the_last_tile_and_keeps_one_row() -> None:
    from max.graph import Dim

    tile = SM90_ROW_TILE
    for m in range(1, 3 * tile + 2):
        expected = 1 if m == 1 else -(-m // tile) * tile
        assert int(matmul.padded_row_count(Dim(m))) == expected, m


def test_is_static_dim() -> None:
    assert matmul.is_static_dim(3)
    assert not matmul.is_static_dim("m")


@pytest.mark.max
def test_row_split_and_padded_rows_give_the_product() -> None:
    """Odd N (unequal halves), symbolic M, leading dims: same as x @ W.T; and
    with padded rows, fixed or behind the one-row branch: the same product,
    the function handed the padded count (one row: one row)."""
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

    def seen(x, padding):
        return matmul.on_full_row_tiles(rows_seen, x, padding, out_features=n)

    def forward(x, x3, w):
        return (
            matmul.row_split_linear(x, w), matmul.row_split_linear(x3, w),
            *(matmul.linear(x, w, padding) for padding in RowPadding),
            *(seen(x, padding) for padding in RowPadding),
        )  # fmt: skip

    types = [
        TensorLayout(f32, ["m", k], device),
        TensorLayout(f32, [2, "s", k], device),
        TensorLayout(f32, [n, k], device),
    ]
    run = compilation.compile(forward)(*types)
    for m, padded_to in ((1, 1), (5, 64), (64, 64), (65, 128)):
        x, x3, w = torch.randn(m, k), torch.randn(2, m, k), torch.randn(n, k)
        outputs = [torch.from_dlpack(o).clone() for o in run(*(Tensor.from_dlpack(t) for t in (x, x3, w)))]
        y, y3, *rest = outputs
        products, rows = rest[: len(RowPadding)], dict(zip(RowPadding, rest[len(RowPadding) :]))
        for got in (y, *products):
            torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y3, x3 @ w.T, rtol=1e-5, atol=1e-5)
        expected = {RowPadding.OFF: m, RowPadding.FIXED: padded_to, RowPadding.BRANCH: padded_to}
        for padding, count in expected.items():
            got = rows[padding]
            assert got.shape == (m, n) and bool((got == count).all()), (padding, m, got[0, 0], count)


def test_static_row_counts_are_decided_while_building() -> None:
    """A static M of 1 or a multiple of the tile is never padded; any other is."""
    calls: list[int] = []

    class Rows:
        def __init__(self, m: int) -> None:
            self.shape, self.rank = (m, 8), 2

    def fn(x):
        calls.append(x.shape[0])
        return "direct"

    padded = functools.partial(matmul.on_full_row_tiles, fn, padding=RowPadding.BRANCH, out_features=4)
    assert padded(Rows(1)) == padded(Rows(SM90_ROW_TILE)) == "direct"
    assert calls == [1, SM90_ROW_TILE]


@pytest.mark.max
def test_a_module_run_on_padded_rows_sees_full_tiles_and_keeps_its_weight_names() -> None:
    """A MAX module we do not build (the MTP drafter's Linear and MLP layers)
    is handed padded rows, gives back its own rows' product, and loads its
    weights under the names it had."""
    from max.driver import CPU
    from max.experimental import functional as F
    from max.experimental.nn import Linear, Module
    from max.experimental.tensor import Tensor, TensorType

    device, f32, n, k = CPU(), DType.float32, 7, 12

    class RowsSeen(Module):  # every element: the row count its forward was handed
        def forward(self, r: Tensor) -> Tensor:
            count = F.cast(F.shape_to_tensor([r.shape[0]]), f32).reshape([1, 1])
            return F.broadcast_to(count, [r.shape[0], n])

    class Drafter(Module):
        def __init__(self) -> None:
            super().__init__()
            self.probe, self.linear = RowsSeen(), Linear(k, n, bias=False)

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return self.probe(x), self.linear(x)

    drafter = Drafter()
    names = [name for name, _ in drafter.parameters]
    for module in (drafter.probe, drafter.linear, drafter.probe):  # the second time: padded once
        matmul.run_on_padded_rows(module)
    assert type(drafter.probe).__mro__[1] is RowsSeen
    assert [name for name, _ in drafter.parameters] == names == ["linear.weight"]
    w = torch.randn(n, k)
    run = drafter.compile(TensorType(f32, ["m", k], device), weights={"linear.weight": w})
    for m, padded_to in ((1, 1), (5, 64), (64, 64), (65, 128)):
        x = torch.randn(m, k)
        rows, got = (torch.from_dlpack(t).clone() for t in run(Tensor.from_dlpack(x)))
        assert rows.shape == (m, n) and bool((rows == padded_to).all()), (m, rows[0, 0])
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
