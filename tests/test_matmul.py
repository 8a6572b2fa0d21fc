"""attnquant.matmul: the SM90 split-K guard and the row-split product.

Whether the split avoids MAX 26.7's uncompilable configuration is a compile
for sm_90a (bench/sm90_matmul_shapes.py, minutes per shape, recorded in
docs/throughput.md); here: when it applies, and that the split product is the
product.
"""

from __future__ import annotations

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


def test_is_static_dim() -> None:
    assert matmul.is_static_dim(3)
    assert not matmul.is_static_dim("m")


@pytest.mark.max
def test_row_split_linear_is_the_product() -> None:
    """Odd N (unequal halves), symbolic M, leading dims: same as x @ W.T."""
    from max.driver import CPU
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout
    from max.experimental.tensor import Tensor

    device, f32 = CPU(), DType.float32
    n, k = 7, 12

    def forward(x, x3, w):
        return matmul.row_split_linear(x, w), matmul.row_split_linear(x3, w), matmul.linear(x, w)

    types = [
        TensorLayout(f32, ["m", k], device),
        TensorLayout(f32, [2, "s", k], device),
        TensorLayout(f32, [n, k], device),
    ]
    run = compilation.compile(forward)(*types)
    for m in (1, 5):
        x, x3, w = torch.randn(m, k), torch.randn(2, m, k), torch.randn(n, k)
        outputs = run(*(Tensor.from_dlpack(t) for t in (x, x3, w)))
        y, y3, plain = (torch.from_dlpack(o).clone() for o in outputs)
        torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y3, x3 @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(plain, x @ w.T, rtol=1e-5, atol=1e-5)
