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

MAX 26.7's bf16 matmul on sm_90 also goes wrong when the token count M is
not a multiple of 64 (and not 1, which runs a GEMV). On the H200 (run 12,
2026-12-02, ``bench/max_gpu_patterns_check.py``, docs/throughput.md) a graph
of the Gemma 3 1B projection groups came back wrong at M = 2 to 63, 65 and
96 (relative error up to 1.0, what all-zero rows give; torch 1.7e-3), right
at M = 1, 64 and 128. Every figure fits one reading: each matmul stores its
last, partial 64-row tile whole, and the ``64 - M % 64`` rows of zeros past
its end land in the buffer after it (its neighbour's output; in a model,
whatever MAX placed there). MAX's own Gemma 3 departs from transformers at
3- and 12-token prompts and not at 1. :func:`linear` pads the rows to a
multiple of 64 on sm_90 (zero rows inside a buffer of our own, sliced off
after); with it our model's logits are transformers' (bf16 rounding) at
1, 3 and 12 tokens. modular/modular#6883 reports the same symptom on the H100.
With the padding GEMM's greedy text is torch's too (run 13). It costs 0.27 to
0.35 ms per token at batch 1 on the 1B geometry (+12-15 %, against the
unpadded graph in one session), though one row is not padded: the added
concatenation and slice per group are the likely cost.
``ATTNQUANT_ROW_PADDING`` turns the padding off (a MAX with the fix) or on for
every device; :func:`set_row_padding` applies it to the graphs built after a load.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from max.driver import Device
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import Dim

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


SM90_ROW_TILE = 64
"""Row (token) counts of bf16 matmuls on sm_90 are padded to a multiple of this
(or left at 1): MAX 26.7's kernel writes a partial tile of this many rows past
the end of its output."""


_row_padding: bool | None = None
"""ATTNQUANT_ROW_PADDING of the last load (None: auto). Module state because
MAX traces the projections' forward long after the load that knows the
setting; a server process loads one configuration."""


def set_row_padding(mode: bool | None) -> None:
    """Applies ATTNQUANT_ROW_PADDING (None: auto, True: every device, False:
    never) to the graphs built from now on."""
    global _row_padding
    _row_padding = mode


def needs_row_padding(dtype: DType, device_api: str, device_arch: str, m: object, mode: bool | None = None) -> bool:
    """Whether to pad a ``[M, K]`` input's rows.

    ``mode`` None (auto): where MAX 26.7's partial-row-tile bug can strike:
    bf16 on an sm_90 GPU (the only one it was seen on), with M symbolic or a
    static M other than 1 that is not a multiple of :data:`SM90_ROW_TILE`.
    True: any such M on any device and dtype; False: never."""
    if mode is False:
        return False
    sm90_bf16 = device_api == "cuda" and device_arch.startswith("sm_90") and dtype == DType.bfloat16
    if mode is None and not sm90_bf16:
        return False
    return not is_static_dim(m) or (int(m) > 1 and int(m) % SM90_ROW_TILE != 0)


def padded_row_count(m: Dim) -> Dim:
    """``m`` rounded up to a multiple of :data:`SM90_ROW_TILE`, but 1 stays 1.

    One row runs MAX's GEMV, which is right and reads each weight once; padding
    it to 64 would trade that for the tile kernel on every decode step. As one
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


def on_full_row_tiles(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``fn(x)`` for a row-wise ``fn`` of MAX matmuls, its rows padded where
    :func:`needs_row_padding` says MAX's kernel would write past its output.
    Only rank-2 inputs (our models' ``[tokens, hidden]``) are padded."""
    if x.rank != 2:
        return fn(x)
    api, arch, m = str(x.device.api), device_arch(x.device), x.shape[0]
    if not needs_row_padding(x.dtype, api, arch, m, _row_padding):
        if needs_row_padding(x.dtype, api, arch, m):  # auto would pad: turned off by the setting
            _warn_unpadded(arch)
        return fn(x)
    _log_padding(arch or api, _row_padding)
    return with_padded_rows(fn, x)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` (x [..., K], weight [N, K]) with MAX's matmul, its
    rows padded on sm_90 (:func:`on_full_row_tiles`)."""
    return on_full_row_tiles(functools.partial(linear_as_given, weight=weight), x)


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


@functools.lru_cache(maxsize=None)
def _log_padding(where: str, mode: bool | None) -> None:
    why = (
        "ATTNQUANT_ROW_PADDING=1" if mode else
        f"MAX 26.7's sm_90 matmul writes a partial {SM90_ROW_TILE}-row tile past its output; "
        "docs/throughput.md, run 12"
    )  # fmt: skip
    logger.info("attnquant: matmuls on %s: token rows padded to a multiple of %d (%s)", where, SM90_ROW_TILE, why)


@functools.lru_cache(maxsize=None)
def _warn_unpadded(arch: str) -> None:
    logger.warning(
        "attnquant: ATTNQUANT_ROW_PADDING=0 on %s: bf16 matmuls run unpadded; MAX 26.7's sm_90 matmul "
        "then gives wrong outputs after prefills of 2-63 tokens (docs/throughput.md, run 12). "
        "Unset it unless your MAX has the fix.",
        arch,
    )  # fmt: skip


def device_arch(device: Device) -> str:
    """The device's architecture name (e.g. ``"sm_90a"``); empty for the CPU."""
    return "" if device.api == "cpu" else str(device.architecture_name)


def is_static_dim(dim: object) -> bool:
    """Whether a graph dimension is a known integer (not a symbol)."""
    try:
        int(dim)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return False
    return True
