# NVFP4 weight-only matmul kernels: y[M, N] = x[M, K] . dequant(W)^T
#
# Two weight layouts:
#   * ModelOpt ("modelopt"): packed uint8 [N, K/2] (low nibble = even k),
#     scale_bits uint8 [N, K/16] (raw float8_e4m3fn bits), global_scale f32 [1].
#     Used by the CPU kernel, the generic GPU kernel and the generic dequant.
#   * sm90 ("prepared"): the same bytes re-laid out once at load time by
#     kernels/sm90_layout.py's prepare_weights so that one 16-byte load per lane gives
#     the lane exactly its mma.sync A-fragment codes for a 16x64 tile, and the
#     codes are GF(2)-pre-encoded so that 4 rotations + 4 LOP3 decode 8 weights
#     into bf16 bit patterns (see _decode_word). Scales are re-encoded to an
#     unsigned E5M3 byte so that one IMAD turns a byte into a bf16 scale.
#
# The bf16 value of a decoded code is e2m1 * 2^-126 and a decoded scale is
# s * 2^107, so the bf16 product fed to the tensor core is e2m1 * s * 2^-19
# (exact: <= 6 significant bits, always a normal bf16). The epilogue multiplies
# by global_scale * 2^19 in float32.

from std.math import ceildiv
from std.memory import bitcast, stack_allocation
from std.sys import _RegisterPackType
from std.sys._assembly import inlined_assembly

from max.gpu import barrier, block_dim, block_idx, grid_dim, lane_id, thread_idx
from max.gpu.host import DeviceAttribute, DeviceContext, FuncAttribute
from max.gpu.memory import (
    AddressSpace,
    async_copy_commit_group,
    async_copy_wait_group,
    external_memory,
)
from max.gpu.sync import syncwarp
from max.gpu.primitives.warp import sum as warp_sum

from .activation import gelu_tanh
from .pdl import pdl_attributes, pdl_launch_dependents, pdl_wait, produced_invariant

# ===----------------------------------------------------------------------=== #
# Shared scalar decoders (CPU and generic GPU kernels)
# ===----------------------------------------------------------------------=== #

# 2^19: undoes the 2^-19 carried by the sm90 kernel's bf16 products.
comptime SM90_EPILOGUE_FACTOR = Float32(524288.0)


@always_inline
def e2m1_to_f32(code: UInt8) -> Float32:
    """E2M1 code (low 4 bits) -> float32: 0, .5, 1, 1.5, 2, 3, 4, 6 and
    negatives for codes 8-15. Arithmetic rather than a table so GPU kernels
    keep it in registers."""
    var c = UInt32(code & 15)
    var e = (c >> 1) & 3
    var m = c & 1
    var mag = Float32(m) * Float32(0.5)
    if e != 0:
        mag = bitcast[DType.float32, 1](((e + 126) << 23) | (m << 22))
    return -mag if (c & 8) != 0 else mag


@always_inline
def e4m3_to_f32(bits: UInt8) -> Float32:
    """Decodes float8_e4m3fn bits (MAX has no float8 on CPU, so scales travel
    as uint8 everywhere)."""
    var e = UInt32((bits >> 3) & 15)
    var m = UInt32(bits & 7)
    var mag: Float32
    if e == 0:
        mag = Float32(m) * Float32(0.001953125)  # subnormal: m * 2^-9
    elif e == 15 and m == 7:
        mag = Float32(0.0) / Float32(0.0)  # NaN
    else:
        mag = bitcast[DType.float32, 1](((e + 120) << 23) | (m << 20))
    return -mag if (bits & 0x80) != 0 else mag


# ===----------------------------------------------------------------------=== #
# CPU: ModelOpt layout, float32 activations
# ===----------------------------------------------------------------------=== #


def nvfp4_matmul_cpu(
    y: Pointer[mut=True, Float32, _],
    x: Pointer[Float32, _],
    packed: Pointer[UInt8, _],
    scale_bits: Pointer[UInt8, _],
    global_scale: Float32,
    m_rows: Int,
    n_rows: Int,
    k: Int,
):
    """Decodes one weight row at a time into float32, then dots it with every
    activation row (float32 accumulation, 16-wide SIMD)."""
    var row = List[Float32](length=k, fill=0.0)
    var rp = row.unsafe_ptr()
    var kh = k // 2
    var kb = k // 16
    for n in range(n_rows):
        for b in range(kb):
            var s = e4m3_to_f32(scale_bits.unsafe_load(n * kb + b))
            for j in range(8):
                var byte = packed.unsafe_load(n * kh + b * 8 + j)
                rp.unsafe_store(b * 16 + 2 * j, e2m1_to_f32(byte & 15) * s)
                rp.unsafe_store(b * 16 + 2 * j + 1, e2m1_to_f32(byte >> 4) * s)
        for m in range(m_rows):
            var acc = SIMD[DType.float32, 16](0)
            for b in range(kb):
                acc += x.unsafe_load[width=16](m * k + b * 16) * rp.unsafe_load[
                    width=16
                ](b * 16)
            y.unsafe_store(m * n_rows + n, acc.reduce_add() * global_scale)


def nvfp4_dequant_cpu(
    w: Pointer[mut=True, Float32, _],
    packed: Pointer[UInt8, _],
    scale_bits: Pointer[UInt8, _],
    global_scale: Float32,
    n_rows: Int,
    k: Int,
):
    var kh = k // 2
    var kb = k // 16
    for n in range(n_rows):
        for b in range(kb):
            var s = e4m3_to_f32(scale_bits.unsafe_load(n * kb + b)) * global_scale
            for j in range(8):
                var byte = packed.unsafe_load(n * kh + b * 8 + j)
                w.unsafe_store(n * k + b * 16 + 2 * j, e2m1_to_f32(byte & 15) * s)
                w.unsafe_store(n * k + b * 16 + 2 * j + 1, e2m1_to_f32(byte >> 4) * s)


# ===----------------------------------------------------------------------=== #
# Generic GPU kernels: ModelOpt layout, any NVIDIA/AMD GPU, any M.
# Correct and simple, not tuned: the fast path is the sm90 kernel below.
# ===----------------------------------------------------------------------=== #

comptime GENERIC_WARPS = 4


def nvfp4_matmul_generic_kernel[
    dtype: DType
](
    y: Pointer[Scalar[dtype], MutAnyOrigin],
    x: Pointer[Scalar[dtype], ImmutAnyOrigin],
    packed: Pointer[UInt8, ImmutAnyOrigin],
    scale_bits: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    m_rows: Int64,
    n_rows: Int64,
    k: Int64,
):
    """One warp per (weight row n, activation row m); lanes stride over the
    16-element scale blocks and reduce with a warp sum."""
    var n = Int(block_idx.x) * GENERIC_WARPS + Int(thread_idx.x) // 32
    var m = Int(block_idx.y)
    if n >= Int(n_rows):
        return
    var kk = Int(k)
    var kb = kk // 16
    var acc = Float32(0)
    var b = Int(lane_id())
    while b < kb:
        var s = e4m3_to_f32(scale_bits.unsafe_load(n * kb + b))
        var part = Float32(0)
        for j in range(8):
            var byte = packed.unsafe_load(n * (kk // 2) + b * 8 + j)
            var x0 = x.unsafe_load(m * kk + b * 16 + 2 * j).cast[DType.float32]()
            var x1 = x.unsafe_load(m * kk + b * 16 + 2 * j + 1).cast[
                DType.float32
            ]()
            part += x0 * e2m1_to_f32(byte & 15) + x1 * e2m1_to_f32(byte >> 4)
        acc += part * s
        b += 32
    acc = warp_sum(acc)
    if lane_id() == 0:
        y.unsafe_store(
            m * Int(n_rows) + n, (acc * global_scale.unsafe_load(0)).cast[dtype]()
        )


def nvfp4_dequant_generic_kernel[
    dtype: DType
](
    w: Pointer[Scalar[dtype], MutAnyOrigin],
    packed: Pointer[UInt8, ImmutAnyOrigin],
    scale_bits: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    n_rows: Int64,
    k: Int64,
):
    """One thread per 16-element scale block."""
    var kb = Int(k) // 16
    var blk = Int(block_idx.x) * Int(block_dim.x) + Int(thread_idx.x)
    if blk >= Int(n_rows) * kb:
        return
    var s = e4m3_to_f32(scale_bits.unsafe_load(blk)) * global_scale.unsafe_load(0)
    var out = SIMD[dtype, 16](0)
    comptime for j in range(8):
        var byte = packed.unsafe_load(blk * 8 + j)
        out[2 * j] = (e2m1_to_f32(byte & 15) * s).cast[dtype]()
        out[2 * j + 1] = (e2m1_to_f32(byte >> 4) * s).cast[dtype]()
    # Row n, block b starts at n*K + 16b = 16*blk, since K = 16*kb.
    w.unsafe_store(blk * 16, out)


def nvfp4_matmul_generic_gpu[
    dtype: DType
](
    y: Pointer[mut=True, Scalar[dtype], _],
    x: Pointer[Scalar[dtype], _],
    packed: Pointer[UInt8, _],
    scale_bits: Pointer[UInt8, _],
    global_scale: Pointer[Float32, _],
    m_rows: Int,
    n_rows: Int,
    k: Int,
    ctx: DeviceContext,
) raises:
    if m_rows == 0 or n_rows == 0:
        return
    ctx.enqueue_function[nvfp4_matmul_generic_kernel[dtype]](
        y,
        x,
        packed,
        scale_bits,
        global_scale,
        Int64(m_rows),
        Int64(n_rows),
        Int64(k),
        grid_dim=(ceildiv(n_rows, GENERIC_WARPS), m_rows),
        block_dim=GENERIC_WARPS * 32,
    )


def nvfp4_dequant_generic_gpu[
    dtype: DType
](
    w: Pointer[mut=True, Scalar[dtype], _],
    packed: Pointer[UInt8, _],
    scale_bits: Pointer[UInt8, _],
    global_scale: Pointer[Float32, _],
    n_rows: Int,
    k: Int,
    ctx: DeviceContext,
) raises:
    var blocks = n_rows * (k // 16)
    if blocks == 0:
        return
    ctx.enqueue_function[nvfp4_dequant_generic_kernel[dtype]](
        w,
        packed,
        scale_bits,
        global_scale,
        Int64(n_rows),
        Int64(k),
        grid_dim=ceildiv(blocks, 256),
        block_dim=256,
    )


# ===----------------------------------------------------------------------=== #
# sm90 GEMV: prepared layout, bf16 activations, tensor cores (mma.sync).
# ===----------------------------------------------------------------------=== #
# Tile = 16 weight rows (an "n-tile") x 64 k (a "k-group"); 512 code bytes +
# 64 scale bytes. Lane l = 4*g + q holds rows g and g+8, k-block q (16 k) of the
# group: word t of its 16 bytes feeds mma tile t, whose logical k columns
# {2q, 2q+1, 2q+8, 2q+9} map to physical k 16q+4t+{0,1,2,3}. So the lane's
# activations for the whole group are 16 contiguous bf16 (two 16-byte loads),
# and each lane needs only two scales per group.

comptime _DECODE_MASK = UInt32(0x81C081C0)  # bf16 sign | low 2 exp | top mantissa
comptime _SCALE_BIAS = UInt32(0x70007000)  # bf16 exponent += 224 for both halves


@always_inline
def _rotr[r: Int](v: UInt32) -> UInt32:
    return (v >> UInt32(r)) | (v << UInt32(32 - r))


@always_inline
def _decode_word(w: UInt32) -> SIMD[DType.uint32, 4]:
    """8 GF(2)-encoded codes -> 4 bf16x2 A-fragment registers (unscaled).

    prepare_weights solves, per word, the bit system these four outputs
    define; the choice of rotations {0, 12, (2,6), (2,8)} is one that makes
    the 32x32 system invertible with 4 rotations (fewer is impossible)."""
    var r2 = _rotr[2](w)
    return SIMD[DType.uint32, 4](
        w & _DECODE_MASK,
        _rotr[12](w) & _DECODE_MASK,
        (r2 ^ _rotr[6](w)) & _DECODE_MASK,
        (r2 ^ _rotr[8](w)) & _DECODE_MASK,
    )


@always_inline
def _scale_pair(byte_: UInt32) -> UInt32:
    """E5M3 scale byte -> (S, S) as bf16x2 bits, S = s * 2^107."""
    return byte_ * UInt32(0x00100010) + _SCALE_BIAS


@always_inline
def _hmul2(a: UInt32, b: UInt32) -> UInt32:
    return inlined_assembly[
        "mul.rn.bf16x2 $0, $1, $2;",
        UInt32,
        constraints="=r,r,r",
        has_side_effect=False,
    ](a, b)


@always_inline
def _ldg_stream_v4[
    l2_256b: Bool = False
](p: Pointer[UInt8, ImmutAnyOrigin]) -> SIMD[DType.uint32, 4]:
    """16-byte weight load that bypasses L1 (weights are read exactly once)."""
    comptime asm = (
        "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {$0, $1, $2, $3}, [$4];"
        if l2_256b else "ld.global.nc.L1::no_allocate.v4.u32 {$0, $1, $2, $3}, [$4];"
    )
    var r = inlined_assembly[
        asm,
        _RegisterPackType[UInt32, UInt32, UInt32, UInt32],
        constraints="=r,=r,=r,=r,l",
        has_side_effect=False,
    ](p)
    return SIMD[DType.uint32, 4](r[0], r[1], r[2], r[3])


@always_inline
def _ldg_stream_u16(p: Pointer[UInt8, ImmutAnyOrigin]) -> UInt32:
    return inlined_assembly[
        "ld.global.nc.L1::no_allocate.u16 $0, [$1];",
        UInt32,
        constraints="=r,l",
        has_side_effect=False,
    ](p)


@always_inline
def _prefetch_l2(p: Pointer[UInt8, ImmutAnyOrigin], size: Int):
    """Ask the copy engine to bring `size` bytes (a multiple of 16, 16-byte
    aligned) into L2: bytes in flight that cost no register and no shared
    memory, so the register loads that follow wait on L2, not DRAM."""
    inlined_assembly[
        "cp.async.bulk.prefetch.L2.global [$0], $1;",
        NoneType,
        constraints="l,r,~{memory}",
        has_side_effect=True,
    ](p, UInt32(size))


@always_inline
def _prefetch_groups[
    TN: Int
](
    cptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    sptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    kg: Int,
    nb: Int,
):
    """L2 prefetch of nb k-groups of each n-tile from k-group kg; called by
    lane 0, whose cptr/sptr are the tiles' first bytes."""
    comptime for tn in range(TN):
        _prefetch_l2(cptr[tn].unsafe_offset(kg * 512), nb * 512)
        _prefetch_l2(sptr[tn].unsafe_offset(kg * 64), nb * 64)


@always_inline
def _mma_bf16(
    a: SIMD[DType.uint32, 4],
    b0: UInt32,
    b1: UInt32,
    c: SIMD[DType.float32, 4],
) -> SIMD[DType.float32, 4]:
    var r = inlined_assembly[
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        _RegisterPackType[Float32, Float32, Float32, Float32],
        constraints="=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effect=False,
    ](a[0], a[1], a[2], a[3], b0, b1, c[0], c[1], c[2], c[3])
    return SIMD[DType.float32, 4](r[0], r[1], r[2], r[3])


@always_inline
def _load_x_clamped(
    x: Pointer[BFloat16, ImmutAnyOrigin], row: Int, kcol: Int, m: Int, k: Int
) -> SIMD[DType.uint32, 8]:
    """The lane's 16 activations, loaded unconditionally from a clamped
    address: rows >= M only feed output columns that are never stored, and
    k >= K only meets zero codes (padding), so no predicates or zeroing."""
    var v = x.unsafe_load[width=16, alignment=32](min(row, m - 1) * k + min(kcol, k - 16))
    return bitcast[DType.uint32, 8](v)


@always_inline
def _store_fragment[
    GATED: Bool
](
    y: Pointer[BFloat16, MutAnyOrigin],
    c: SIMD[DType.float32, 4],
    nt: Int,
    g: Int,
    col0: Int,
    m: Int,
    nn: Int,
):
    """Stores lane (g, q)'s share of n-tile nt's 16 x 8 output fragment (c,
    already scaled): rows g and g + 8 at token columns col0, col0 + 1 of
    y[M, nn]. Rows >= nn (padding) and columns >= M are dropped.

    GATED: the tile holds 8 gate rows (tile rows 0-7) and the up rows of the
    same 8 outputs (rows 8-15; kernels/sm90_layout.py interleave_gate_up), so
    the lane holds both halves of output nt * 8 + g and stores
    gelu_tanh(gate) * up: y is the MLP's hidden state [M, N / 2]."""
    comptime if GATED:
        var row = nt * 8 + g
        comptime for e in range(2):
            var col = col0 + e
            if row < nn and col < m:
                y.unsafe_store(col * nn + row, (gelu_tanh(c[e]) * c[e + 2]).cast[DType.bfloat16]())
    else:
        comptime for e in range(4):
            var row = nt * 16 + g + 8 * (e // 2)
            var col = col0 + (e % 2)
            if row < nn and col < m:
                y.unsafe_store(col * nn + row, c[e].cast[DType.bfloat16]())


@always_inline
def _load_groups[
    U: Int, TN: Int, FULL: Bool
](
    mut wv: Array[SIMD[DType.uint32, 4], U * TN],
    mut sv: Array[UInt32, U * TN],
    cptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    sptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    kg: Int,
    nb: Int,
):
    """The weight and scale loads of up to U (nb) k-groups from k-group kg."""
    comptime for u in range(U):
        if FULL or u < nb:
            comptime for tn in range(TN):
                wv[u * TN + tn] = _ldg_stream_v4(cptr[tn].unsafe_offset((kg + u) * 512))
                sv[u * TN + tn] = _ldg_stream_u16(sptr[tn].unsafe_offset((kg + u) * 64))


@always_inline
def _mma_groups[
    U: Int, TN: Int, MT: Int, ACC: Int, FULL: Bool, XCLAMP: Bool, PDL: Bool = False
](
    mut accs: Array[SIMD[DType.float32, 4], TN * MT * ACC],
    wv: Array[SIMD[DType.uint32, 4], U * TN],
    sv: Array[UInt32, U * TN],
    xptr: Array[Pointer[BFloat16, ImmutAnyOrigin], MT],
    xlimit: Int,
    kg: Int,
    nb: Int,
):
    """Per loaded k-group: the activations, decode, scale and mma. PDL: the
    activations are the previous kernel's output (pdl.mojo)."""
    comptime for u in range(U):
        comptime if not FULL:
            if u >= nb:
                break
        var xf = Array[SIMD[DType.uint32, 8], MT](fill=SIMD[DType.uint32, 8](0))
        comptime for mt in range(MT):
            var xoff = (kg + u) * 64
            comptime if XCLAMP:
                xoff = min(xoff, xlimit)
            var v = xptr[mt].unsafe_load[width=16, alignment=32, invariant=produced_invariant[PDL]()](xoff)
            xf[mt] = bitcast[DType.uint32, 8](v)
        comptime for tn in range(TN):
            var s = sv[u * TN + tn]
            var s_lo = _scale_pair(s & 0xFF)  # row g
            var s_hi = _scale_pair(s >> 8)  # row g + 8
            var w4 = wv[u * TN + tn]
            comptime for t in range(4):
                var a = _decode_word(w4[t])
                a[0] = _hmul2(a[0], s_lo)
                a[1] = _hmul2(a[1], s_hi)
                a[2] = _hmul2(a[2], s_lo)
                a[3] = _hmul2(a[3], s_hi)
                comptime for mt in range(MT):
                    comptime i = (tn * MT + mt) * ACC + (u * 4 + t) % ACC
                    accs[i] = _mma_bf16(a, xf[mt][2 * t], xf[mt][2 * t + 1], accs[i])


@always_inline
def _gemv_batch[
    U: Int, TN: Int, MT: Int, ACC: Int, FULL: Bool = False, XCLAMP: Bool = True, WAIT: Bool = False, PDL: Bool = False
](
    mut accs: Array[SIMD[DType.float32, 4], TN * MT * ACC],
    cptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    sptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    xptr: Array[Pointer[BFloat16, ImmutAnyOrigin], MT],
    xlimit: Int,
    kg: Int,
    nb: Int,
    opaque_zero: UInt32,
):
    """Up to U (nb) k-groups: first every weight and scale load, then per
    group the activations, decode, scale and mma.

    ptxas likes to sink each weight load next to its first use, which leaves
    one k-group in flight per warp instead of U (the loop is latency bound, so
    that costs directly). Folding every loaded word, ANDed with a zero the
    compiler cannot see through, into the first group's first word makes the
    first decode depend on all U loads, so they are issued together.

    cptr/sptr: this lane's code/scale bytes of each n-tile at k-group 0;
    xptr: its activation row(s) at its k offset; xlimit clamps k (padding).
    FULL: nb == U, no per-group guard. XCLAMP False: K % 64 == 0, so no
    k-group reaches past K and the activation offsets need no clamp. WAIT
    (PDL_EARLY, bench harness only): pdl_wait between the weight loads and
    the activations."""
    var wv = Array[SIMD[DType.uint32, 4], U * TN](fill=SIMD[DType.uint32, 4](0))
    var sv = Array[UInt32, U * TN](fill=0)
    _load_groups[U, TN, FULL](wv, sv, cptr, sptr, kg, nb)
    comptime if WAIT:
        pdl_wait()
    var dep = UInt32(0)
    comptime for u in range(1, U):
        comptime for tn in range(TN):
            dep |= wv[u * TN + tn][0] | sv[u * TN + tn]
    wv[0][0] ^= dep & opaque_zero
    _mma_groups[U, TN, MT, ACC, FULL, XCLAMP, PDL](accs, wv, sv, xptr, xlimit, kg, nb)


@always_inline
def _k_slice[
    U: Int, TN: Int, MT: Int, ACC: Int, ALIGNED_K: Bool, PDL: Bool = False, PDL_EARLY: Bool = False
](
    mut accs: Array[SIMD[DType.float32, 4], TN * MT * ACC],
    cptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    sptr: Array[Pointer[UInt8, ImmutAnyOrigin], TN],
    xptr: Array[Pointer[BFloat16, ImmutAnyOrigin], MT],
    xlimit: Int,
    kg_begin: Int,
    kg_end: Int,
    opaque_zero: UInt32,
):
    """A warp's k-groups [kg_begin, kg_end), U at a time (_gemv_batch).

    ALIGNED_K (K % 64 == 0, which every Gemma projection is): no k-group
    reaches past K, so the activation loads need no clamp, and whole batches
    run with no per-group guard, the slice's last partial batch apart. A
    batch's four activation loads then come from one base address with
    immediate offsets: ~20 % fewer instructions per k-group, same arithmetic
    in the same order (bit-identical output). Otherwise every batch is
    guarded and clamped (a zero-code padding group must not read activations
    past K).

    PDL: pdl_wait first, before any load. PDL_EARLY (bench harness only,
    with ALIGNED_K): the first batch's weight loads are issued before it, so
    they are in flight while the previous kernel finishes; that takes 66
    registers instead of 57 (28 warps an SM instead of 32), so the op waits
    first and its gain is the launch and the block start overlapping the
    previous kernel's last wave."""
    var kg = kg_begin
    comptime if PDL_EARLY:
        comptime assert PDL and ALIGNED_K, "PDL_EARLY is a form of PDL's aligned loop"
        if kg + U <= kg_end:
            _gemv_batch[U, TN, MT, ACC, True, False, True, PDL](accs, cptr, sptr, xptr, xlimit, kg, U, opaque_zero)
            kg += U
        else:
            pdl_wait()
    elif PDL:
        pdl_wait()
    comptime if ALIGNED_K:
        while kg + U <= kg_end:
            _gemv_batch[U, TN, MT, ACC, True, False, False, PDL](accs, cptr, sptr, xptr, xlimit, kg, U, opaque_zero)
            kg += U
        if kg < kg_end:
            _gemv_batch[U, TN, MT, ACC, False, False, False, PDL](
                accs, cptr, sptr, xptr, xlimit, kg, kg_end - kg, opaque_zero
            )
    else:
        while kg < kg_end:
            _gemv_batch[U, TN, MT, ACC, False, True, False, PDL](
                accs, cptr, sptr, xptr, xlimit, kg, min(U, kg_end - kg), opaque_zero
            )
            kg += U


@always_inline
def _prefetch_next_share(
    next_codes: Pointer[UInt8, ImmutAnyOrigin],
    code_bytes: Int,
    next_scales: Pointer[UInt8, ImmutAnyOrigin],
    scale_bytes: Int,
    first_block: Int,
):
    """Lane 0 of each warp of blocks >= first_block (grid row 0) asks the
    copy engine to bring its even share of the next weight's first code and
    scale bytes into L2, fire and forget, meant to arrive while the kernels
    between this projection and the next leave HBM idle (measured slower:
    nvfp4_gemv_sm90_next_kernel). Blocks before first_block start earlier and
    would only compete with this kernel's own stream (and see their lines
    evicted by it)."""
    if Int(block_idx.x) < first_block or Int(block_idx.y) != 0 or Int(lane_id()) != 0:
        return
    var per_block = Int(block_dim.x) // 32
    var warps = (Int(grid_dim.x) - first_block) * per_block
    var w = (Int(block_idx.x) - first_block) * per_block + Int(thread_idx.x) // 32
    var share = ceildiv(ceildiv(code_bytes, warps), 16) * 16
    if w * share < code_bytes:
        _prefetch_l2(next_codes.unsafe_offset(w * share), min(share, code_bytes - w * share))
    share = ceildiv(ceildiv(scale_bytes, warps), 16) * 16
    if w * share < scale_bytes:
        _prefetch_l2(next_scales.unsafe_offset(w * share), min(share, scale_bytes - w * share))


def nvfp4_gemv_sm90_kernel[
    MT: Int,
    TN: Int,
    NW: Int,
    KW_MAX: Int,
    U: Int,
    ACC: Int = 1,
    PF: Int = 0,
    GATED: Bool = False,
    EARLY_SCALE: Bool = False,
    ALIGNED_K: Bool = False,
    PIPE: Int = 0,
    PDL: Bool = False,
    PDL_EARLY: Bool = False,
    PDL_LATE: Bool = False,
](
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    codes: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    m_rows: Int64,
    n_rows: Int64,
    k: Int64,
    n_tiles: Int64,
    k_groups: Int64,
    kw: Int64,
):
    """The register-staged GEMV (_gemv_sm90_body)."""
    _gemv_sm90_body[MT, TN, NW, KW_MAX, U, ACC, PF, GATED, EARLY_SCALE, False, ALIGNED_K, PIPE, PDL, PDL_EARLY, PDL_LATE](
        y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw, codes, 0, scales, 0, 0
    )


def nvfp4_gemv_sm90_next_kernel[
    MT: Int, TN: Int, NW: Int, KW_MAX: Int, U: Int, ACC: Int = 1, GATED: Bool = False
](
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    codes: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    m_rows: Int64,
    n_rows: Int64,
    k: Int64,
    n_tiles: Int64,
    k_groups: Int64,
    kw: Int64,
    next_codes: Pointer[UInt8, ImmutAnyOrigin],
    next_code_bytes: Int64,
    next_scales: Pointer[UInt8, ImmutAnyOrigin],
    next_scale_bytes: Int64,
    next_first_block: Int64,
):
    """Bench harness only (gvn): nvfp4_gemv_sm90_kernel that, once a warp's k
    slice is done, prefetches its share of the next projection's first bytes
    into L2 (_prefetch_next_share). Measured slower on Hopper: the bulk
    prefetches stream at under a third of copy bandwidth and hold up what
    follows (docs/dev/kernels.md, seventh sweep)."""
    _gemv_sm90_body[MT, TN, NW, KW_MAX, U, ACC, 0, GATED, False, True](
        y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw,
        next_codes, next_code_bytes, next_scales, next_scale_bytes, next_first_block,
    )


@always_inline
def _gemv_sm90_body[
    MT: Int,
    TN: Int,
    NW: Int,
    KW_MAX: Int,
    U: Int,
    ACC: Int,
    PF: Int,
    GATED: Bool,
    EARLY_SCALE: Bool,
    NEXT: Bool,
    ALIGNED_K: Bool = False,
    PIPE: Int = 0,
    PDL: Bool = False,
    PDL_EARLY: Bool = False,
    PDL_LATE: Bool = False,
](
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    codes: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    m_rows: Int64,
    n_rows: Int64,
    k: Int64,
    n_tiles: Int64,
    k_groups: Int64,
    kw: Int64,
    next_codes: Pointer[UInt8, ImmutAnyOrigin],
    next_code_bytes: Int64,
    next_scales: Pointer[UInt8, ImmutAnyOrigin],
    next_scale_bytes: Int64,
    next_first_block: Int64,
):
    """Block = NW x kw warps. Warp (nw, kwi) owns n-tiles [TN*(block*NW+nw), +TN)
    and the kwi-th contiguous slice of the k-groups; MT m8-tiles of
    activation rows (block_idx.y picks the 8*MT-row chunk). Partial sums over
    the kw slices are reduced through shared memory.

    Weights are staged through registers, U k-groups (2 KB per warp for U=4)
    at a time. Measured on the H200 this beat deeper register double
    buffering (twice the registers, half the warps) and a cp.async ring
    (fewer warps, same latency-bound issue rate).

    PF > 0 (bench harness only; slower on the H200, docs/dev/kernels.md): lane
    0 also keeps the warp's next PF batches on their way into L2 (bulk
    prefetch), meant to let each batch's register loads wait on L2 rather
    than DRAM; PF larger than the slice prefetches the whole slice up front.

    EARLY_SCALE (bench harness only): the global scale is loaded before the
    loop, not after it, so its latency is not on the last warp's path to the
    store.

    ALIGNED_K: K % 64 == 0, the loop without guards or clamps (_k_slice);
    _launch_gemv picks it.

    PDL: launched with programmatic stream serialization (kernels/attnquant_ops/pdl.mojo):
    lets the next kernel start at once, and loads nothing before pdl_wait
    (_k_slice). PDL_LATE (bench harness only, with PDL): lets it start only
    after this block's stores, as MAX's own kernels do (OVERLAP_AT_END), for
    a next kernel that might read before it waits."""
    comptime if PDL:
        comptime assert PF == 0 and PIPE == 0 and not NEXT, "PDL is a form of the op's loop"
        comptime if not PDL_LATE:
            pdl_launch_dependents()
    comptime if PDL_LATE:
        comptime assert PDL and not PDL_EARLY, "PDL_LATE is a form of PDL"
    var lane = Int(lane_id())
    var warp = Int(thread_idx.x) // 32
    var nw = warp % NW
    var kwi = warp // NW
    var nkw = Int(kw)
    var m = Int(m_rows)
    var kk = Int(k)
    var nt_count = Int(n_tiles)
    var kg_count = Int(k_groups)
    var g = lane // 4
    var q = lane % 4
    var mbase = Int(block_idx.y) * 8 * MT
    var xrow = mbase + g
    var nt0 = (Int(block_idx.x) * NW + nw) * TN

    # Out-of-range n-tiles (last block) read the last valid tile: no divergence,
    # results are dropped at the store. Rows >= M read row M-1: they only feed
    # mma columns that are never stored.
    var cptr = Array[Pointer[UInt8, ImmutAnyOrigin], TN](fill=codes)
    var sptr = Array[Pointer[UInt8, ImmutAnyOrigin], TN](fill=scales)
    comptime for tn in range(TN):
        var t0 = min(nt0 + tn, nt_count - 1) * kg_count
        cptr[tn] = codes.unsafe_offset(t0 * 512 + lane * 16)
        sptr[tn] = scales.unsafe_offset(t0 * 64 + lane * 2)
    var xptr = Array[Pointer[BFloat16, ImmutAnyOrigin], MT](fill=x)
    comptime for mt in range(MT):
        xptr[mt] = x.unsafe_offset(min(xrow + 8 * mt, m - 1) * kk + 16 * q)
    var xlimit = kk - 16 - 16 * q  # k offsets past K (zero-code padding) re-read the last block

    var kg_begin = (kwi * kg_count) // nkw
    var kg_end = ((kwi + 1) * kg_count) // nkw
    var opaque_zero = UInt32(Int(kw) >> 40)  # kw <= 16; the compiler cannot know

    var accs = Array[SIMD[DType.float32, 4], TN * MT * ACC](
        fill=SIMD[DType.float32, 4](0)
    )
    var factor = Float32(0)
    comptime if EARLY_SCALE:
        factor = global_scale.unsafe_load(0) * SM90_EPILOGUE_FACTOR
    comptime if PF > 0:
        var ahead = min(kg_begin + PF * U, kg_end) - (kg_begin + U)
        if lane == 0 and ahead > 0:  # batch 0's own loads are issued next anyway
            _prefetch_groups[TN](cptr, sptr, kg_begin + U, ahead)
    var kg = kg_begin
    comptime if PIPE > 0:
        # Bench harness (gp, gq): software-pipelined in registers, PIPE
        # k-groups a stage, the next stage's loads written before this one's
        # mma. ptxas moves them back towards their use; mixed on Hopper, so
        # not the op's (docs/dev/kernels.md, eighth sweep).
        comptime assert ALIGNED_K and PF == 0, "PIPE is a form of the aligned loop"
        var wa = Array[SIMD[DType.uint32, 4], PIPE * TN](fill=SIMD[DType.uint32, 4](0))
        var sa = Array[UInt32, PIPE * TN](fill=0)
        if kg + PIPE <= kg_end:
            _load_groups[PIPE, TN, True](wa, sa, cptr, sptr, kg, PIPE)
        while kg + PIPE <= kg_end:
            var wb = Array[SIMD[DType.uint32, 4], PIPE * TN](fill=SIMD[DType.uint32, 4](0))
            var sb = Array[UInt32, PIPE * TN](fill=0)
            var nxt = kg + PIPE
            if nxt + PIPE <= kg_end:
                _load_groups[PIPE, TN, True](wb, sb, cptr, sptr, nxt, PIPE)
            _mma_groups[PIPE, TN, MT, ACC, True, False](accs, wa, sa, xptr, xlimit, kg, PIPE)
            wa = wb^
            sa = sb^
            kg = nxt
        if kg < kg_end:
            _gemv_batch[PIPE, TN, MT, ACC, False, False](accs, cptr, sptr, xptr, xlimit, kg, kg_end - kg, opaque_zero)
    elif PF > 0:
        comptime assert not ALIGNED_K, "the L2 prefetch variants keep the guarded loop"
        while kg < kg_end:
            var p = kg + PF * U
            if lane == 0 and p < kg_end:
                _prefetch_groups[TN](cptr, sptr, p, min(U, kg_end - p))
            _gemv_batch[U, TN, MT, ACC](accs, cptr, sptr, xptr, xlimit, kg, min(U, kg_end - kg), opaque_zero)
            kg += U
    else:
        _k_slice[U, TN, MT, ACC, ALIGNED_K, PDL, PDL_EARLY](accs, cptr, sptr, xptr, xlimit, kg_begin, kg_end, opaque_zero)
    comptime if NEXT:
        _prefetch_next_share(
            next_codes, Int(next_code_bytes), next_scales, Int(next_scale_bytes), Int(next_first_block)
        )

    var acc = Array[SIMD[DType.float32, 4], TN * MT](fill=SIMD[DType.float32, 4](0))
    comptime for i in range(TN * MT):
        comptime for a in range(ACC):
            acc[i] += accs[i * ACC + a]

    comptime if not EARLY_SCALE:
        factor = global_scale.unsafe_load(0) * SM90_EPILOGUE_FACTOR

    # Reduce the kw partial sums: every warp parks its fragments in shared
    # memory, then the kwi == 0 warps add them up and store.
    comptime FRAG = TN * MT * 32 * 4
    var red = stack_allocation[
        KW_MAX * NW * FRAG, Float32, address_space=AddressSpace.SHARED
    ]()
    if nkw > 1:
        comptime for i in range(TN * MT):
            red.unsafe_store[alignment=16](
                ((kwi * NW + nw) * TN * MT + i) * 128 + lane * 4, acc[i]
            )
        barrier()
        if kwi != 0:
            return
        comptime for i in range(TN * MT):
            var s = SIMD[DType.float32, 4](0)
            for j in range(nkw):
                s += red.unsafe_load[width=4, alignment=16](
                    ((j * NW + nw) * TN * MT + i) * 128 + lane * 4
                )
            acc[i] = s

    comptime for tn in range(TN):
        comptime for mt in range(MT):
            _store_fragment[GATED](
                y, acc[tn * MT + mt] * factor, nt0 + tn, g, mbase + 8 * mt + 2 * q, m, Int(n_rows)
            )
    comptime if PDL_LATE:
        pdl_launch_dependents()


# ---------------------------------------------------------------------------
# Asynchronous variant: weights stream through a per-warp shared-memory ring
# filled by cp.async, so the bytes in flight (STAGES-1 k-groups per warp) cost
# no registers. ncu on the register-staged kernel above showed it latency
# bound: 63 registers -> 32 warps/SM, 2.6 TB/s, warps mostly stalled on the
# weight loads; staging through registers deeper (PIPE) doubled the registers
# and halved occupancy.
# ---------------------------------------------------------------------------

comptime _SLOT = 512  # code bytes per n-tile per k-group


@always_inline
def _cp_async_16(saddr: UInt32, src: Pointer[UInt8, ImmutAnyOrigin]):
    inlined_assembly[
        "cp.async.cg.shared.global.L2::256B [$0], [$1], 16;",
        NoneType,
        constraints="r,l,~{memory}",
        has_side_effect=True,
    ](saddr, src)


def nvfp4_gemv_sm90_async_kernel[
    MT: Int, TN: Int, STAGES: Int, ACC: Int, GATED: Bool = False
](
    y: Pointer[BFloat16, MutAnyOrigin],
    x: Pointer[BFloat16, ImmutAnyOrigin],
    codes: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    m_rows: Int64,
    n_rows: Int64,
    k: Int64,
    n_tiles: Int64,
    k_groups: Int64,
    kw: Int64,
):
    """Block = kw warps over one set of TN n-tiles, each warp a contiguous
    slice of the k-groups. Each lane streams its own 16 code bytes per tile
    through a private ring of STAGES shared-memory slots with cp.async (so
    no warp barriers), scale bytes through a register ring of the same depth,
    and activations one group ahead. Dynamic shared memory:
    kw * STAGES * TN * 512 bytes of rings + kw * TN * MT * 512 for the
    reduction over the kw warps."""
    comptime assert STAGES % 2 == 0, "x double buffer alternates with the slot parity"
    var lane = Int(lane_id())
    var warp = Int(thread_idx.x) // 32
    var nkw = Int(kw)
    var m = Int(m_rows)
    var kk = Int(k)
    var nt_count = Int(n_tiles)
    var kg_count = Int(k_groups)
    var g = lane // 4
    var q = lane % 4
    var mbase = Int(block_idx.y) * 8 * MT
    var xrow = mbase + g
    var nt0 = Int(block_idx.x) * TN

    var kg_begin = (warp * kg_count) // nkw
    var ngroups = ((warp + 1) * kg_count) // nkw - kg_begin

    # Per-lane global pointers at this warp's first k-group.
    var cptr = Array[Pointer[UInt8, ImmutAnyOrigin], TN](fill=codes)
    var sptr = Array[Pointer[UInt8, ImmutAnyOrigin], TN](fill=scales)
    comptime for tn in range(TN):
        var t = min(nt0 + tn, nt_count - 1) * kg_count + kg_begin
        cptr[tn] = codes.unsafe_offset(t * 512 + lane * 16)
        sptr[tn] = scales.unsafe_offset(t * 64 + lane * 2)

    comptime RING = STAGES * TN * _SLOT
    var smem = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=16]()
    var ring = smem.unsafe_offset(warp * RING + lane * 16)  # this lane's 16 bytes
    var ring_addr = UInt32(Int(ring))

    var sring = Array[UInt32, STAGES * TN](fill=0)

    # Prologue: groups 0..STAGES-2 in flight (empty commit groups keep the count).
    comptime for j in range(STAGES - 1):
        if j < ngroups:
            comptime for tn in range(TN):
                _cp_async_16(
                    ring_addr + UInt32((j * TN + tn) * _SLOT), cptr[tn].unsafe_offset(j * 512)
                )
                sring[j * TN + tn] = _ldg_stream_u16(sptr[tn].unsafe_offset(j * 64))
        async_copy_commit_group()

    var accs = Array[SIMD[DType.float32, 4], TN * MT * ACC](
        fill=SIMD[DType.float32, 4](0)
    )
    var xbuf = Array[SIMD[DType.uint32, 8], 2 * MT](fill=SIMD[DType.uint32, 8](0))
    comptime for mt in range(MT):
        xbuf[mt] = _load_x_clamped(x, xrow + 8 * mt, kg_begin * 64 + 16 * q, m, kk)

    var i = 0
    while i < ngroups:
        comptime for j in range(STAGES):
            var gi = i + j
            if gi < ngroups:
                # Refill the slot this lane read in the previous step.
                comptime jn = (j + STAGES - 1) % STAGES
                var gn = gi + STAGES - 1
                if gn < ngroups:
                    comptime for tn in range(TN):
                        _cp_async_16(
                            ring_addr + UInt32((jn * TN + tn) * _SLOT),
                            cptr[tn].unsafe_offset(gn * 512),
                        )
                        sring[jn * TN + tn] = _ldg_stream_u16(sptr[tn].unsafe_offset(gn * 64))
                async_copy_commit_group()
                comptime xc = (j % 2) * MT
                comptime xn = ((j + 1) % 2) * MT
                comptime for mt in range(MT):
                    xbuf[xn + mt] = _load_x_clamped(
                        x, xrow + 8 * mt, (kg_begin + gi + 1) * 64 + 16 * q, m, kk
                    )
                async_copy_wait_group(Int32(STAGES - 1))
                comptime for tn in range(TN):
                    var w4 = ring.unsafe_offset((j * TN + tn) * _SLOT).bitcast[
                        UInt32
                    ]().unsafe_load[width=4, alignment=16](0)
                    var s = sring[j * TN + tn]
                    var s_lo = _scale_pair(s & 0xFF)
                    var s_hi = _scale_pair(s >> 8)
                    comptime for t in range(4):
                        var a = _decode_word(w4[t])
                        a[0] = _hmul2(a[0], s_lo)
                        a[1] = _hmul2(a[1], s_hi)
                        a[2] = _hmul2(a[2], s_lo)
                        a[3] = _hmul2(a[3], s_hi)
                        comptime for mt in range(MT):
                            comptime ai = (tn * MT + mt) * ACC + t % ACC
                            accs[ai] = _mma_bf16(
                                a, xbuf[xc + mt][2 * t], xbuf[xc + mt][2 * t + 1], accs[ai]
                            )
        i += STAGES

    var acc = Array[SIMD[DType.float32, 4], TN * MT](fill=SIMD[DType.float32, 4](0))
    comptime for r in range(TN * MT):
        comptime for a in range(ACC):
            acc[r] += accs[r * ACC + a]

    var factor = global_scale.unsafe_load(0) * SM90_EPILOGUE_FACTOR
    if nkw > 1:
        var red = smem.unsafe_offset(nkw * RING).bitcast[Float32]()
        comptime for r in range(TN * MT):
            red.unsafe_store[alignment=16]((warp * TN * MT + r) * 128 + lane * 4, acc[r])
        barrier()
        if warp != 0:
            return
        comptime for r in range(TN * MT):
            var sum = SIMD[DType.float32, 4](0)
            for j in range(nkw):
                sum += red.unsafe_load[width=4, alignment=16]((j * TN * MT + r) * 128 + lane * 4)
            acc[r] = sum

    comptime for tn in range(TN):
        comptime for mt in range(MT):
            _store_fragment[GATED](
                y, acc[tn * MT + mt] * factor, nt0 + tn, g, mbase + 8 * mt + 2 * q, m, Int(n_rows)
            )


def sm90_async_smem_bytes(kw: Int, mt: Int, tn: Int, stages: Int) -> Int:
    return kw * stages * tn * _SLOT + kw * tn * mt * 512


def nvfp4_dequant_sm90_kernel(
    w: Pointer[BFloat16, MutAnyOrigin],
    codes: Pointer[UInt8, ImmutAnyOrigin],
    scales: Pointer[UInt8, ImmutAnyOrigin],
    global_scale: Pointer[Float32, ImmutAnyOrigin],
    n_rows: Int64,
    k: Int64,
    k_groups: Int64,
    total_tiles: Int64,
):
    """Prepared layout -> bf16 W[N, K] (for the large-M route: dequantize once,
    then a regular bf16 matmul). One warp per 16x64 tile."""
    var tile = Int(block_idx.x) * (Int(block_dim.x) // 32) + Int(thread_idx.x) // 32
    if tile >= Int(total_tiles):
        return
    var lane = Int(lane_id())
    var g = lane // 4
    var q = lane % 4
    var kgc = Int(k_groups)
    var nt = tile // kgc
    var kg = tile % kgc
    var kcol = kg * 64 + 16 * q
    var kk = Int(k)
    var nn = Int(n_rows)
    var w4 = _ldg_stream_v4(codes.unsafe_offset(tile * 512 + lane * 16))
    var s = _ldg_stream_u16(scales.unsafe_offset(tile * 64 + lane * 2))
    var s_lo = _scale_pair(s & 0xFF)
    var s_hi = _scale_pair(s >> 8)
    var factor = global_scale.unsafe_load(0) * SM90_EPILOGUE_FACTOR
    var lo = SIMD[DType.float32, 16](0)  # row g, k = kcol + 0..15
    var hi = SIMD[DType.float32, 16](0)  # row g + 8
    comptime for t in range(4):
        var a = _decode_word(w4[t])
        var r0 = bitcast[DType.bfloat16, 2](_hmul2(a[0], s_lo)).cast[DType.float32]()
        var r1 = bitcast[DType.bfloat16, 2](_hmul2(a[1], s_hi)).cast[DType.float32]()
        var r2 = bitcast[DType.bfloat16, 2](_hmul2(a[2], s_lo)).cast[DType.float32]()
        var r3 = bitcast[DType.bfloat16, 2](_hmul2(a[3], s_hi)).cast[DType.float32]()
        lo[4 * t] = r0[0]
        lo[4 * t + 1] = r0[1]
        lo[4 * t + 2] = r2[0]
        lo[4 * t + 3] = r2[1]
        hi[4 * t] = r1[0]
        hi[4 * t + 1] = r1[1]
        hi[4 * t + 2] = r3[0]
        hi[4 * t + 3] = r3[1]
    if kcol >= kk:
        return
    var row = nt * 16 + g
    if row < nn:
        w.unsafe_store[alignment=32](row * kk + kcol, (lo * factor).cast[DType.bfloat16]())
    if row + 8 < nn:
        w.unsafe_store[alignment=32](
            (row + 8) * kk + kcol, (hi * factor).cast[DType.bfloat16]()
        )


# The op's dispatcher (nvfp4_gemv_sm90_dispatch) lives in nvfp4_gemv_bulk.mojo
# with the issue-#24 kernels; its variants 0-2 are these:
#   0: register-staged kernel, 1 m8 tile, 1 n-tile/warp, 4 k-groups per batch
#      (M <= 8; best measured for M = 1..4 on every shape)
#   1: cp.async kernel, 2 m8 tiles, 2 n-tiles/warp, 4-deep ring (M <= 16;
#      best measured for M = 16: x fragments are reused over 2 n-tiles)
#   2: register-staged kernel, 2 m8 tiles (M <= 16; the alternative to 1)
# Larger M is processed in chunks of 8 or 16 rows (grid.y), re-reading the
# weights per chunk; attnquant.graph.nvfp4 routes M > 16 to dequantize + matmul.


def _pick_kw(blocks: Int, k_groups: Int, target_warps: Int) -> Int:
    """Warps along K per block: the smallest power of two >= 4 that puts at
    least target_warps warps on the GPU (at most 16, and at most one warp per
    k-group). Fitted to the H200 sweep in docs/kernels.md: e.g. [16384, 5376]
    -> 4, [5376, 8192] -> 8, [1152, 6912] -> 16; uneven splits or 1-2 warps
    per block were 20-300% slower."""
    var kw = 4
    while kw < 16 and blocks * kw < target_warps:
        kw *= 2
    return max(min(kw, k_groups), 1)


def _aligned_k(k: Int) -> Bool:
    """Whether every 64-wide k-group lies inside K, so the register kernels
    can run their loop without guards or clamps (ALIGNED_K); every Gemma
    projection's K is."""
    return k % 64 == 0


def _launch_gemv[
    MT: Int, TN: Int, NW: Int, KW_MAX: Int, U: Int, ACC: Int, GATED: Bool = False, PDL: Bool = False
](
    y: Pointer[mut=True, BFloat16, _],
    x: Pointer[BFloat16, _],
    codes: Pointer[UInt8, _],
    scales: Pointer[UInt8, _],
    global_scale: Pointer[Float32, _],
    m_rows: Int,
    n_rows: Int,
    k: Int,
    n_tiles: Int,
    k_groups: Int,
    kw_override: Int,
    ctx: DeviceContext,
) raises:
    var blocks_n = ceildiv(n_tiles, NW * TN)
    var kw = kw_override if kw_override > 0 else _pick_kw(blocks_n * NW, k_groups, 2560)
    kw = min(kw, KW_MAX)

    @parameter
    def launch[ALIGNED_K: Bool]() raises:
        ctx.enqueue_function[nvfp4_gemv_sm90_kernel[MT, TN, NW, KW_MAX, U, ACC, 0, GATED, False, ALIGNED_K, 0, PDL]](
            y,
            x,
            codes,
            scales,
            global_scale,
            Int64(m_rows),
            Int64(n_rows),
            Int64(k),
            Int64(n_tiles),
            Int64(k_groups),
            Int64(kw),
            grid_dim=(blocks_n, ceildiv(m_rows, 8 * MT)),
            block_dim=NW * kw * 32,
            attributes=pdl_attributes[PDL](),
        )

    if _aligned_k(k):
        launch[True]()
    else:
        launch[False]()


def _launch_async[
    MT: Int, TN: Int, STAGES: Int, ACC: Int, GATED: Bool = False
](
    y: Pointer[mut=True, BFloat16, _],
    x: Pointer[BFloat16, _],
    codes: Pointer[UInt8, _],
    scales: Pointer[UInt8, _],
    global_scale: Pointer[Float32, _],
    m_rows: Int,
    n_rows: Int,
    k: Int,
    n_tiles: Int,
    k_groups: Int,
    kw_override: Int,
    ctx: DeviceContext,
) raises:
    var blocks_n = ceildiv(n_tiles, TN)
    var kw = kw_override if kw_override > 0 else _pick_kw(blocks_n, k_groups, 1280)
    kw = min(kw, 16)
    var smem = sm90_async_smem_bytes(kw, MT, TN, STAGES)
    ctx.enqueue_function[nvfp4_gemv_sm90_async_kernel[MT, TN, STAGES, ACC, GATED]](
        y,
        x,
        codes,
        scales,
        global_scale,
        Int64(m_rows),
        Int64(n_rows),
        Int64(k),
        Int64(n_tiles),
        Int64(k_groups),
        Int64(kw),
        grid_dim=(blocks_n, ceildiv(m_rows, 8 * MT)),
        block_dim=kw * 32,
        shared_mem_bytes=smem,
        func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
    )


def nvfp4_dequant_sm90(
    w: Pointer[mut=True, BFloat16, _],
    codes: Pointer[UInt8, _],
    scales: Pointer[UInt8, _],
    global_scale: Pointer[Float32, _],
    n_rows: Int,
    k: Int,
    n_tiles: Int,
    k_groups: Int,
    ctx: DeviceContext,
) raises:
    var total = n_tiles * k_groups
    if total == 0:
        return
    ctx.enqueue_function[nvfp4_dequant_sm90_kernel](
        w,
        codes,
        scales,
        global_scale,
        Int64(n_rows),
        Int64(k),
        Int64(k_groups),
        Int64(total),
        grid_dim=ceildiv(total, 8),
        block_dim=256,
    )
