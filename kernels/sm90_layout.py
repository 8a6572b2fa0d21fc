"""Load-time weight layout for the mojo-sm90 NVFP4 kernel (pure torch, no MAX).

Kept free of MAX imports so the kernel benchmark can prepare weights on a
machine that has only torch; the ``mojo-sm90`` backend
(``attnquant.graph.nvfp4.sm90``) applies it at load.
"""

from __future__ import annotations

import functools

import torch

from attnquant.formats.nvfp4 import BLOCK_SIZE as BLOCK  # codes per E4M3 scale

TILE_N = 16  # rows per mma tile
TILE_K = 64  # k per prepared tile: 4 scale blocks, 4 mma k-steps


# Tile = 16 rows x 64 k: 512 code bytes + 64 scale bytes, tiles ordered
# [n_tile][k_group]. Lane l = 4g + q of the warp reads 16 code bytes: word t
# (t = 0..3) is the A fragment of mma k-step t, whose four bf16x2 registers
# hold (row g | g+8) x (k pair 16q+4t+{0,1} | 16q+4t+{2,3}). Register j = 2p+h
# (h: row g+8, p: second k pair) is one ModelOpt byte, i.e. a k-pair of a row.
#
# The kernel decodes a word w into registers with 4 rotations and 4 LOP3:
#   R0 = w & B, R1 = rotr(w, 12) & B, R2 = (rotr(w,2) ^ rotr(w,6)) & B,
#   R3 = (rotr(w,2) ^ rotr(w,8)) & B,   B = 0x81C081C0,
# each bf16 half getting sign -> bit 15, e1 e0 m -> bits 8..6, i.e. the value
# e2m1 * 2^-126. That map from w to the 32 kept bits is linear over GF(2) and
# invertible, so the loader stores w = A^-1 d, d being the wanted bits.

_DECODE_MASK = 0x81C081C0
_KEPT_BITS = (6, 7, 8, 15, 22, 23, 24, 31)  # bit positions B keeps
_CODE_BIT_AT = {6: 0, 7: 1, 8: 2, 15: 3}  # bf16 bit -> E2M1 code bit (mod 16)
# Each register as the XOR of right-rotations of w.
_REGISTER_ROTATIONS = ((0,), (12,), (2, 6), (2, 8))


def _rotr(w: int, r: int) -> int:
    return ((w >> r) | (w << (32 - r))) & 0xFFFFFFFF if r else w


def decode_word(w: int) -> tuple[int, int, int, int]:
    """The kernel's _decode_word, on a Python int (tests use it)."""
    regs = []
    for rots in _REGISTER_ROTATIONS:
        v = 0
        for r in rots:
            v ^= _rotr(w, r)
        regs.append(v & _DECODE_MASK)
    return tuple(regs)  # type: ignore[return-value]


@functools.lru_cache(maxsize=1)
def _encode_columns() -> tuple[int, ...]:
    """Column r of A^-1 (as a 32-bit int): the word bits to set for kept bit
    r = 8*register + index in _KEPT_BITS."""
    rows = []  # A: row r = word bits XORed into kept bit r
    for rots in _REGISTER_ROTATIONS:
        for p in _KEPT_BITS:
            mask = 0
            for r in rots:
                mask ^= 1 << ((p + r) % 32)
            rows.append(mask)
    # Gauss-Jordan on [A | I] over GF(2).
    aug = [(rows[i], 1 << i) for i in range(32)]
    for col in range(32):
        piv = next(i for i in range(col, 32) if aug[i][0] >> col & 1)
        aug[col], aug[piv] = aug[piv], aug[col]
        for i in range(32):
            if i != col and aug[i][0] >> col & 1:
                aug[i] = (aug[i][0] ^ aug[col][0], aug[i][1] ^ aug[col][1])
    inv_rows = [aug[i][1] for i in range(32)]  # inv_rows[c] bit r = A^-1[c][r]
    return tuple(sum(((inv_rows[c] >> r) & 1) << c for c in range(32)) for r in range(32))


@functools.lru_cache(maxsize=1)
def _byte_tables() -> torch.Tensor:
    """int64 [4, 256]: the encoded-word contribution of ModelOpt byte value v
    placed in register j; a word is the XOR of its four registers' entries."""
    cols = _encode_columns()
    table = torch.zeros(4, 256, dtype=torch.int64)
    for j in range(4):
        for v in range(256):
            w = 0
            for i, p in enumerate(_KEPT_BITS):
                code = (v >> 4) if p >= 16 else (v & 15)  # high half = odd k
                if code >> _CODE_BIT_AT[p % 16] & 1:
                    w ^= cols[8 * j + i]
            table[j, v] = w
    return table


@functools.lru_cache(maxsize=None)
def _pair_tables(device: torch.device) -> torch.Tensor:
    """int32 [2, 65536]: contribution of registers (0, 1) and (2, 3) from the
    little-endian uint16 holding their two bytes (two gathers per word)."""
    t = _byte_tables()
    v = torch.arange(65536)
    pairs = torch.stack((t[0][v & 255] ^ t[1][v >> 8], t[2][v & 255] ^ t[3][v >> 8]))
    return pairs.to(torch.int32).to(device)


@functools.lru_cache(maxsize=1)
def _scale_table() -> torch.Tensor:
    """int16 [256]: E4M3 bits -> unsigned E5M3 byte (exponent bias 10, every
    E4M3 value incl. subnormals a normal number); 0 for +-0; -1 for bits the
    sm90 kernel cannot take (negative or NaN scales)."""
    table = torch.full((256,), -1, dtype=torch.int16)
    table[0x00] = table[0x80] = 0
    for b in range(1, 0x7F):  # 0x7F is NaN
        e, m = b >> 3, b & 7
        if e == 0:  # subnormal m * 2^-9: normalize
            top = m.bit_length() - 1
            e_unb, mant = top - 9, (m << (3 - top)) & 7
        else:
            e_unb, mant = e - 7, m
        table[b] = ((e_unb + 10) << 3) | mant
    return table


def padded_shape(n: int, k: int) -> tuple[int, int]:
    """(N, K) rounded up to whole prepared tiles."""
    return -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K


def interleave_gate_up(rows: torch.Tensor) -> torch.Tensor:
    """A gate|up tensor's rows (``[gate; up]``, F each, F a multiple of 8; any
    trailing dims) reordered so that each 16-row tile holds 8 gate rows, then
    the up rows of the same 8 outputs. The gated kernels' epilogue then finds
    both halves of an output in one lane (``_store_fragment`` in
    attnquant_ops/nvfp4_matmul.mojo). Output ``r`` of the MLP's hidden state is
    gate row ``r`` and up row ``r``, at rows ``16 (r // 8) + r % 8`` and ``+ 8``."""
    n = rows.shape[0]
    if n % TILE_N:
        raise ValueError(f"a gate|up weight interleaves by {TILE_N // 2} rows: {n} rows is not a multiple of {TILE_N}")
    half = TILE_N // 2
    return rows.view(2, n // TILE_N, half, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def prepare_weights(packed: torch.Tensor, scale_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt NVFP4 -> the mojo-sm90 layout (pure torch, on packed's device).

    Returns ``(codes, scales)``: uint8 ``[N16, K64 / 2]`` and ``[N16, K64 / 16]``
    with N padded to a multiple of 16 and K to a multiple of 64 (zero codes);
    the same bytes as the input when N and K are already aligned. Blocks whose
    scale is zero get zero codes (so the kernel need not special-case them).

    Raises:
        ValueError: on inconsistent shapes, or a negative or NaN block scale
            (never produced by quantization; the kernel has no sign for scales).
    """
    check_modelopt_tensors(packed, scale_bits)
    n, half_k = packed.shape
    k = 2 * half_k
    table = _scale_table().to(torch.int32).to(scale_bits.device)
    scale_codes = table.index_select(0, scale_bits.reshape(-1).int()).view(n, k // BLOCK)
    if bool((scale_codes < 0).any()):
        bad = int(scale_bits[scale_codes < 0][0])
        raise ValueError(f"mojo-sm90 needs non-negative, finite block scales; found E4M3 bits 0x{bad:02x}")
    scale_codes = scale_codes.to(torch.uint8)
    n16, k64 = padded_shape(n, k)
    nt, kg = n16 // TILE_N, k64 // TILE_K

    codes, sc = packed, scale_codes
    if (n16, k64) != (n, k):  # pad with zero codes / zero scales
        codes = packed.new_zeros(n16, k64 // 2)
        codes[:n, :half_k] = packed
        sc = scale_codes.new_zeros(n16, k64 // BLOCK)
        sc[:n, : k // BLOCK] = scale_codes
    zero_blocks = scale_codes == 0
    if bool(zero_blocks.any()):
        codes = codes.clone() if codes is packed else codes
        codes.view(n16, k64 // BLOCK, BLOCK // 2).masked_fill_((sc == 0).unsqueeze(-1), 0)

    # byte (row = 16nt + 8h + g, k-byte = 32kg + 8q + 2t + p) -> [nt, kg, g, q, t, p, h];
    # the last two dims are register j = 2p + h, so a word's bytes are j = 0..3.
    tiles = codes.view(nt, 2, 8, kg, 4, 4, 2).permute(0, 3, 2, 4, 5, 6, 1).contiguous()
    halves = tiles.view(torch.int16).view(-1, 2).int() & 0xFFFF  # registers (0,1), (2,3)
    pair = _pair_tables(packed.device)
    words = pair[0].index_select(0, halves[:, 0]) ^ pair[1].index_select(0, halves[:, 1])
    out_codes = words.view(torch.uint8).view(n16, k64 // 2)

    # scale (row = 16nt + 8h + g, block = 4kg + q) -> [nt, kg, g, q, h]
    out_scales = sc.view(nt, 2, 8, kg, 4).permute(0, 3, 2, 4, 1).reshape(n16, k64 // BLOCK)
    return out_codes, out_scales.contiguous()


def check_modelopt_tensors(packed: torch.Tensor, scale_bits: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed must be uint8 [N, K/2], got {packed.dtype} {tuple(packed.shape)}")
    n, half_k = packed.shape
    if (2 * half_k) % BLOCK:
        raise ValueError(f"K={2 * half_k} is not a multiple of {BLOCK}")
    expected = (n, 2 * half_k // BLOCK)
    if scale_bits.dtype != torch.uint8 or tuple(scale_bits.shape) != expected:
        raise ValueError(
            f"scale_bits must be uint8 {expected} (E4M3 bits), got {scale_bits.dtype} {tuple(scale_bits.shape)}"
        )


def sm90_reference_dequant(codes: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """float64 [n, k] = e2m1 * e4m3 (no global scale), decoded from the
    prepared layout exactly the way the kernel does (bit ops, bf16 bits, the
    E5M3 scale byte). For tests: it checks prepare_weights without a GPU."""
    n16, k64 = codes.shape[0], codes.shape[1] * 2
    nt, kg = n16 // TILE_N, k64 // TILE_K
    words = codes.contiguous().view(torch.int32).view(nt, kg, 8, 4, 4).long() & 0xFFFFFFFF  # [nt,kg,g,q,t]
    regs = []
    for rots in _REGISTER_ROTATIONS:
        v = torch.zeros_like(words)
        for r in rots:
            v ^= ((words >> r) | (words << (32 - r))) & 0xFFFFFFFF if r else words
        regs.append(v & _DECODE_MASK)
    halves = torch.stack(regs, -1)  # [..., j]
    halves = torch.stack((halves & 0xFFFF, halves >> 16), -1)  # [..., j, e]
    bf16 = halves.to(torch.int16).view(torch.bfloat16).double() * 2.0**126  # e2m1 values
    # [nt, kg, g, q, t, j=(p, h), e] -> row 16nt + 8h + g, k 64kg + 16q + 4t + 2p + e
    vals = bf16.view(nt, kg, 8, 4, 4, 2, 2, 2).permute(0, 6, 2, 1, 3, 4, 5, 7).reshape(n16, k64)
    byte = scales.view(nt, kg, 8, 4, 2).permute(0, 4, 2, 1, 3).reshape(n16, k64 // BLOCK).long()
    s = torch.ldexp(1.0 + (byte & 7).double() / 8, (byte >> 3) - 10)
    s = torch.where(byte == 0, torch.zeros_like(s), s)
    return (vals * s.repeat_interleave(BLOCK, dim=1))[:n, :k]
