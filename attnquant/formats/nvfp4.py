"""The NVFP4 weight format: quantize, dequantize, and the decode tables.

An NVFP4 tensor stores each weight as a 4-bit E2M1 code, two codes per byte
(low nibble = even index), one E4M3 scale per 16-element block of a row, and
one float32 scale for the whole tensor::

    w[n, k] ~= e2m1(code[n, k]) * e4m3(block_scale[n, k // 16]) * global_scale

:func:`quantize` is byte-identical to MAX's host reference
``max.pipelines.weights.fp4_quantization.quantize_nvfp4`` (same codes, same
scale bits, same global scale) for float32, bfloat16 and float16 inputs: it
repeats the reference's float32 operations in the same order, including its
double rounding of the global scale (``1 / (2688 / amax)``), its saturation of
zero-scale blocks to ``FLT_MAX`` and its sign rule (a negative value that
rounds to zero keeps its sign bit; ``-0.0`` does not).

It is fast because of one observation: inside a tensor, an element's code
depends only on its block's E4M3 scale code (at most 127 values) and on the
element's own bits. For 16-bit inputs that is a table of 65536 entries per
scale code, built once per tensor with the exact arithmetic, after which each
element costs one table lookup instead of a dozen float passes.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn, Protocol

import torch

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLOAT32_MAX = torch.finfo(torch.float32).max

# Value of each 4-bit E2M1 code: bit 3 is the sign, bits 0-2 index the
# magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

_E4M3_MAX_FINITE_CODE = 0x7E  # 0x7F is NaN in E4M3 (the "fn" variant).
_E2M1_SIGN_BIT = 8
_HALF_ULP_MAGIC = 2.0**22  # float32 ulp at 2**22 is 0.5, E2M1's subnormal step.
_HALF_ULP_MAGIC_BITS = (127 + 22) << 23
_TABLE_DTYPES = (torch.bfloat16, torch.float16)
_NATIVE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SIGNED_BITS_DTYPE = {2: torch.int16, 4: torch.int32}
_TABLE_PAYOFF = 2  # tabulate when the tensor has >= 2x the table's elements
# Row chunks bound the working memory. On a CPU they are also kept small
# enough to stay in cache (16 MiB of int32 table indices); on an accelerator
# every chunk costs a dozen kernel launches and a sync, so they are larger.
_CPU_CHUNK_ELEMENTS = 1 << 22
_ACCELERATOR_CHUNK_ELEMENTS = 1 << 24
# The scale search holds a float32 error per element and candidate; on a CPU
# its chunks are bounded to this many errors so that they stay in cache.
_CPU_SEARCH_ERRORS = 1 << 21

# The byte-pair packing trick in _pack_pairs reads two uint8 codes as one
# int16, which is only the (low, high) pair on little-endian hosts.
assert sys.byteorder == "little", "attnquant.formats.nvfp4 assumes a little-endian host"


class ScalePolicy(enum.Enum):
    """How each 16-element block's E4M3 scale is chosen."""

    RTN = "rtn"
    """The reference: round ``block_amax / 6`` to the nearest E4M3 value."""

    MSE = "mse"
    """Try the RTN scale and its E4M3 neighbours; keep the one with the
    smallest squared reconstruction error of the block (RTN wins ties)."""

    WEIGHTED = "weighted"
    """Try the RTN scale and the E4M3 codes from two below to six above it;
    keep the one with the smallest squared error of the block weighted per
    input column by an importance (the second moment of that input, estimated
    from the checkpoint: ``attnquant.load.importance``; equal weights without
    one). RTN wins ties."""


# E4M3 codes tried, as offsets from RTN's: consecutive codes, so that a table
# holds a block's candidates side by side (_TabulatedErrors). RTN is tried
# first, then the others from the lowest up (_least_error_codes). With 3
# mantissa bits one code is a factor of about 1.07-1.14: MSE's span
# [0.78, 1.125] x the RTN scale; WEIGHTED's [0.84, 1.69] x, which reaches the
# blocks whose largest element is better clipped (scale-to-4 rather than
# scale-to-6).
_SEARCH_WINDOWS = {ScalePolicy.MSE: range(-3, 2), ScalePolicy.WEIGHTED: range(-2, 7)}


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4-quantized [N, K] weight.

    Attributes:
        packed: uint8 [N, K/2]; two E2M1 codes per byte, low nibble first.
        block_scales: float8_e4m3fn [N, K/16]; per-block decode scales.
        global_scale: float32 0-d; the tensor decode scale (~ amax / 2688).
    """

    packed: torch.Tensor
    block_scales: torch.Tensor
    global_scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.packed.dtype != torch.uint8 or self.packed.dim() != 2:
            raise ValueError(
                f"NVFP4Weight.packed must be a 2-D uint8 tensor, got "
                f"{self.packed.dtype} {tuple(self.packed.shape)}"
            )
        n, half_k = self.packed.shape
        expected = (n, 2 * half_k // BLOCK_SIZE)
        if (
            self.block_scales.dtype != torch.float8_e4m3fn
            or tuple(self.block_scales.shape) != expected
        ):
            raise ValueError(
                f"NVFP4Weight.block_scales must be float8_e4m3fn {expected} to "
                f"match packed {tuple(self.packed.shape)}, got "
                f"{self.block_scales.dtype} {tuple(self.block_scales.shape)}"
            )
        if self.global_scale.dtype != torch.float32 or self.global_scale.dim():
            raise ValueError(
                f"NVFP4Weight.global_scale must be a float32 0-d tensor, got "
                f"{self.global_scale.dtype} {tuple(self.global_scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """The [N, K] shape of the weight this encodes."""
        n, half_k = self.packed.shape
        return n, 2 * half_k

    def block_scale_bits(self) -> torch.Tensor:
        """The block scales as uint8 bit patterns (MAX has no CPU float8)."""
        return self.block_scales.view(torch.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes of packed codes, block scales and the global scale."""
        return self.packed.numel() + self.block_scales.numel() + 4


def served_nbytes(n: int, k: int) -> int:
    """Bytes one [N, K] projection takes once quantized and served: packed
    codes (K/2 per row), E4M3 block scales (K/16 per row), and the float32
    global and input scales (``reconstruct``'s ModelOpt-layout tensors)."""
    return n * (k // 2) + n * (k // BLOCK_SIZE) + 4 + 4


# ---------------------------------------------------------------------------
# Decode tables (shared with the graph side, which decodes on the device).
# ---------------------------------------------------------------------------


def e4m3_decode_table() -> torch.Tensor:
    """float32 [256]: the value of every E4M3 bit pattern; 0x7F/0xFF are NaN."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def packed_byte_decode_table() -> torch.Tensor:
    """float32 [256, 2]: the two E2M1 values a packed byte holds, low first."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((values[byte & 0xF], values[byte >> 4]), dim=1)


# ---------------------------------------------------------------------------
# Scalar-level primitives, each mirroring one step of the reference.
# ---------------------------------------------------------------------------


def _global_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode, decode) float32 0-d tensor scales for a tensor with this amax.

    Like the reference, decode is ``1 / encode`` (not ``amax / 2688``), and an
    all-zero tensor gets ``encode = FLT_MAX`` (2688 / 0 saturated).
    """
    assert amax.dtype == torch.float32 and amax.dim() == 0
    encode = torch.full_like(amax, E2M1_MAX * E4M3_MAX) / amax
    encode = encode.clamp(max=FLOAT32_MAX)
    return encode, torch.reciprocal(encode)


def _e4m3_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bit patterns of non-negative float32 values, saturating at 448."""
    assert values.dtype == torch.float32
    # torch's float8 cast rounds to nearest even; whether it saturates past
    # 448 or returns NaN has varied across releases and devices. The
    # reference saturates, so clamp first.
    return values.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _rtn_scale_codes(block_amax: torch.Tensor, global_encode: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``block_amax / 6``, in global-encoded units (the reference)."""
    assert block_amax.dtype == torch.float32
    # Divided by a tensor on the same device, never by a Python number: CUDA
    # divides by a host scalar through its reciprocal (x * (1/6)), which is
    # not always x / 6, and the scales must be the same bits on every device.
    six = torch.full((), E2M1_MAX, dtype=torch.float32, device=block_amax.device)
    return _e4m3_codes((block_amax / six).mul_(global_encode))


def _block_decode_scales(scale_codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 E4M3 bit patterns."""
    assert scale_codes.dtype == torch.uint8
    return scale_codes.view(torch.float8_e4m3fn).float()


def _block_encode_scales(scale_codes: torch.Tensor, global_decode: torch.Tensor) -> torch.Tensor:
    """float32 multipliers that map a block's weights onto the E2M1 grid.

    A zero block scale gives 1/0 = inf, saturated to FLT_MAX as the reference
    does (so a zero block's elements still encode to +-0).
    """
    decode = _block_decode_scales(scale_codes) * global_decode
    return torch.reciprocal(decode).clamp(max=FLOAT32_MAX)


def _e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes of float32 values, round to nearest even, saturating.

    The sign bit is set exactly when the value is < 0, so -0.0 encodes as +0
    while a small negative that rounds to zero keeps its sign (as the
    reference does).
    """
    assert scaled.dtype == torch.float32
    magnitude = scaled.abs()
    bits = magnitude.view(torch.int32)
    # From 1.0 up: round the float32 mantissa to 1 bit, ties to even (add half
    # an ulp minus one, plus the kept bit), then rebase the exponent (float32
    # bias 127, E2M1 bias 1: 126 << 1 == 252). In place: this runs on every
    # element of a float32 weight and on every table entry.
    code = (bits >> 22).bitwise_and_(1).add_(0x1FFFFF).add_(bits).bitwise_right_shift_(22).sub_(252)
    # Below 1.0 (E2M1's subnormal range, step 0.5): adding 2**22, whose float32
    # ulp is 0.5, makes the FPU round to the nearest even multiple of 0.5;
    # the distance in bits is then the code (0, 1, or 2 == the code of 1.0).
    # (It overwrites ``magnitude``, and so ``bits``: both are used up.) That
    # rounding is right for every value below 2.0; take it where it gives
    # 0, 1 or 2, the values where the normal-range formula is wrong.
    subnormal = magnitude.add_(_HALF_ULP_MAGIC).view(torch.int32).sub_(_HALF_ULP_MAGIC_BITS)
    torch.where(subnormal < 3, subnormal, code, out=code)
    code = code.clamp_(0, 7).to(torch.uint8)
    sign = (scaled < 0).to(torch.uint8).mul_(_E2M1_SIGN_BIT)
    return code.bitwise_or_(sign)


def _decode_blocks(
    e2m1_values: torch.Tensor, scale_codes: torch.Tensor, global_decode: torch.Tensor
) -> torch.Tensor:
    """float32 [..., B, 16] weights from E2M1 values and their block scales.

    Same operation order as the reference dequantizer:
    ``(e2m1 * block_scale) * global_scale``.
    """
    assert e2m1_values.shape[:-1] == scale_codes.shape
    block_scales = _block_decode_scales(scale_codes).unsqueeze(-1)
    return e2m1_values * block_scales * global_decode


# ---------------------------------------------------------------------------
# Element encoders: the same map computed directly or by table lookup.
# ---------------------------------------------------------------------------


class _Scratch:
    """Buffers reused from chunk to chunk.

    A fresh multi-megabyte tensor per chunk is served by fresh pages from the
    kernel, and faulting them in costs more than the arithmetic done on them.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=self._device)
            self._buffers[key] = buffer
        return buffer[:numel].view(shape)


class _ElementEncoder(Protocol):
    """Encodes [R, B, 16] blocks given their [R, B] uint8 E4M3 scale codes."""

    def codes(self, blocks: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
        """uint8 [R, B, 16] E2M1 codes (may be a scratch buffer: use at once)."""
        ...


class _DirectEncoder:
    """Computes every element with float32 arithmetic (any float input)."""

    def __init__(self, global_decode: torch.Tensor) -> None:
        self.global_decode = global_decode
        self._e2m1 = torch.tensor(E2M1_VALUES, device=global_decode.device)

    def codes(self, blocks: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
        encode = _block_encode_scales(scale_codes, self.global_decode)
        return _e2m1_codes(blocks.float() * encode.unsqueeze(-1))

    def squared_errors(self, blocks: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
        """float64 [R, B, 16]: per-element squared error of the decoded value."""
        e2m1 = self._e2m1[self.codes(blocks, scale_codes).long()]
        decoded = _decode_blocks(e2m1, scale_codes, self.global_decode)
        # float64 so that the choice between near-equal candidates agrees with
        # an independent float64 check of the dequantized tensor.
        return (blocks.double() - decoded.double()).square()


class _TabulatedEncoder:
    """Looks codes up in per-scale-code tables of all 2**16 inputs.

    Only for 16-bit inputs. The tables are filled by :class:`_DirectEncoder`
    over every bit pattern, so the two encoders agree by construction.
    """

    COLUMNS = 1 << 16
    # Column c holds the input whose bits, read as int16, are c - 32768.
    _COLUMN_BIAS = 1 << 15

    def __init__(
        self, dtype: torch.dtype, global_decode: torch.Tensor, scale_codes_used: torch.Tensor
    ) -> None:
        assert dtype in _TABLE_DTYPES and scale_codes_used.dtype == torch.uint8
        device = global_decode.device
        self._direct = _DirectEncoder(global_decode)
        self._scale_codes = scale_codes_used.to(device)
        patterns = torch.arange(-self._COLUMN_BIAS, self._COLUMN_BIAS, device=device)
        self._grid = patterns.to(torch.int16).view(dtype).view(1, -1, BLOCK_SIZE)
        # Where each scale code's row starts, bias included; -1: no row.
        rows = torch.arange(len(self._scale_codes), dtype=torch.int32, device=device)
        self._offset_of_code = torch.full((256,), -1, dtype=torch.int32, device=device)
        self._offset_of_code[self._scale_codes.long()] = rows * self.COLUMNS + self._COLUMN_BIAS
        self._code_table = self._tabulate(self._direct.codes)
        self._scratch = _Scratch(device)

    def _tabulate(
        self, element_map: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Flat [rows * 65536] table of ``element_map`` over the whole grid."""
        rows = len(self._scale_codes)
        grid = self._grid.expand(rows, -1, -1)
        scale_codes = self._scale_codes.view(rows, 1).expand(rows, grid.shape[1])
        return element_map(grid, scale_codes).reshape(-1)

    def _indices(self, blocks: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
        offsets = self._offset_of_code.index_select(0, scale_codes.reshape(-1).int())
        # A code without a row would silently read another code's row.
        assert bool((offsets >= 0).all()), "scale code missing from the table"
        indices = self._scratch.get("indices", tuple(blocks.shape), torch.int32)
        indices.copy_(blocks.view(torch.int16))
        return indices.add_(offsets.view(*scale_codes.shape, 1)).view(-1)

    def codes(self, blocks: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
        out = self._scratch.get("codes", tuple(blocks.shape), torch.uint8)
        torch.index_select(
            self._code_table, 0, self._indices(blocks, scale_codes), out=out.view(-1)
        )
        return out


def _encoder_for(
    weight: torch.Tensor, global_decode: torch.Tensor, scale_codes: torch.Tensor
) -> _ElementEncoder:
    """The fastest exact encoder for this weight, covering these scale codes.

    Tables pay off once the tensor has a few times more elements than the
    tables (65536 per scale code in use); small tensors are encoded directly.
    """
    if weight.dtype not in _TABLE_DTYPES:
        return _DirectEncoder(global_decode)
    used = torch.bincount(scale_codes.reshape(-1), minlength=256).nonzero().view(-1).to(torch.uint8)
    if weight.numel() < _TABLE_PAYOFF * len(used) * _TabulatedEncoder.COLUMNS:
        return _DirectEncoder(global_decode)
    return _TabulatedEncoder(weight.dtype, global_decode, used)


# ---------------------------------------------------------------------------
# Scale search: each block's candidate codes, their errors and the choice.
# ---------------------------------------------------------------------------

_E2M1_STEP_MAGIC = (22 << 23)  # adds 22 to a float32 exponent


def _magnitude_errors(
    magnitudes: torch.Tensor,
    scale_codes: torch.Tensor,
    global_decode: torch.Tensor,
    out: torch.Tensor,
    magic: torch.Tensor,
) -> torch.Tensor:
    """``out``: (|w| - decoded |w|)^2 of float32 magnitudes under uint8 scale
    codes, the two broadcast to ``out``'s shape (``magic``: a scratch of it).

    The decoded value is the reference's: ``(e2m1 * block_scale) * global``,
    with the element rounded to the nearest E2M1 magnitude by one float32
    addition: adding ``2**22`` times the binade of clamp(y, 1, 4) makes the FPU
    round y to E2M1's step there (0.5 below 2, 1 up to 4, 2 above); ties round
    either way at the same error. Every step is one correctly rounded float32
    operation, so every device computes the same bits.
    """
    block_scale = _block_decode_scales(scale_codes)
    encode = torch.reciprocal(block_scale * global_decode).clamp_(max=FLOAT32_MAX)
    y = torch.mul(magnitudes, encode, out=out)
    torch.clamp(y, 1.0, 4.0, out=magic)
    magic.view(torch.int32).bitwise_and_(0x7F800000).add_(_E2M1_STEP_MAGIC)
    y.add_(magic).sub_(magic).clamp_(max=E2M1_MAX)
    y.mul_(block_scale).mul_(global_decode)
    torch.sub(magnitudes, y, out=y)
    return y.mul_(y)


def _window_codes(rtn_codes: torch.Tensor, window: range) -> Iterator[torch.Tensor]:
    """The E4M3 codes ``window`` away from each RTN code, kept inside the finite codes."""
    widened = rtn_codes.to(torch.int16)
    for offset in window:
        yield (widened + offset).clamp_(0, _E4M3_MAX_FINITE_CODE).to(torch.uint8)


class _CandidateErrors(Protocol):
    """Each element's squared error under every candidate scale of its block."""

    window: range

    def errors(self, blocks: torch.Tensor, rtn_codes: torch.Tensor) -> torch.Tensor:
        """float32 [16, R, B, C] (element-major: the block sums then add
        contiguous rows) for [R, B, 16] blocks: element j of block (r, b)
        under code ``rtn_codes[r, b] + window[c]``, clamped to the finite
        codes (a scratch buffer: use at once)."""
        ...


class _DirectErrors:
    """Computes every candidate's errors with float32 arithmetic (any float input)."""

    def __init__(self, global_decode: torch.Tensor, window: range) -> None:
        self.global_decode = global_decode
        self.window = window
        self._scratch = _Scratch(global_decode.device)

    def errors(self, blocks: torch.Tensor, rtn_codes: torch.Tensor) -> torch.Tensor:
        magnitudes = blocks.float().abs().permute(2, 0, 1).contiguous()
        shape = tuple(magnitudes.shape)
        # Candidate-major, so that each candidate writes one contiguous slice.
        out = self._scratch.get("errors", (len(self.window), *shape), torch.float32)
        magic = self._scratch.get("magic", shape, torch.float32)
        for index, codes in enumerate(_window_codes(rtn_codes, self.window)):
            _magnitude_errors(magnitudes, codes, self.global_decode, out[index], magic)
        return out.permute(1, 2, 3, 0)


class _TabulatedErrors:
    """Looks each element's errors under all its block's candidates up at once.

    Only for 16-bit inputs. An element's error depends only on its magnitude
    (15 bits) and the scale code, so a float32 table [32768, codes] filled by
    :func:`_magnitude_errors` (the direct arithmetic) holds every error the
    search can need. Its columns are consecutive codes, so the candidates of a
    block, a window of consecutive codes, sit side by side in a row: one
    gather of ``len(window)`` adjacent floats per element replaces a gather
    and an index computation per candidate.
    """

    MAGNITUDES = 1 << 15

    def __init__(
        self, dtype: torch.dtype, global_decode: torch.Tensor, rtn_range: tuple[int, int], window: range
    ) -> None:
        assert dtype in _TABLE_DTYPES
        device = global_decode.device
        self.window = window
        self._first_rtn, last_rtn = rtn_range
        # Column i is code first_rtn + window.start + i, clamped to the finite
        # codes as the candidates are (so a clamped window still reads its own).
        columns = torch.arange(self._first_rtn + window.start, last_rtn + window.stop, device=device)
        self._columns = len(columns)
        codes = columns.clamp_(0, _E4M3_MAX_FINITE_CODE).to(torch.uint8).view(1, -1)
        bits = torch.arange(self.MAGNITUDES, dtype=torch.int32, device=device).to(torch.int16)
        magnitudes = bits.view(dtype).float().view(-1, 1)
        table = torch.empty(self.MAGNITUDES, self._columns, device=device)
        _magnitude_errors(magnitudes, codes, global_decode, table, torch.empty_like(table))
        # Row i of this overlapping view is the window that starts at flat
        # entry i: magnitude i // columns, RTN code first_rtn + i % columns.
        self._windows = table.view(-1).unfold(0, len(window), 1)
        self._scratch = _Scratch(device)

    def errors(self, blocks: torch.Tensor, rtn_codes: torch.Tensor) -> torch.Tensor:
        """As :meth:`_CandidateErrors.errors`; ``rtn_codes`` inside the
        ``rtn_range`` the table was made for (another code would silently read
        another code's errors)."""
        window_starts = rtn_codes.to(torch.int32).sub_(self._first_rtn)
        bits = blocks.view(torch.int16).permute(2, 0, 1)
        rows = self._scratch.get("rows", tuple(bits.shape), torch.int32)
        torch.bitwise_and(bits, 0x7FFF, out=rows)  # the magnitude's bits
        rows.mul_(self._columns).add_(window_starts)
        out = self._scratch.get("errors", (*bits.shape, len(self.window)), torch.float32)
        torch.index_select(self._windows, 0, rows.view(-1), out=out.view(-1, len(self.window)))
        return out


def _candidate_errors_for(
    weight: torch.Tensor, global_decode: torch.Tensor, rtn_codes: torch.Tensor, window: range
) -> _CandidateErrors:
    """The fastest exact error source for this weight's scale search.

    The table pays off once the search would compute a few times more errors
    directly (elements x candidates) than the table holds.
    """
    if weight.dtype not in _TABLE_DTYPES:
        return _DirectErrors(global_decode, window)
    rtn_range = int(rtn_codes.min()), int(rtn_codes.max())
    table_size = _TabulatedErrors.MAGNITUDES * (rtn_range[1] - rtn_range[0] + len(window))
    if weight.numel() * len(window) < _TABLE_PAYOFF * table_size:
        return _DirectErrors(global_decode, window)
    return _TabulatedErrors(weight.dtype, global_decode, rtn_range, window)


def _block_sums(errors: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """float32 [R, B, C] (a view into ``errors``) from [16, R, B, C] element
    errors (overwritten), weighted by ``importance`` ([16, 1, B, 1] float32)
    when given.

    A fixed tree of elementwise adds rather than ``sum``: a reduction's order
    may differ between devices and thread counts, and with it the rounding, and
    so which of two near-equal candidates wins. Every step here is one
    correctly rounded IEEE operation on the same operands everywhere, so a CPU
    and a GPU choose the same scales (the quantized-weight cache is shared).
    """
    if importance is not None:
        errors.mul_(importance)
    half = BLOCK_SIZE // 2
    while half:
        errors[:half].add_(errors[half : 2 * half])
        half //= 2
    return errors[0]


_FLOAT32_INF_BITS = 0x7F800000
_RANK_BITS = 4  # room for a candidate's rank below the error bits (C <= 16)


@dataclass(frozen=True)
class _SearchOrder:
    """The order in which a window's candidates are tried: RTN (offset 0)
    first, then the others from the lowest code up."""

    ranks: torch.Tensor  # int32 [C, 1, 1]: each candidate's place in that order
    offsets: torch.Tensor  # int16 [C]: the offset tried at each place
    rtn: int  # RTN's candidate index

    @staticmethod
    def of(window: range, device: torch.device) -> _SearchOrder:
        tried = sorted(window, key=lambda offset: (offset != 0, offset))
        assert len(tried) <= 1 << _RANK_BITS
        ranks = [tried.index(offset) for offset in window]
        return _SearchOrder(
            torch.tensor(ranks, dtype=torch.int32, device=device).view(-1, 1, 1),
            torch.tensor(tried, dtype=torch.int16, device=device),
            window.index(0),
        )


def _least_error_codes(sums: torch.Tensor, rtn_codes: torch.Tensor, order: _SearchOrder) -> torch.Tensor:
    """uint8 [R, B]: per block, the candidate code with the least of the
    [R, B, C] error sums.

    The rule is sequential: the candidates are tried in ``order``, each kept
    only when strictly better than the best so far. So RTN keeps every tie, a
    NaN sum (an infinite error times a zero importance) never wins, and a NaN
    RTN sum is never beaten. Computed here without a compare-and-select per
    candidate (bool masks are slow on a CPU): on the sums' bits with the sign
    cleared, whose integer order is the float order (-0.0 == +0.0, NaN above
    all), the winner is the first candidate in ``order`` whose bits are the
    least: two integer minima over the candidates.
    """
    bits = sums.permute(2, 0, 1).contiguous().view(torch.int32).bitwise_and_(0x7FFFFFFF)
    rtn_bits = bits[order.rtn]
    rtn_bits.masked_fill_(rtn_bits > _FLOAT32_INF_BITS, 0)  # a NaN RTN sum is never beaten
    least = bits.amin(0)
    # Per candidate, 0 if it reaches the least sum, else 1, then its rank.
    keys = bits.sub_(least).clamp_(max=1).bitwise_left_shift_(_RANK_BITS).bitwise_or_(order.ranks)
    winners = keys.amin(0).bitwise_and_((1 << _RANK_BITS) - 1)
    offsets = order.offsets.index_select(0, winners.view(-1)).view(rtn_codes.shape)
    return offsets.add_(rtn_codes).clamp_(0, _E4M3_MAX_FINITE_CODE).to(torch.uint8)


def _searched_scale_codes(
    weight: torch.Tensor,
    rtn_codes: torch.Tensor,
    candidates: _CandidateErrors,
    chunk_rows: int,
    importance: torch.Tensor | None,
) -> torch.Tensor:
    """Per block, the candidate scale code with the least (weighted) squared error."""
    weights = None
    if importance is not None:  # [16, 1, B, 1]: element j of every block b is column 16 b + j
        weights = importance.to(weight.device, torch.float32).view(-1, BLOCK_SIZE).t()
        weights = weights.reshape(BLOCK_SIZE, 1, -1, 1).contiguous()
    order = _SearchOrder.of(candidates.window, weight.device)
    best_codes = torch.empty_like(rtn_codes)
    for rows in _row_chunks(weight.shape[0], chunk_rows):
        errors = candidates.errors(_blocks(weight[rows]), rtn_codes[rows])
        sums = _block_sums(errors, weights)
        best_codes[rows] = _least_error_codes(sums, rtn_codes[rows], order)
    return best_codes


# ---------------------------------------------------------------------------
# Tensor-level steps.
# ---------------------------------------------------------------------------


def _checked_input(weight: torch.Tensor, name: str) -> torch.Tensor:
    """The weight as a contiguous [N, K] tensor the encoders read natively."""
    if not isinstance(weight, torch.Tensor):
        raise ValueError(
            f"NVFP4 input {name!r} must be a torch.Tensor, got {type(weight).__name__}"
        )
    if weight.dim() != 2 or weight.numel() == 0:
        raise ValueError(
            f"NVFP4 input {name!r} must be a non-empty 2-D [N, K] tensor, got shape "
            f"{tuple(weight.shape)}; quantize only linear-layer weights"
        )
    if not weight.is_floating_point():
        raise ValueError(f"NVFP4 input {name!r} must be floating point, got {weight.dtype}")
    k = weight.shape[1]
    if k % BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 input {name!r} has K = {k} (shape {tuple(weight.shape)}), which is not "
            f"a multiple of {BLOCK_SIZE}; leave this module unquantized (add it to "
            f"ATTNQUANT_QUANT_IGNORE / --ignore)"
        )
    # float64 and other types are rounded to float32 first: the format (and
    # the reference's arithmetic) is float32 throughout.
    weight = weight if weight.dtype in _NATIVE_DTYPES else weight.float()
    return weight.contiguous()


def _default_chunk_rows(device: torch.device, row_length: int) -> int:
    elements = _CPU_CHUNK_ELEMENTS if device.type == "cpu" else _ACCELERATOR_CHUNK_ELEMENTS
    return max(1, elements // row_length)


def _search_chunk_rows(device: torch.device, row_length: int, window: range, chunk_rows: int) -> int:
    """Rows per chunk of the scale search, whose buffers hold an error per
    element and candidate: ``chunk_rows``' elements' worth of errors at most,
    and on a CPU few enough to stay in cache."""
    rows = chunk_rows // len(window)
    if device.type == "cpu":
        rows = min(rows, _CPU_SEARCH_ERRORS // (row_length * len(window)))
    return max(1, rows)


def _row_chunks(num_rows: int, chunk_rows: int) -> Iterator[slice]:
    for start in range(0, num_rows, chunk_rows):
        yield slice(start, min(start + chunk_rows, num_rows))


def _blocks(rows: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K/16, 16] view."""
    return rows.view(rows.shape[0], -1, BLOCK_SIZE)


def _block_amax(weight: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """float32 [N, K/16]: max |w| per block.

    Computed on the integer bits with the sign bit cleared: for non-negative
    floats integer order is value order, and NaN sorts above Inf, so a
    non-finite input shows up in the result.
    """
    n, k = weight.shape
    bits = weight.view(_SIGNED_BITS_DTYPE[weight.element_size()])
    magnitude_mask = torch.iinfo(bits.dtype).max
    scratch = _Scratch(weight.device)
    out = torch.empty(n, k // BLOCK_SIZE, device=weight.device)
    for rows in _row_chunks(n, chunk_rows):
        chunk = bits[rows]
        magnitudes = scratch.get("magnitudes", tuple(chunk.shape), bits.dtype)
        torch.bitwise_and(chunk, magnitude_mask, out=magnitudes)
        # Max of the two half-blocks first: an elementwise max over 8-wide
        # runs vectorizes far better than a 16-wide reduction per block.
        pairs = magnitudes.view(-1, 2, BLOCK_SIZE // 2)
        halves = scratch.get("halves", (pairs.shape[0], BLOCK_SIZE // 2), bits.dtype)
        torch.maximum(pairs[:, 0], pairs[:, 1], out=halves)
        block_bits = scratch.get("block_bits", (len(chunk), k // BLOCK_SIZE), bits.dtype)
        torch.amax(halves.view(block_bits.shape + (-1,)), dim=-1, out=block_bits)
        out[rows] = block_bits.view(weight.dtype)
    return out


def _raise_non_finite(weight: torch.Tensor, name: str) -> NoReturn:
    row, col = (~torch.isfinite(weight)).nonzero()[0].tolist()
    raise ValueError(
        f"NVFP4 input {name!r} contains NaN or Inf (first at [{row}, {col}] = "
        f"{weight[row, col].item()}); fix the checkpoint or leave this module unquantized"
    )


def _checked_importance(importance: torch.Tensor, k: int, name: str) -> torch.Tensor:
    if importance.shape != (k,) or not importance.is_floating_point():
        raise ValueError(
            f"{name}: the importance must be a float [{k}] vector (one per input column), "
            f"got {importance.dtype} {tuple(importance.shape)}"
        )
    if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
        raise ValueError(f"{name}: the importance must be finite and non-negative")
    return importance.float()


def _pack_pairs(codes: torch.Tensor, out: torch.Tensor, scratch: _Scratch) -> None:
    """Writes uint8 [R, K] codes into uint8 [R, K/2] ``out``, even index low.

    Read as int16, a byte pair (lo, hi) is ``lo | hi << 8``; OR-ing in a copy
    shifted right by 4 puts ``hi << 4`` beside ``lo`` in the low byte, and the
    copy to uint8 keeps only that byte.
    """
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 2 * out.shape[-1]
    pairs = codes.view(torch.int16)
    packed = scratch.get("pairs", tuple(pairs.shape), torch.int16)
    torch.bitwise_right_shift(pairs, 4, out=packed)
    out.copy_(packed.bitwise_or_(pairs))


def quantize(
    weight: torch.Tensor,
    *,
    scale_policy: ScalePolicy = ScalePolicy.RTN,
    chunk_rows: int | None = None,
    name: str = "weight",
    amax: float | None = None,
    importance: torch.Tensor | None = None,
) -> NVFP4Weight:
    """Quantizes a [N, K] weight to NVFP4 along K, on the weight's device.

    Args:
        weight: float32, bfloat16 or float16 (other float dtypes are rounded
            to float32 first); K a multiple of 16; every element finite.
        scale_policy: how block scales are chosen. RTN is byte-identical to
            MAX's reference; MSE and WEIGHTED search other scales per block
            (the element codes are the reference's for the scale chosen).
        chunk_rows: rows processed at a time (default: about 4M elements on
            a CPU, 16M on an accelerator); bounds the working memory beyond
            the input and the output.
        name: what to call the tensor in error messages.
        amax: the absolute maximum the global scale is derived from; default
            the weight's own. Tensors quantized with one ``amax`` share a
            global scale, as ModelOpt gives the members of a fused layer
            (q|k|v, gate|up), so the fused matmul needs no per-row scale.
        importance: WEIGHTED only: float [K], >= 0, how much each input
            column's error counts (None: equally).

    Raises:
        ValueError: for a non-2-D, empty or non-float tensor, a K that is not
            a multiple of 16, a NaN/Inf element, an ``amax`` below the
            weight's own, or a bad importance.
    """
    weight = _checked_input(weight, name)
    n, k = weight.shape
    if importance is not None:
        if scale_policy is not ScalePolicy.WEIGHTED:
            raise ValueError(f"{name}: an importance is only used by the weighted scale search")
        importance = _checked_importance(importance, k, name)
    chunk_rows = _default_chunk_rows(weight.device, k) if chunk_rows is None else chunk_rows
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")

    block_amax = _block_amax(weight, chunk_rows)
    own_amax = block_amax.max()
    if not torch.isfinite(own_amax):
        _raise_non_finite(weight, name)
    if amax is not None and not own_amax.item() <= amax:
        raise ValueError(f"{name}: amax {amax} is below the tensor's own {own_amax.item()}")
    global_encode, global_decode = _global_scales(
        own_amax if amax is None else torch.tensor(amax, dtype=torch.float32, device=weight.device)
    )
    scale_codes = _rtn_scale_codes(block_amax, global_encode)

    if scale_policy is not ScalePolicy.RTN:
        window = _SEARCH_WINDOWS[scale_policy]
        candidates = _candidate_errors_for(weight, global_decode, scale_codes, window)
        search_rows = _search_chunk_rows(weight.device, k, window, chunk_rows)
        scale_codes = _searched_scale_codes(weight, scale_codes, candidates, search_rows, importance)
    encoder = _encoder_for(weight, global_decode, scale_codes)

    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scratch = _Scratch(weight.device)
    for rows in _row_chunks(n, chunk_rows):
        codes = encoder.codes(_blocks(weight[rows]), scale_codes[rows])
        _pack_pairs(codes.view(-1, k), packed[rows], scratch)
    return NVFP4Weight(packed, scale_codes.view(torch.float8_e4m3fn), global_decode)


def dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight an NVFP4 tensor decodes to (float32 math, then ``dtype``)."""
    n, k = q.shape
    byte_values = packed_byte_decode_table().to(q.packed.device)
    scale_codes = q.block_scale_bits()
    out = torch.empty(n, k, dtype=dtype, device=q.packed.device)
    for rows in _row_chunks(n, _default_chunk_rows(q.packed.device, k)):
        pairs = byte_values.index_select(0, q.packed[rows].reshape(-1).int())
        decoded = _decode_blocks(
            pairs.view(-1, k // BLOCK_SIZE, BLOCK_SIZE), scale_codes[rows], q.global_scale
        )
        out[rows] = decoded.view(-1, k)
    return out
