# sm90 NVFP4 GEMV, second generation: bulk-copy weight rings,
# split-K over a thread-block cluster, and the op's variant dispatcher.
#
# Same prepared layout, decode and numerics as the kernels in
# nvfp4_matmul.mojo (16-row x 64-k tiles, 512 code bytes + 64 scale bytes,
# GF(2)-encoded codes, E5M3 scale bytes, mma.sync m16n8k16 bf16 -> f32).
# What changes is how the bytes reach the tensor cores and how the work is cut:
#
# * Bulk kernel: every warp owns a private ring of STAGES shared-memory slots;
#   lane 0 fills a slot with cp.async.bulk (one copy per n-tile for G k-groups
#   of codes, one for their scales) completing on the slot's mbarrier. The
#   bytes in flight per warp ((STAGES-1) * G * TN * 576 while it computes) cost
#   neither registers nor per-lane issue slots; the register kernel keeps at
#   most 4 groups in flight and only between its batches (ncu: 7.6 of 15.1
#   cycles per issued instruction were long-scoreboard stalls on them).
# * Split-K over a cluster: grid.z = SK blocks per n-tile range, launched as
#   one cluster (1, 1, SK) (sm_90 compile-time cluster shape, so a plain
#   launch works); the partial sums meet in cluster rank 0's shared memory
#   (distributed shared memory), so there is still one launch and no global
#   workspace. This multiplies the number of blocks for short grids (N = 1152
#   or 5376: 72 / 336 n-tiles for 132 SMs).
# * The epilogue's global-scale load is issued at kernel start (it was a
#   dependent load after the main loop: one more memory latency per call,
#   which matters for the 1-3 us launches of the small Gemma 3 shapes).

from std.math import ceildiv
from std.memory import bitcast, stack_allocation
from std.sys import _RegisterPackType
from std.sys._assembly import inlined_assembly
from std.utils.static_tuple import StaticTuple

from max.gpu import barrier, block_idx, lane_id, thread_idx
from max.gpu.host import DeviceContext, Dim, FuncAttribute
from max.gpu.memory import AddressSpace, external_memory
from max.gpu.sync import syncwarp

from .pdl import pdl_attributes, pdl_launch_dependents, pdl_wait, produced_invariant
from .nvfp4_matmul import (
    SM90_EPILOGUE_FACTOR,
    _aligned_k,
    _decode_word,
    _hmul2,
    _k_slice,
    _launch_async,
    _launch_gemv,
    _mma_bf16,
    _pick_kw,
    _scale_pair,
    _store_fragment,
)

comptime _CODE = 512  # code bytes per tile (16 rows x 64 k)
comptime _SCALE = 64  # scale bytes per tile
comptime _FRAG = 512  # bytes of one warp's f32 mma fragment (32 lanes x 4)


# ===----------------------------------------------------------------------=== #
# PTX helpers: mbarrier, bulk copy, cluster
# ===----------------------------------------------------------------------=== #


@always_inline
def _mbar_init(addr: UInt32, count: UInt32):
    inlined_assembly[
        "mbarrier.init.shared::cta.b64 [$0], $1;",
        NoneType,
        constraints="r,r,~{memory}",
        has_side_effect=True,
    ](addr, count)


@always_inline
def _fence_mbar_init():
    inlined_assembly[
        "fence.mbarrier_init.release.cluster;", NoneType, constraints="~{memory}", has_side_effect=True
    ]()


@always_inline
def _mbar_expect_tx(addr: UInt32, tx_bytes: UInt32):
    inlined_assembly[
        "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;",
        NoneType,
        constraints="r,r,~{memory}",
        has_side_effect=True,
    ](addr, tx_bytes)


@always_inline
def _mbar_try_wait(addr: UInt32, parity: UInt32) -> UInt32:
    return inlined_assembly[
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }",
        UInt32,
        constraints="=r,r,r,~{memory}",
        has_side_effect=True,
    ](addr, parity)


@always_inline
def _mbar_wait(addr: UInt32, parity: UInt32):
    while _mbar_try_wait(addr, parity) == 0:
        pass


@always_inline
def _bulk_g2s(dst: UInt32, src: Pointer[UInt8, ImmutAnyOrigin], size: UInt32, mbar: UInt32):
    """cp.async.bulk global -> this CTA's shared memory, completing `size`
    bytes of transaction count on `mbar` (size and both addresses 16-aligned)."""
    inlined_assembly[
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];",
        NoneType,
        constraints="r,l,r,r,~{memory}",
        has_side_effect=True,
    ](dst, src, size, mbar)


@always_inline
def _lds_v4(addr: UInt32) -> SIMD[DType.uint32, 4]:
    var r = inlined_assembly[
        "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
        _RegisterPackType[UInt32, UInt32, UInt32, UInt32],
        constraints="=r,=r,=r,=r,r,~{memory}",
        has_side_effect=True,
    ](addr)
    return SIMD[DType.uint32, 4](r[0], r[1], r[2], r[3])


@always_inline
def _lds_u16(addr: UInt32) -> UInt32:
    return inlined_assembly[
        "ld.shared.u16 $0, [$1];", UInt32, constraints="=r,r,~{memory}", has_side_effect=True
    ](addr)


@always_inline
def _cluster_sync():
    """All threads of the cluster; release/acquire orders shared::cluster memory."""
    inlined_assembly[
        "barrier.cluster.arrive.release; barrier.cluster.wait.acquire;",
        NoneType,
        constraints="~{memory}",
        has_side_effect=True,
    ]()


@always_inline
def _cluster_rank() -> UInt32:
    return inlined_assembly["mov.u32 $0, %cluster_ctarank;", UInt32, constraints="=r", has_side_effect=False]()


@always_inline
def _ld_dsmem_f32x4(local_addr: UInt32, rank: UInt32) -> SIMD[DType.float32, 4]:
    """4 floats at `local_addr` in the shared memory of cluster block `rank`."""
    var r = inlined_assembly[
        "{ .reg .b32 a; mapa.shared::cluster.u32 a, $4, $5; ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [a]; }",
        _RegisterPackType[Float32, Float32, Float32, Float32],
        constraints="=f,=f,=f,=f,r,r,~{memory}",
        has_side_effect=True,
    ](local_addr, rank)
    return SIMD[DType.float32, 4](r[0], r[1], r[2], r[3])


# ===----------------------------------------------------------------------=== #
# Shared epilogue: reduce over the kw warps (and the SK cluster blocks), store
# ===----------------------------------------------------------------------=== #


@always_inline
def _reduce_store[
    TN: Int, MT: Int, SK: Int, GATED: Bool
](
    acc: Array[SIMD[DType.float32, 4], TN * MT],
    red_addr: UInt32,
    red: Pointer[mut=True, Float32, _, address_space=AddressSpace.SHARED],
    y: Pointer[BFloat16, MutAnyOrigin],
    factor: Float32,
    warp: Int,
    lane: Int,
    nkw: Int,
    nt0: Int,
    mbase: Int,
    m: Int,
    nn: Int,
):
    """Every warp parks its TN*MT fragments at red[warp]; warp 0 of cluster
    rank 0 adds all kw (x SK) of them and stores bf16. With SK > 1 every thread
    of every block passes both cluster barriers (the second keeps the peers'
    shared memory alive until rank 0 has read it)."""
    var total = acc.copy()
    comptime if SK == 1:
        if nkw > 1:
            comptime for i in range(TN * MT):
                red.unsafe_store[alignment=16]((warp * TN * MT + i) * 128 + lane * 4, acc[i])
            barrier()
            if warp != 0:
                return
            comptime for i in range(TN * MT):
                var s = SIMD[DType.float32, 4](0)
                for j in range(nkw):
                    s += red.unsafe_load[width=4, alignment=16]((j * TN * MT + i) * 128 + lane * 4)
                total[i] = s
    else:
        comptime for i in range(TN * MT):
            red.unsafe_store[alignment=16]((warp * TN * MT + i) * 128 + lane * 4, acc[i])
        _cluster_sync()
        var lead = _cluster_rank() == 0 and warp == 0
        if lead:
            comptime for i in range(TN * MT):
                var s = SIMD[DType.float32, 4](0)
                comptime for r in range(SK):
                    for j in range(nkw):
                        s += _ld_dsmem_f32x4(
                            red_addr + UInt32(((j * TN * MT + i) * 128 + lane * 4) * 4), UInt32(r)
                        )
                total[i] = s
        _cluster_sync()
        if not lead:
            return

    var g = lane // 4
    var q = lane % 4
    comptime for tn in range(TN):
        comptime for mt in range(MT):
            _store_fragment[GATED](y, total[tn * MT + mt] * factor, nt0 + tn, g, mbase + 8 * mt + 2 * q, m, nn)


@always_inline
def _k_range[SK: Int](warp: Int, nkw: Int, kg_count: Int) -> Tuple[Int, Int]:
    """(first k-group, count) of this warp: block z of SK takes a contiguous
    share of the k-groups, then its kw warps split that share."""
    var zb = 0
    var ze = kg_count
    comptime if SK > 1:
        var z = Int(block_idx.z)
        zb = (z * kg_count) // SK
        ze = ((z + 1) * kg_count) // SK
    var span = ze - zb
    var b = zb + (warp * span) // nkw
    var e = zb + ((warp + 1) * span) // nkw
    return (b, e - b)


# ===----------------------------------------------------------------------=== #
# Bulk-copy kernel
# ===----------------------------------------------------------------------=== #


def bulk_smem_bytes[MT: Int, TN: Int, STAGES: Int, G: Int](kw: Int) -> Int:
    """Dynamic shared memory of nvfp4_gemv_sm90_bulk_kernel: rings, mbarriers,
    reduction buffer (kw fragments of TN*MT tiles)."""
    return _red_offset[MT, TN, STAGES, G](kw) + kw * TN * MT * _FRAG


@always_inline
def _red_offset[MT: Int, TN: Int, STAGES: Int, G: Int](kw: Int) -> Int:
    """Byte offset of the reduction buffer: after the rings and the mbarriers,
    rounded up to 16 (float4 stores)."""
    return (kw * STAGES * TN * G * (_CODE + _SCALE) + kw * STAGES * 8 + 15) // 16 * 16


@always_inline
def _bulk_body[
    MT: Int, TN: Int, STAGES: Int, G: Int, ACC: Int, SK: Int, PDL: Bool = False, GATED: Bool = False
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
    comptime assert G % 2 == 0, "activations alternate two register buffers per group"
    comptime SLOT = TN * G * (_CODE + _SCALE)
    comptime SCALE_OFF = TN * G * _CODE
    comptime if PDL:
        pdl_launch_dependents()
    # Weights and the global scale are constants: they may be read before the
    # previous kernel has finished (PDL); x and y only after pdl_wait.
    var factor = global_scale.unsafe_load(0) * SM90_EPILOGUE_FACTOR
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
    var nt0 = Int(block_idx.x) * TN
    var rng = _k_range[SK](warp, nkw, kg_count)
    var kg_begin = rng[0]
    var ngroups = rng[1]
    var nstages = ceildiv(ngroups, G)

    var smem = external_memory[UInt8, address_space=AddressSpace.SHARED, alignment=128]()
    var base = UInt32(Int(smem))
    var ring = base + UInt32(warp * STAGES * SLOT)
    var bars = base + UInt32(nkw * STAGES * SLOT + warp * STAGES * 8)
    var red_off = _red_offset[MT, TN, STAGES, G](nkw)
    var red = smem.unsafe_offset(red_off).bitcast[Float32]()

    # This warp's tiles at its first k-group; n-tiles past the end (last block,
    # TN > 1) re-read the last one and their rows are never stored.
    var src_c = Array[Pointer[UInt8, ImmutAnyOrigin], TN](fill=codes)
    var src_s = Array[Pointer[UInt8, ImmutAnyOrigin], TN](fill=scales)
    comptime for tn in range(TN):
        var t0 = min(nt0 + tn, nt_count - 1) * kg_count + kg_begin
        src_c[tn] = codes.unsafe_offset(t0 * _CODE)
        src_s[tn] = scales.unsafe_offset(t0 * _SCALE)

    if lane == 0:
        comptime for j in range(STAGES):
            _mbar_init(bars + UInt32(8 * j), 1)
        _fence_mbar_init()
    syncwarp()

    # Loop arithmetic in 32 bits (64-bit Int compares and selects doubled the
    # per-stage overhead in the first SASS of this kernel).
    var ngroups32 = Int32(ngroups)
    var nstages32 = Int32(nstages)

    @always_inline
    @parameter
    def issue[slot: Int](stage: Int32):
        """Lane 0: k-groups [stage*G, +G) of this warp (fewer at the end) into
        ring slot `slot`, completing on its mbarrier."""
        var ng = UInt32(min(Int32(G), ngroups32 - stage * Int32(G)))
        comptime bar_off = 8 * slot
        comptime dst_off = slot * SLOT
        _mbar_expect_tx(bars + UInt32(bar_off), ng * UInt32(TN * (_CODE + _SCALE)))
        var first = Int(stage) * G
        comptime for tn in range(TN):
            _bulk_g2s(
                ring + UInt32(dst_off + tn * G * _CODE),
                src_c[tn].unsafe_offset(first * _CODE),
                ng * UInt32(_CODE),
                bars + UInt32(bar_off),
            )
            _bulk_g2s(
                ring + UInt32(dst_off + SCALE_OFF + tn * G * _SCALE),
                src_s[tn].unsafe_offset(first * _SCALE),
                ng * UInt32(_SCALE),
                bars + UInt32(bar_off),
            )

    if lane == 0:
        comptime for j in range(STAGES):
            if Int32(j) < nstages32:
                issue[j](Int32(j))

    comptime if PDL:
        pdl_wait()
    # Activations: the lane's 16 bf16 of rows g (+8 per m-tile) at its k block,
    # one group ahead in registers; rows >= M read row M-1 and k past K reads
    # the last block (zero codes there), so no predicates.
    var xptr = Array[Pointer[BFloat16, ImmutAnyOrigin], MT](fill=x)
    comptime for mt in range(MT):
        xptr[mt] = x.unsafe_offset(min(mbase + g + 8 * mt, m - 1) * kk + 16 * q)
    var xlimit = Int32(kk - 16 - 16 * q)
    var xk = Int32(kg_begin * 64)  # k offset of the group being computed
    var xbuf = Array[SIMD[DType.uint32, 8], 2 * MT](fill=SIMD[DType.uint32, 8](0))
    comptime XINV = produced_invariant[PDL]()  # x is the previous kernel's output
    comptime for mt in range(MT):
        var v = xptr[mt].unsafe_load[width=16, alignment=32, invariant=XINV](Int(min(xk, xlimit)))
        xbuf[mt] = bitcast[DType.uint32, 8](v)

    var accs = Array[SIMD[DType.float32, 4], TN * MT * ACC](fill=SIMD[DType.float32, 4](0))
    var lane_c = ring + UInt32(lane * 16)
    var lane_s = ring + UInt32(SCALE_OFF + lane * 2)
    var parity = UInt32(0)
    var s = Int32(0)
    while s < nstages32:
        comptime for j in range(STAGES):
            var st = s + Int32(j)
            if st < nstages32:
                _mbar_wait(bars + UInt32(8 * j), parity)
                var ng = ngroups32 - st * Int32(G)
                comptime for gi in range(G):
                    if gi == 0 or Int32(gi) < ng:
                        comptime cur = (gi % 2) * MT
                        comptime nxt = ((gi + 1) % 2) * MT
                        xk += 64
                        comptime for mt in range(MT):
                            var v = xptr[mt].unsafe_load[width=16, alignment=32, invariant=XINV](Int(min(xk, xlimit)))
                            xbuf[nxt + mt] = bitcast[DType.uint32, 8](v)
                        comptime for tn in range(TN):
                            comptime c_off = j * SLOT + (tn * G + gi) * _CODE
                            comptime s_off = j * SLOT + (tn * G + gi) * _SCALE
                            var w4 = _lds_v4(lane_c + UInt32(c_off))
                            var sc = _lds_u16(lane_s + UInt32(s_off))
                            var s_lo = _scale_pair(sc & 0xFF)
                            var s_hi = _scale_pair(sc >> 8)
                            comptime for t in range(4):
                                var a = _decode_word(w4[t])
                                a[0] = _hmul2(a[0], s_lo)
                                a[1] = _hmul2(a[1], s_hi)
                                a[2] = _hmul2(a[2], s_lo)
                                a[3] = _hmul2(a[3], s_hi)
                                comptime for mt in range(MT):
                                    comptime ai = (tn * MT + mt) * ACC + (gi * 4 + t) % ACC
                                    accs[ai] = _mma_bf16(
                                        a, xbuf[cur + mt][2 * t], xbuf[cur + mt][2 * t + 1], accs[ai]
                                    )
                # Every lane has read slot j: lane 0 refills it, STAGES stages on.
                syncwarp()
                if lane == 0 and st + Int32(STAGES) < nstages32:
                    issue[j](st + Int32(STAGES))
        s += Int32(STAGES)
        parity ^= 1

    var acc = Array[SIMD[DType.float32, 4], TN * MT](fill=SIMD[DType.float32, 4](0))
    comptime for i in range(TN * MT):
        comptime for a in range(ACC):
            acc[i] += accs[i * ACC + a]
    _reduce_store[TN, MT, SK, GATED](
        acc, base + UInt32(red_off), red, y, factor, warp, lane, nkw, nt0, mbase, m, Int(n_rows)
    )


def nvfp4_gemv_sm90_bulk_kernel[
    MT: Int, TN: Int, STAGES: Int, G: Int, ACC: Int, PDL: Bool = False, GATED: Bool = False
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
    """Block = kw warps over TN n-tiles (grid.x) and 8*MT activation rows
    (grid.y); each warp streams a contiguous slice of the k-groups through its
    own bulk-copy ring. Needs sm_90 (cp.async.bulk, mbarrier tx-count).
    PDL: the weight ring fills before griddepcontrol.wait (programmatic
    dependent launch overlaps it with the previous kernel's tail)."""
    _bulk_body[MT, TN, STAGES, G, ACC, 1, PDL, GATED](
        y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw
    )


@__llvm_metadata(`nvvm.cluster_dim`=StaticTuple[Int32, 3](1, 1, Int32(SK)))
def nvfp4_gemv_sm90_bulk_splitk_kernel[
    MT: Int, TN: Int, STAGES: Int, G: Int, ACC: Int, SK: Int, PDL: Bool = False, GATED: Bool = False
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
    """The bulk kernel split over K by a (1, 1, SK) cluster: grid.z = SK."""
    _bulk_body[MT, TN, STAGES, G, ACC, SK, PDL, GATED](
        y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw
    )


# ===----------------------------------------------------------------------=== #
# Register-staged kernel with the hoisted epilogue load and cluster split-K
# ===----------------------------------------------------------------------=== #


@always_inline
def _reg_body[
    MT: Int, U: Int, ACC: Int, SK: Int, KW_MAX: Int, GATED: Bool, ALIGNED_K: Bool
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
    """nvfp4_gemv_sm90_kernel[MT, 1, 1, KW_MAX, U, ACC] (one n-tile per block,
    U k-groups per register batch), with the global scale loaded first and
    the k-groups split over SK cluster blocks as well as kw warps.
    ALIGNED_K: K % 64 == 0, the loop without guards or clamps (_k_slice)."""
    var factor = global_scale.unsafe_load(0) * SM90_EPILOGUE_FACTOR
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
    var nt0 = Int(block_idx.x)
    var rng = _k_range[SK](warp, nkw, kg_count)
    var kg_begin = rng[0]
    var kg_end = rng[0] + rng[1]

    var cptr = Array[Pointer[UInt8, ImmutAnyOrigin], 1](fill=codes)
    var sptr = Array[Pointer[UInt8, ImmutAnyOrigin], 1](fill=scales)
    var t0 = min(nt0, nt_count - 1) * kg_count
    cptr[0] = codes.unsafe_offset(t0 * _CODE + lane * 16)
    sptr[0] = scales.unsafe_offset(t0 * _SCALE + lane * 2)
    var xptr = Array[Pointer[BFloat16, ImmutAnyOrigin], MT](fill=x)
    comptime for mt in range(MT):
        xptr[mt] = x.unsafe_offset(min(mbase + g + 8 * mt, m - 1) * kk + 16 * q)
    var xlimit = kk - 16 - 16 * q
    var opaque_zero = UInt32(Int(kw) >> 40)

    var accs = Array[SIMD[DType.float32, 4], MT * ACC](fill=SIMD[DType.float32, 4](0))
    _k_slice[U, 1, MT, ACC, ALIGNED_K](accs, cptr, sptr, xptr, xlimit, kg_begin, kg_end, opaque_zero)

    var acc = Array[SIMD[DType.float32, 4], MT](fill=SIMD[DType.float32, 4](0))
    comptime for i in range(MT):
        comptime for a in range(ACC):
            acc[i] += accs[i * ACC + a]
    var red = stack_allocation[KW_MAX * MT * 128, Float32, address_space=AddressSpace.SHARED]()
    _reduce_store[1, MT, SK, GATED](
        acc, UInt32(Int(red)), red, y, factor, warp, lane, nkw, nt0, mbase, m, Int(n_rows)
    )


def nvfp4_gemv_sm90_reg_kernel[
    MT: Int, U: Int, ACC: Int, GATED: Bool = False, ALIGNED_K: Bool = False
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
    _reg_body[MT, U, ACC, 1, 16, GATED, ALIGNED_K](
        y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw
    )


@__llvm_metadata(`nvvm.cluster_dim`=StaticTuple[Int32, 3](1, 1, Int32(SK)))
def nvfp4_gemv_sm90_reg_splitk_kernel[
    MT: Int, U: Int, ACC: Int, SK: Int, GATED: Bool = False, ALIGNED_K: Bool = False
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
    _reg_body[MT, U, ACC, SK, 16, GATED, ALIGNED_K](
        y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw
    )


# ===----------------------------------------------------------------------=== #
# Launchers and the op's dispatcher
# ===----------------------------------------------------------------------=== #


def pick_bulk_split(blocks: Int, k_groups: Int, min_groups: Int) -> Tuple[Int, Int]:
    """(kw, SK) for the bulk and split-K kernels when the op leaves them to us.

    Aims at >= 2560 warps on the GPU (the register kernel's measured sweet
    spot, 132 SMs) while every warp keeps >= min_groups k-groups (a ring needs
    something to stream): kw grows 4 -> 8 first, then the cluster split SK
    2 -> 4 for grids too short to fill the SMs (N = 1152, 5376). The device
    sweep (bench/kernel_timing/kernels_h200.py) overrides both."""
    var kw = 4
    var sk = 1
    while blocks * kw * sk < 2560:
        if kw < 8 and k_groups // (2 * kw * sk) >= min_groups:
            kw *= 2
        elif sk < 4 and k_groups // (kw * 2 * sk) >= min_groups:
            sk *= 2
        else:
            break
    return (max(min(kw, k_groups // sk), 1), sk)


def _launch_bulk[
    MT: Int, TN: Int, STAGES: Int, G: Int, ACC: Int, SK: Int, PDL: Bool = False, GATED: Bool = False
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
    kw: Int,
    ctx: DeviceContext,
) raises:
    var blocks_n = ceildiv(n_tiles, TN)
    var kw_ = max(min(kw, 16, k_groups // SK), 1)
    var smem = bulk_smem_bytes[MT, TN, STAGES, G](kw_)
    comptime if SK == 1:
        ctx.enqueue_function[nvfp4_gemv_sm90_bulk_kernel[MT, TN, STAGES, G, ACC, PDL, GATED]](
            y, x, codes, scales, global_scale,
            Int64(m_rows), Int64(n_rows), Int64(k), Int64(n_tiles), Int64(k_groups), Int64(kw_),
            grid_dim=(blocks_n, ceildiv(m_rows, 8 * MT)),
            block_dim=kw_ * 32,
            shared_mem_bytes=smem,
            attributes=pdl_attributes[PDL](),
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
        )  # fmt: skip
    else:
        ctx.enqueue_function[nvfp4_gemv_sm90_bulk_splitk_kernel[MT, TN, STAGES, G, ACC, SK, PDL, GATED]](
            y, x, codes, scales, global_scale,
            Int64(m_rows), Int64(n_rows), Int64(k), Int64(n_tiles), Int64(k_groups), Int64(kw_),
            grid_dim=(blocks_n, ceildiv(m_rows, 8 * MT), SK),
            block_dim=kw_ * 32,
            cluster_dim=Dim(1, 1, SK),
            shared_mem_bytes=smem,
            attributes=pdl_attributes[PDL](),
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(UInt32(smem)),
        )  # fmt: skip


def _launch_reg[
    MT: Int, U: Int, ACC: Int, SK: Int, GATED: Bool = False
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
    kw: Int,
    ctx: DeviceContext,
) raises:
    var kw_ = max(min(kw, 16, k_groups // SK), 1)

    @parameter
    def launch[ALIGNED_K: Bool]() raises:
        comptime if SK == 1:
            ctx.enqueue_function[nvfp4_gemv_sm90_reg_kernel[MT, U, ACC, GATED, ALIGNED_K]](
                y, x, codes, scales, global_scale,
                Int64(m_rows), Int64(n_rows), Int64(k), Int64(n_tiles), Int64(k_groups), Int64(kw_),
                grid_dim=(n_tiles, ceildiv(m_rows, 8 * MT)),
                block_dim=kw_ * 32,
            )  # fmt: skip
        else:
            ctx.enqueue_function[nvfp4_gemv_sm90_reg_splitk_kernel[MT, U, ACC, SK, GATED, ALIGNED_K]](
                y, x, codes, scales, global_scale,
                Int64(m_rows), Int64(n_rows), Int64(k), Int64(n_tiles), Int64(k_groups), Int64(kw_),
                grid_dim=(n_tiles, ceildiv(m_rows, 8 * MT), SK),
                block_dim=kw_ * 32,
                cluster_dim=Dim(1, 1, SK),
            )  # fmt: skip

    if _aligned_k(k):
        launch[True]()
    else:
        launch[False]()


# The op's `variant` parameter (compile-time, so a graph compiles only the
# kernels it can launch; -1 compiles the auto pair 0/1):
#   0  register kernel, MT=1 (M <= 8)             } the first kernels, unchanged;
#   1  cp.async ring, MT=2, TN=2 (M <= 16)         } -1 picks 0 for M <= 8,
#   2  register kernel, MT=2 (M <= 16)             } else 1
#   3  bulk ring, MT=1 TN=1, 4 stages x 2 groups   (M <= 8)
#   4  bulk ring, MT=1 TN=1, 3 stages x 4 groups   (M <= 8)
#   5  bulk ring, MT=2 TN=2, 4 stages x 2 groups   (M <= 16)
#   6  bulk ring, MT=2 TN=4, 3 stages x 2 groups   (M <= 16)
#   7  register kernel MT=1, global scale hoisted, cluster split-K (M <= 8)
#   8  bulk ring, MT=1 TN=1, 4 stages x 4 groups (12 groups = 6.9 KB in flight per warp)
# `splitk` (variants 3-8): cluster blocks along K, 1/2/4; 0 = pick. `pdl`
# (variants 0, 2, 3-6, 8, and -1 up to 8 rows): launch with programmatic
# stream serialization (pdl.mojo); the kernel lets the next one start at once,
# and its launch overlaps the previous kernel when that kernel triggers early
# (the bulk rings also fill their weight ring before griddepcontrol.wait). `kw`:
# warps along K per block; 0 = pick. Variants 3-8 need sm_90 (bulk copies,
# clusters). Any M is correct: rows past 8*MT run as further grid rows.
# `gated`: every variant's epilogue stores gelu_tanh(gate) * up of a gate|up
# weight interleaved by 8 rows (_store_fragment); n_rows is then N/2.
comptime SM90_VARIANTS = 9


def _sk_dispatch[
    launch: def[SK: Int](Int) raises capturing -> None
](sk: Int, kw: Int) raises:
    if sk <= 1:
        launch[1](kw)
    elif sk == 2:
        launch[2](kw)
    elif sk == 4:
        launch[4](kw)
    else:
        raise Error(t"nvfp4_gemv_sm90: splitk must be 1, 2 or 4, got {sk}")


def nvfp4_gemv_sm90_dispatch[
    variant: Int, pdl: Bool = False, gated: Bool = False
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
    splitk: Int,
    ctx: DeviceContext,
) raises:
    if m_rows == 0 or n_rows == 0:
        return
    comptime if variant < 0:
        if m_rows <= 8:
            _launch_gemv[1, 1, 1, 16, 4, 1, gated, pdl](
                y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_override, ctx
            )  # fmt: skip
        else:
            _launch_async[2, 2, 4, 2, gated](
                y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_override, ctx
            )  # fmt: skip
    elif variant == 0:
        _launch_gemv[1, 1, 1, 16, 4, 1, gated, pdl](
            y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_override, ctx
        )  # fmt: skip
    elif variant == 1:
        _launch_async[2, 2, 4, 2, gated](
            y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_override, ctx
        )  # fmt: skip
    elif variant == 2:
        _launch_gemv[2, 1, 1, 16, 4, 2, gated, pdl](
            y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_override, ctx
        )  # fmt: skip
    elif variant >= 3 and variant <= 8:
        comptime MT = 2 if variant == 5 or variant == 6 else 1
        comptime TN = 4 if variant == 6 else (2 if variant == 5 else 1)
        comptime STAGES = 3 if variant == 4 or variant == 6 else 4
        comptime G = 4 if variant == 4 or variant == 8 else 2
        var blocks = ceildiv(n_tiles, TN) * ceildiv(m_rows, 8 * MT)
        var picked = pick_bulk_split(blocks, k_groups, 2 * G if variant != 7 else 4)
        var kw = kw_override if kw_override > 0 else picked[0]
        var sk = splitk if splitk > 0 else picked[1]

        @parameter
        def launch[SK: Int](kw_: Int) raises:
            comptime if variant == 7:
                _launch_reg[1, 4, 1, SK, gated](
                    y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_, ctx
                )  # fmt: skip
            else:
                _launch_bulk[MT, TN, STAGES, G, 1, SK, pdl, gated](
                    y, x, codes, scales, global_scale, m_rows, n_rows, k, n_tiles, k_groups, kw_, ctx
                )  # fmt: skip

        _sk_dispatch[launch](sk, kw)
    else:
        raise Error(t"nvfp4_gemv_sm90: unknown variant {variant}")
