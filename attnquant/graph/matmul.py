"""``x @ W.T`` through MAX's matmul, clear of MAX 26.7's sm_90 problems.

Two workarounds (``attnquant.max_compat`` states each problem; the padding
decision is made once at load and arrives here as a
:class:`~attnquant.max_compat.RowPadding`):

* token rows padded to full 64-row tiles, so MAX's kernel never writes a
  partial tile past its output (:func:`on_full_row_tiles`);
* W's rows split in two where MAX's split-K configuration for the shape does
  not compile with a symbolic token count (:func:`linear_as_given`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, Dim, TensorType

from attnquant.config import LOGGER_NAME
from attnquant.max_compat import SM90_ROW_TILE, RowPadding, needs_row_split

logger = logging.getLogger(LOGGER_NAME)


def is_static_dim(dim: object) -> bool:
    """Whether a graph dimension is a known integer (not a symbol)."""
    try:
        int(dim)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return True


def in_enclosing_block(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` brought into the block being built.

    A ModuleV3 weight enters the graph where it is first used; first used
    inside one branch of ``F.cond``, it would not dominate the other branch
    and the graph fails to build. A same-shape reshape is a view."""
    return [F.reshape(t, list(t.shape)) for t in tensors]


def padded_row_count(m: Dim) -> Dim:
    """``m`` rounded up to a multiple of :data:`SM90_ROW_TILE`, but 1 stays 1.

    One row runs MAX's GEMV, which is right and reads each weight once. As one
    expression of ``m`` (no run-time branch): ``64 // (m + 63)`` is 1 exactly
    when m = 1, and takes the 63 padding rows back off.
    """
    tile = SM90_ROW_TILE
    # Dim(tile) on the left: MAX 26.7's int // Dim recurses forever.
    return ((m + (tile - 1)) // tile) * tile - (tile - 1) * (Dim(tile) // (m + (tile - 1)))


def with_padded_rows(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` for a row-wise ``fn``, computed on ``x`` [M, K] with zero rows
    appended up to :func:`padded_row_count` and the result's first M rows kept."""
    m, k = x.shape
    zeros = F.broadcast_to(F.constant(0, x.dtype, device=x.device), [padded_row_count(m) - m, k])
    return fn(F.concat([x, zeros], axis=0))[:m]


def on_full_row_tiles(
    fn: Callable[[Tensor], Tensor], x: Tensor, padding: RowPadding, *, out_features: int | Dim | None = None
) -> Tensor:
    """``fn(x)`` for a row-wise ``fn`` of MAX matmuls ([M, K] -> [M, out_features]),
    its rows padded as ``padding`` says. Only rank-2 inputs (our models'
    ``[tokens, hidden]``) are padded. With ``RowPadding.BRANCH`` the operands
    ``fn`` reads must already be in the enclosing block (:func:`in_enclosing_block`),
    and ``out_features`` is required (the branch's result type)."""
    if padding is RowPadding.OFF or x.rank != 2:
        return fn(x)
    m = x.shape[0]
    if is_static_dim(m):
        return fn(x) if int(m) == 1 or int(m) % SM90_ROW_TILE == 0 else with_padded_rows(fn, x)
    if padding is RowPadding.FIXED:
        return with_padded_rows(fn, x)
    assert out_features is not None, "RowPadding.BRANCH needs out_features"
    one_row = F.shape_to_tensor([m])[0] == 1
    out = TensorType(x.dtype, [m, out_features], DeviceRef.from_device(x.device))
    (y,) = F.cond(one_row, [out], lambda: fn(x), lambda: with_padded_rows(fn, x))
    return y


def run_on_padded_rows(module: Module[[Tensor], Tensor]) -> None:
    """Makes ``module``, a MAX module we do not build that maps [M, K] rows to
    [M, N] rows with MAX matmuls (a ``Linear``, an ``MLP``), run its forward on
    rows padded to full tiles (``RowPadding.FIXED``: its weights are first read
    inside its forward, so they cannot sit behind the one-row branch).

    Its class is swapped for a subclass whose ``forward`` pads: its children,
    parameters and their names stay as they are, so MAX loads its weights
    unchanged. Applying it twice pads once."""
    if not getattr(type(module), "rows_padded", False):
        module.__class__ = _row_padded_class(type(module))


@functools.cache
def _row_padded_class(cls: type[Module[[Tensor], Tensor]]) -> type[Module[[Tensor], Tensor]]:
    def forward(self: Module[[Tensor], Tensor], x: Tensor) -> Tensor:
        return on_full_row_tiles(functools.partial(cls.forward, self), x, RowPadding.FIXED)

    return type(f"RowPadded{cls.__name__}", (cls,), {"forward": forward, "rows_padded": True, "__module__": __name__})


def linear(x: Tensor, weight: Tensor, padding: RowPadding = RowPadding.OFF) -> Tensor:
    """``x @ weight.T`` (x [..., K], weight [N, K]) with MAX's matmul, rows
    padded as ``padding`` says (:func:`on_full_row_tiles`)."""
    if padding is RowPadding.BRANCH:
        (weight,) = in_enclosing_block([weight])
    return on_full_row_tiles(
        functools.partial(linear_as_given, weight=weight), x, padding, out_features=weight.shape[0]
    )


def linear_as_given(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` with MAX's matmul on ``x``'s rows as they are (no
    padding), split where MAX 26.7 cannot compile the shape."""
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
        "attnquant: bf16 matmul [%d, %d] on NVIDIA: two halves of %d rows (MAX 26.7's SM90 split-K "
        "configuration for this shape does not compile with a symbolic token count)",
        n, k, n // 2,
    )  # fmt: skip
