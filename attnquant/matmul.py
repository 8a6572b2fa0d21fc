"""``x @ W.T`` through MAX's matmul, kept off configurations MAX 26.7 cannot compile.

MAX 26.7's SM90 bf16 matmul dispatch (``linalg/matmul/gpu/sm90/dispatch.mojo``)
carries a tuning table for Gemma 3 27B whose small-M entries are split-K.
The dispatcher instantiates every entry of the table at compile time, and the
split-K workspace is sized from the static M: in a decoder graph M is
symbolic, the workspace comes out empty and the compile stops with
``tile_scheduler_splitk.mojo:127: constraint failed: _view_row_major result
must fit within the parent``. Gemma 4 31B meets it: its MLP has Gemma 3
27B's shapes (fused gate|up [43008, 5376], down [5376, 21504]).

Compiled for a virtual sm_90a device on 2026-12-01 (``bench/sm90_matmul_shapes.py``):
[5376, 21504] and [43008, 5376] fail with symbolic M and compile with M = 1;
[2688, 21504], [21504, 5376], [5376, 16384], [16384, 5376], [18432, 5376]
and [262144, 5376] compile with symbolic M. Splitting W's rows in two moves
both halves off the table; the two outputs are concatenated.
"""

from __future__ import annotations

import functools
import logging

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor

logger = logging.getLogger("max.pipelines.attnquant.kernels")

SM90_SPLIT_K_SHAPES: frozenset[tuple[int, int]] = frozenset(
    {(5376, 21504), (5376, 4096), (43008, 5376), (8192, 5376), (5120, 13824), (2560, 8192)}
)
"""[N, K] of W with split-K entries in MAX 26.7's SM90 bf16 tuning tables."""

MIN_INNER_MULTIPLE = 32
"""Inner (K) widths of our matmuls with a small K are padded to this multiple.

MAX 26.7's SM90 bf16 matmul does not compile for a small K: ``[M, 12] @
[12, 1536]`` stops at ``sm90/tile_loader.mojo:501: Global memory tile must
match source layout element count`` (virtual sm_90a, 2026-12-01; N = 12
compiles). The theta residual ``(x V) U^T`` has K = the rank: on the H200,
rank 4 failed to compile and rank 32 (K = 32, 64, 96) compiled and served.
``runtime_layout`` pads U and V with zero columns to a multiple of this,
which leaves the product unchanged."""


def needs_row_split(n: int, k: int, dtype: DType, device_api: str, m_is_static: bool) -> bool:
    """Whether ``x @ W.T`` (W [N, K]) would reach MAX 26.7's uncompilable
    split-K path: bf16 on an NVIDIA GPU, symbolic M, a tabled shape."""
    return device_api == "cuda" and dtype == DType.bfloat16 and not m_is_static and (n, k) in SM90_SPLIT_K_SHAPES


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` (x [..., K], weight [N, K]) with MAX's matmul."""
    n, k = (int(d) for d in weight.shape)
    m = x.shape[0] if x.rank == 2 else None
    m_is_static = m is not None and is_static_dim(m)
    if not needs_row_split(n, k, x.dtype, str(x.device.api), m_is_static):
        return x @ weight.T
    _log_split(n, k)
    return row_split_linear(x, weight)


def row_split_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` as two matmuls over the two halves of weight's rows."""
    n = int(weight.shape[0])
    top, bottom = F.split(weight, [n // 2, n - n // 2], axis=0)
    return F.concat([x @ top.T, x @ bottom.T], axis=-1)


@functools.lru_cache(maxsize=None)
def _log_split(n: int, k: int) -> None:
    logger.info(
        "bf16 matmul [%d, %d] on NVIDIA: two halves of %d rows (MAX 26.7's SM90 split-K "
        "configuration for this shape does not compile with a symbolic token count)",
        n, k, n // 2,
    )  # fmt: skip


def is_static_dim(dim: object) -> bool:
    """Whether a graph dimension is a known integer (not a symbol)."""
    try:
        int(dim)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return True
