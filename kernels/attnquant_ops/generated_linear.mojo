# In-graph reconstruction kernels ("generated" weights):
#
#   W = s[:, None] * W0 + u @ v.T            W0 [N, K], s [N], u [N, r], v [K, r]
#   y[M, N] = s * (x @ W0.T) + (x @ v) @ u.T  computed without materializing W
#
# W0 and x are in the model dtype (float32 on CPU; bf16 or float32 on GPU),
# s, u, v are float32; every product is accumulated in float32 and the output
# is written in the output dtype. 0 <= r <= MAX_GENERATED_RANK (64): the main
# GPU kernel keeps t = x @ v for its rows in a fixed shared-memory buffer of
# 64 floats per activation row, and each lane owns t columns lane and lane+32.
#
# CPU: t = x @ v first (a float32 heap buffer), then the output rows are split
# into chunks run in parallel; dots are 16-wide SIMD with a scalar tail.
#
# GPU (NVIDIA; the kernels assume 32-lane warps):
#   1. _lowrank_partial_kernel: t partials. Block g of grid.x owns a K slice
#      and up to 16 activation rows (grid.y); thread (kt, j) = divmod(tid, r)
#      reads v[k, j] (consecutive threads -> consecutive floats of v, so the
#      reads coalesce) for k = kt, kt + 256//r, ... and accumulates x[m, k] *
#      v[k, j]; the 256//r threads sharing j are summed through shared memory.
#      Writes part[(m*r + j) * G + g]. G ~ K / (8 * 256//r), capped so that
#      all blocks number <= 512 for large M (partials <= 2 MB).
#   2. _lowrank_reduce_kernel: one warp per (m, j) sums the G partials into
#      t[M, r] (skipped when G == 1: the partials already are t).
#      Two launches instead of one t per block of the main kernel: a block
#      recomputing x @ v would read all of v (K*r*4 bytes, 0.9 MB for the
#      Gemma 3 1B down projection at r = 32) from L2 for every 8 output rows.
#   3. _main_kernel: one warp per output row n (8 warps per block), up to MT
#      activation rows per block (MT = 1, 4 or 16, picked from M; larger M
#      loops over grid.y). The block first copies t for its rows into shared
#      memory; each lane then streams 16-byte vectors of W0[n] (U vectors in
#      flight), dots them with the matching x vectors in float32, scales by
#      s[n], adds u[n, lane] * t[m, lane] + u[n, lane+32] * t[m, lane+32] and
#      the warp sums. The DUAL form does gate and up together (same x, two
#      thetas) and writes h = gelu_tanh(gate) * up (the fused MLP).
#      Fast for decode-sized M (W0 is read once per 16 activation rows);
#      correct but slow for prefill-sized M, where a matmul formulation wins.
#   The fused MLP (generated_mlp_gpu) enqueues t_gate, t_up, the DUAL main
#   kernel writing h [M, I] float32 to a scratch buffer, t_down = h @ v_down,
#   and the main kernel for down over h: 4 to 8 launches on one stream.
#
# Scratch buffers (partials, t, the MLP's h) come from ctx.enqueue_create_buffer
# and are released stream-ordered when they go out of scope, as MAX's own
# split-K attention kernels do.

from std.math import ceildiv
from std.memory import stack_allocation
from std.sys import size_of

from max.algorithm import parallelize
from max.gpu import barrier, block_idx, grid_dim, lane_id, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.memory import AddressSpace
from max.gpu.primitives.warp import sum as warp_sum

from .activation import gelu_tanh

comptime MAX_GENERATED_RANK = 64

comptime _F32 = DType.float32

# Host-side pointer types: explicit any-origins, so that one buffer may be
# passed for two arguments (the non-DUAL calls pass theta a twice).
comptime RPtr[dt: DType] = Pointer[Scalar[dt], ImmutAnyOrigin]
comptime WPtr[dt: DType] = Pointer[Scalar[dt], MutAnyOrigin]


def check_theta(
    what: StaticString,
    n: Int,
    k: Int,
    w0_rows: Int,
    w0_cols: Int,
    scale_len: Int,
    u_rows: Int,
    u_cols: Int,
    v_rows: Int,
    v_cols: Int,
) raises:
    """Shapes of one theta (w0 [N, K], scale [N], u [N, r], v [K, r]); `what`
    names the op (and projection) in the messages."""
    if w0_rows != n or w0_cols != k:
        raise Error(t"{what}: w0 is [{w0_rows}, {w0_cols}], expected [N={n}, K={k}]")
    if scale_len != n:
        raise Error(t"{what}: scale is [{scale_len}], expected [N={n}]")
    if u_rows != n:
        raise Error(t"{what}: u is [{u_rows}, {u_cols}], expected [N={n}, r]")
    if v_rows != k or v_cols != u_cols:
        raise Error(
            t"{what}: v is [{v_rows}, {v_cols}], expected [K={k}, r={u_cols}] (u is [{u_rows}, {u_cols}])"
        )
    if u_cols > MAX_GENERATED_RANK:
        raise Error(
            t"{what}: rank r={u_cols} exceeds MAX_GENERATED_RANK={MAX_GENERATED_RANK} (the kernel's shared-memory buffer); use the GEMM formulation (ATTNQUANT_GEMM=1) or ATTNQUANT_RANK<=64"
        )


# ===----------------------------------------------------------------------=== #
# CPU
# ===----------------------------------------------------------------------=== #


@always_inline
def _dot_cpu[
    at: DType, bt: DType
](a: RPtr[at], b: RPtr[bt], k: Int) -> Float32:
    comptime W = 16
    var acc = SIMD[_F32, W](0)
    var i = 0
    while i + W <= k:
        acc += a.unsafe_load[width=W](i).cast[_F32]() * b.unsafe_load[width=W](i).cast[_F32]()
        i += W
    var s = acc.reduce_add()
    while i < k:
        s += a.unsafe_load(i).cast[_F32]() * b.unsafe_load(i).cast[_F32]()
        i += 1
    return s


def lowrank_t_cpu[
    xt: DType
](
    t: WPtr[_F32],
    x: RPtr[xt],
    v: RPtr[_F32],
    m_rows: Int,
    k: Int,
    r: Int,
):
    """t[M, r] = x[M, K] @ v[K, r] in float32."""
    for i in range(m_rows * r):
        t.unsafe_store(i, Float32(0))
    for m in range(m_rows):
        for kk in range(k):
            var xv = x.unsafe_load(m * k + kk).cast[_F32]()
            for j in range(r):
                t.unsafe_store(
                    m * r + j, t.unsafe_load(m * r + j) + xv * v.unsafe_load(kk * r + j)
                )


def rows_cpu[
    xt: DType, wt: DType, yt: DType, DUAL: Bool
](
    y: WPtr[yt],
    x: RPtr[xt],
    w0a: RPtr[wt],
    sa: RPtr[_F32],
    ua: RPtr[_F32],
    ta: RPtr[_F32],
    ra: Int,
    w0b: RPtr[wt],
    sb: RPtr[_F32],
    ub: RPtr[_F32],
    tb: RPtr[_F32],
    rb: Int,
    m_rows: Int,
    n_rows: Int,
    k: Int,
    ctx: DeviceContext,
):
    """y[m, n] = s[n] * dot(x[m], W0[n]) + dot(u[n], t[m]) for every (m, n),
    output rows split into parallel chunks. DUAL: y = gelu_tanh(a) * b of two
    thetas a (gate) and b (up) over the same x."""
    if m_rows == 0 or n_rows == 0:
        return
    # About 64K multiply-adds per chunk (one chunk runs inline, no threads).
    var chunks = max(min(n_rows, m_rows * n_rows * (k + ra + rb) // 65536, 256), 1)

    @always_inline
    def work(
        c: Int,
    ) {
        var y, var x, var w0a, var sa, var ua, var ta, var ra,
        var w0b, var sb, var ub, var tb, var rb, var m_rows, var n_rows, var k, var chunks,
    }:
        var n0 = c * n_rows // chunks
        var n1 = (c + 1) * n_rows // chunks
        for n in range(n0, n1):
            for m in range(m_rows):
                var xm = x.unsafe_offset(m * k)
                var a = sa.unsafe_load(n) * _dot_cpu(xm, w0a.unsafe_offset(n * k), k) + _dot_cpu(
                    ua.unsafe_offset(n * ra), ta.unsafe_offset(m * ra), ra
                )
                comptime if DUAL:
                    var b = sb.unsafe_load(n) * _dot_cpu(xm, w0b.unsafe_offset(n * k), k) + _dot_cpu(
                        ub.unsafe_offset(n * rb), tb.unsafe_offset(m * rb), rb
                    )
                    y.unsafe_store(m * n_rows + n, (gelu_tanh(a) * b).cast[yt]())
                else:
                    y.unsafe_store(m * n_rows + n, a.cast[yt]())

    parallelize(work, chunks)


def generated_linear_cpu[
    xt: DType, wt: DType, yt: DType
](
    y: WPtr[yt],
    x: RPtr[xt],
    w0: RPtr[wt],
    s: RPtr[_F32],
    u: RPtr[_F32],
    v: RPtr[_F32],
    m_rows: Int,
    n_rows: Int,
    k: Int,
    r: Int,
    ctx: DeviceContext,
):
    var t = List[Float32](length=max(m_rows * r, 1), fill=0.0)
    var tp = t.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    lowrank_t_cpu[xt](tp, x, v, m_rows, k, r)
    rows_cpu[xt, wt, yt, False](
        y, x, w0, s, u, tp, r, w0, s, u, tp, r, m_rows, n_rows, k, ctx
    )
    _ = t^


def generated_mlp_cpu[
    xt: DType, wt: DType, yt: DType
](
    y: WPtr[yt],
    x: RPtr[xt],
    gw0: RPtr[wt],
    gs: RPtr[_F32],
    gu: RPtr[_F32],
    gv: RPtr[_F32],
    rg: Int,
    uw0: RPtr[wt],
    us: RPtr[_F32],
    uu: RPtr[_F32],
    uv: RPtr[_F32],
    ru: Int,
    dw0: RPtr[wt],
    ds: RPtr[_F32],
    du: RPtr[_F32],
    dv: RPtr[_F32],
    rd: Int,
    m_rows: Int,
    hidden: Int,
    inter: Int,
    out_features: Int,
    ctx: DeviceContext,
):
    """h[M, I] = gelu_tanh(gate(x)) * up(x) in float32, then y = down(h)."""
    var tg = List[Float32](length=max(m_rows * rg, 1), fill=0.0)
    var tu = List[Float32](length=max(m_rows * ru, 1), fill=0.0)
    var td = List[Float32](length=max(m_rows * rd, 1), fill=0.0)
    var h = List[Float32](length=max(m_rows * inter, 1), fill=0.0)
    var tgp = tg.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var tup = tu.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var tdp = td.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var hp = h.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    lowrank_t_cpu[xt](tgp, x, gv, m_rows, hidden, rg)
    lowrank_t_cpu[xt](tup, x, uv, m_rows, hidden, ru)
    rows_cpu[xt, wt, _F32, True](
        hp, x, gw0, gs, gu, tgp, rg, uw0, us, uu, tup, ru, m_rows, inter, hidden, ctx
    )
    lowrank_t_cpu[_F32](tdp, hp, dv, m_rows, inter, rd)
    rows_cpu[_F32, wt, yt, False](
        y, hp, dw0, ds, du, tdp, rd, dw0, ds, du, tdp, rd, m_rows, out_features, inter, ctx
    )
    _ = tg^
    _ = tu^
    _ = td^
    _ = h^


# ===----------------------------------------------------------------------=== #
# GPU
# ===----------------------------------------------------------------------=== #

comptime _A_THREADS = 256  # t-partial kernel block
comptime _A_MT = 16  # activation rows per t-partial block
comptime _A_UNROLL = 4  # v loads in flight per thread
comptime _A_TRIPS = 2  # loop trips per thread: K slice = UNROLL*TRIPS*(256//r)
comptime _B_WARPS = 8  # output rows per main-kernel block (one per warp)


def _lowrank_partial_kernel[
    xt: DType
](
    part: Pointer[Float32, MutAnyOrigin],
    x: Pointer[Scalar[xt], ImmutAnyOrigin],
    v: Pointer[Float32, ImmutAnyOrigin],
    m_rows: Int64,
    k: Int64,
    r: Int64,
    k_slice: Int64,
    groups: Int64,
):
    """part[(m*r + j) * G + g] = sum over k in slice g of x[m, k] * v[k, j]."""
    var rr = Int(r)
    var kk = Int(k)
    var tid = Int(thread_idx.x)
    var kthreads = _A_THREADS // rr
    var jt = tid % rr
    var kt = tid // rr
    var g = Int(block_idx.x)
    var m0 = Int(block_idx.y) * _A_MT
    var mcount = min(_A_MT, Int(m_rows) - m0)
    var k_begin = g * Int(k_slice)
    var k_end = min(kk, k_begin + Int(k_slice))
    var acc = Array[Float32, _A_MT](fill=0)
    if kt < kthreads:
        var kc = k_begin + kt
        while kc < k_end:
            var vv = Array[Float32, _A_UNROLL](fill=0)
            comptime for q in range(_A_UNROLL):
                var kq = kc + q * kthreads
                if kq < k_end:
                    vv[q] = v.unsafe_load(kq * rr + jt)
            comptime for q in range(_A_UNROLL):
                var kq = kc + q * kthreads
                if kq < k_end:
                    comptime for mt in range(_A_MT):
                        if mt < mcount:
                            acc[mt] += x.unsafe_load((m0 + mt) * kk + kq).cast[_F32]() * vv[q]
            kc += _A_UNROLL * kthreads
    var red = stack_allocation[_A_MT * _A_THREADS, Float32, address_space=AddressSpace.SHARED]()
    comptime for mt in range(_A_MT):
        red.unsafe_store(mt * _A_THREADS + tid, acc[mt])
    barrier()
    var i = tid
    var ng = Int(groups)
    while i < mcount * rr:
        var mt = i // rr
        var j = i % rr
        var s = Float32(0)
        for q in range(kthreads):
            s += red.unsafe_load(mt * _A_THREADS + q * rr + j)
        part.unsafe_store(((m0 + mt) * rr + j) * ng + g, s)
        i += _A_THREADS


def _lowrank_reduce_kernel(
    t: Pointer[Float32, MutAnyOrigin],
    part: Pointer[Float32, ImmutAnyOrigin],
    outputs: Int64,
    groups: Int64,
):
    """t[o] = sum_g part[o * G + g]; one warp per output o = m*r + j."""
    var o = Int(block_idx.x) * 8 + Int(thread_idx.x) // 32
    if o >= Int(outputs):
        return
    var ng = Int(groups)
    var s = Float32(0)
    var g = Int(lane_id())
    while g < ng:
        s += part.unsafe_load(o * ng + g)
        g += 32
    s = warp_sum(s)
    if lane_id() == 0:
        t.unsafe_store(o, s)


def lowrank_t_gpu[
    xt: DType
](
    t: WPtr[_F32],
    x: RPtr[xt],
    v: RPtr[_F32],
    m_rows: Int,
    k: Int,
    r: Int,
    ctx: DeviceContext,
) raises:
    """Enqueues t[M, r] = x @ v (float32) on ctx; nothing when M or r is 0.

    K is split into G slices of about UNROLL*TRIPS*(256//r) values (each
    thread then waits on TRIPS rounds of loads); for large M, when the M
    blocks alone fill the GPU, G shrinks (at most 512 blocks in all), which
    also bounds the partials buffer (G*M*r floats, <= 2 MB)."""
    if m_rows == 0 or r == 0:
        return
    var grid_m = ceildiv(m_rows, _A_MT)
    var groups = ceildiv(k, _A_UNROLL * _A_TRIPS * (_A_THREADS // r))
    groups = max(min(groups, 512 // grid_m), 1)
    var k_slice = max(ceildiv(k, groups), 1)
    if groups == 1:
        ctx.enqueue_function[_lowrank_partial_kernel[xt]](
            t, x, v, Int64(m_rows), Int64(k), Int64(r), Int64(k_slice), Int64(1),
            grid_dim=(1, grid_m),
            block_dim=_A_THREADS,
        )  # fmt: skip
        return
    var part = ctx.enqueue_create_buffer[_F32](groups * m_rows * r)
    var pp = part.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    ctx.enqueue_function[_lowrank_partial_kernel[xt]](
        pp, x, v, Int64(m_rows), Int64(k), Int64(r), Int64(k_slice), Int64(groups),
        grid_dim=(groups, grid_m),
        block_dim=_A_THREADS,
    )  # fmt: skip
    var outputs = m_rows * r
    ctx.enqueue_function[_lowrank_reduce_kernel](
        t, pp, Int64(outputs), Int64(groups),
        grid_dim=ceildiv(outputs, 8),
        block_dim=256,
    )  # fmt: skip
    _ = part^


def _main_kernel[
    xt: DType, wt: DType, yt: DType, MT: Int, VEC: Int, U: Int, DUAL: Bool
](
    y: Pointer[Scalar[yt], MutAnyOrigin],
    x: Pointer[Scalar[xt], ImmutAnyOrigin],
    w0a: Pointer[Scalar[wt], ImmutAnyOrigin],
    sa: Pointer[Float32, ImmutAnyOrigin],
    ua: Pointer[Float32, ImmutAnyOrigin],
    ta: Pointer[Float32, ImmutAnyOrigin],
    ra: Int64,
    w0b: Pointer[Scalar[wt], ImmutAnyOrigin],
    sb: Pointer[Float32, ImmutAnyOrigin],
    ub: Pointer[Float32, ImmutAnyOrigin],
    tb: Pointer[Float32, ImmutAnyOrigin],
    rb: Int64,
    m_rows: Int64,
    n_rows: Int64,
    k: Int64,
):
    """One warp per output row n, activation rows [MT*block_idx.y, +MT).
    Needs K % VEC == 0 (16-byte aligned vector loads of W0 and x rows)."""
    comptime WA = min(VEC * size_of[wt](), 16)
    comptime XA = min(VEC * size_of[xt](), 16)
    comptime NT = 2 if DUAL else 1
    var lane = Int(lane_id())
    var warp = Int(thread_idx.x) // 32
    var m0 = Int(block_idx.y) * MT
    var mcount = min(MT, Int(m_rows) - m0)
    var kk = Int(k)
    var nn = Int(n_rows)
    var ra_ = Int(ra)
    var rb_ = Int(rb)

    # t of this block's activation rows (zero-padded to 64 columns).
    var ts = stack_allocation[NT * MT * 64, Float32, address_space=AddressSpace.SHARED]()
    var i = Int(thread_idx.x)
    while i < MT * 64:
        var mt = i // 64
        var j = i % 64
        var va = Float32(0)
        if mt < mcount and j < ra_:
            va = ta.unsafe_load((m0 + mt) * ra_ + j)
        ts.unsafe_store(i, va)
        comptime if DUAL:
            var vb = Float32(0)
            if mt < mcount and j < rb_:
                vb = tb.unsafe_load((m0 + mt) * rb_ + j)
            ts.unsafe_store(MT * 64 + i, vb)
        i += _B_WARPS * 32
    barrier()

    var n = Int(block_idx.x) * _B_WARPS + warp
    var n_stride = Int(grid_dim.x) * _B_WARPS
    while n < nn:
        var acc_a = Array[Float32, MT](fill=0)
        var acc_b = Array[Float32, MT](fill=0)
        var wrow_a = w0a.unsafe_offset(n * kk)
        var wrow_b = w0b.unsafe_offset(n * kk)
        var kc = lane * VEC
        while kc < kk:
            var wa = Array[SIMD[_F32, VEC], U](fill=SIMD[_F32, VEC](0))
            var wb = Array[SIMD[_F32, VEC], U](fill=SIMD[_F32, VEC](0))
            comptime for q in range(U):
                var kq = kc + q * 32 * VEC
                if kq < kk:
                    wa[q] = wrow_a.unsafe_load[width=VEC, alignment=WA](kq).cast[_F32]()
                    comptime if DUAL:
                        wb[q] = wrow_b.unsafe_load[width=VEC, alignment=WA](kq).cast[_F32]()
            comptime for q in range(U):
                var kq = kc + q * 32 * VEC
                if kq < kk:
                    comptime for mt in range(MT):
                        if mt < mcount:
                            var xv = x.unsafe_load[width=VEC, alignment=XA](
                                (m0 + mt) * kk + kq
                            ).cast[_F32]()
                            acc_a[mt] += (wa[q] * xv).reduce_add()
                            comptime if DUAL:
                                acc_b[mt] += (wb[q] * xv).reduce_add()
            kc += U * 32 * VEC

        var s_a = sa.unsafe_load(n)
        var ua0 = ua.unsafe_load(n * ra_ + lane) if lane < ra_ else Float32(0)
        var ua1 = ua.unsafe_load(n * ra_ + lane + 32) if lane + 32 < ra_ else Float32(0)
        var s_b = Float32(0)
        var ub0 = Float32(0)
        var ub1 = Float32(0)
        comptime if DUAL:
            s_b = sb.unsafe_load(n)
            ub0 = ub.unsafe_load(n * rb_ + lane) if lane < rb_ else Float32(0)
            ub1 = ub.unsafe_load(n * rb_ + lane + 32) if lane + 32 < rb_ else Float32(0)
        comptime for mt in range(MT):
            if mt < mcount:
                var pa = acc_a[mt] * s_a + ua0 * ts.unsafe_load(mt * 64 + lane) + ua1 * ts.unsafe_load(
                    mt * 64 + lane + 32
                )
                var out = warp_sum(pa)
                comptime if DUAL:
                    var pb = acc_b[mt] * s_b + ub0 * ts.unsafe_load(
                        (MT + mt) * 64 + lane
                    ) + ub1 * ts.unsafe_load((MT + mt) * 64 + lane + 32)
                    out = gelu_tanh(out) * warp_sum(pb)
                if lane == 0:
                    y.unsafe_store((m0 + mt) * nn + n, out.cast[yt]())
        n += n_stride


def _launch_main_mt[
    xt: DType, wt: DType, yt: DType, MT: Int, VEC: Int, DUAL: Bool
](
    y: WPtr[yt],
    x: RPtr[xt],
    w0a: RPtr[wt],
    sa: RPtr[_F32],
    ua: RPtr[_F32],
    ta: RPtr[_F32],
    ra: Int,
    w0b: RPtr[wt],
    sb: RPtr[_F32],
    ub: RPtr[_F32],
    tb: RPtr[_F32],
    rb: Int,
    m_rows: Int,
    n_rows: Int,
    k: Int,
    ctx: DeviceContext,
) raises:
    # Vectors in flight per lane: fewer for more activation rows / two thetas
    # (each W0 vector meets MT x vectors; keeps registers from spilling).
    comptime U0 = 4 if MT == 1 else 2
    comptime U = max(U0 // 2, 1) if DUAL else U0
    ctx.enqueue_function[_main_kernel[xt, wt, yt, MT, VEC, U, DUAL]](
        y, x, w0a, sa, ua, ta, Int64(ra), w0b, sb, ub, tb, Int64(rb),
        Int64(m_rows), Int64(n_rows), Int64(k),
        grid_dim=(ceildiv(n_rows, _B_WARPS), ceildiv(m_rows, MT)),
        block_dim=_B_WARPS * 32,
    )  # fmt: skip


def _launch_main_vec[
    xt: DType, wt: DType, yt: DType, VEC: Int, DUAL: Bool
](
    y: WPtr[yt],
    x: RPtr[xt],
    w0a: RPtr[wt],
    sa: RPtr[_F32],
    ua: RPtr[_F32],
    ta: RPtr[_F32],
    ra: Int,
    w0b: RPtr[wt],
    sb: RPtr[_F32],
    ub: RPtr[_F32],
    tb: RPtr[_F32],
    rb: Int,
    m_rows: Int,
    n_rows: Int,
    k: Int,
    ctx: DeviceContext,
) raises:
    if m_rows == 1:
        _launch_main_mt[xt, wt, yt, 1, VEC, DUAL](
            y, x, w0a, sa, ua, ta, ra, w0b, sb, ub, tb, rb, m_rows, n_rows, k, ctx
        )
    elif m_rows <= 4:
        _launch_main_mt[xt, wt, yt, 4, VEC, DUAL](
            y, x, w0a, sa, ua, ta, ra, w0b, sb, ub, tb, rb, m_rows, n_rows, k, ctx
        )
    else:
        _launch_main_mt[xt, wt, yt, 16, VEC, DUAL](
            y, x, w0a, sa, ua, ta, ra, w0b, sb, ub, tb, rb, m_rows, n_rows, k, ctx
        )


def launch_main_gpu[
    xt: DType, wt: DType, yt: DType, DUAL: Bool
](
    y: WPtr[yt],
    x: RPtr[xt],
    w0a: RPtr[wt],
    sa: RPtr[_F32],
    ua: RPtr[_F32],
    ta: RPtr[_F32],
    ra: Int,
    w0b: RPtr[wt],
    sb: RPtr[_F32],
    ub: RPtr[_F32],
    tb: RPtr[_F32],
    rb: Int,
    m_rows: Int,
    n_rows: Int,
    k: Int,
    ctx: DeviceContext,
) raises:
    """16-byte vectors of W0 (and the matching x) when every row starts
    16-byte aligned (K % (16 / sizeof(W0 dtype)) == 0, aligned base
    pointers), else scalar loads."""
    if m_rows == 0 or n_rows == 0:
        return
    comptime VW = 16 // size_of[wt]()
    var aligned = Int(x) % 16 == 0 and Int(w0a) % 16 == 0 and Int(w0b) % 16 == 0
    if k % VW == 0 and aligned:
        _launch_main_vec[xt, wt, yt, VW, DUAL](
            y, x, w0a, sa, ua, ta, ra, w0b, sb, ub, tb, rb, m_rows, n_rows, k, ctx
        )
    else:
        _launch_main_vec[xt, wt, yt, 1, DUAL](
            y, x, w0a, sa, ua, ta, ra, w0b, sb, ub, tb, rb, m_rows, n_rows, k, ctx
        )


def generated_linear_gpu[
    xt: DType, wt: DType, yt: DType
](
    y: WPtr[yt],
    x: RPtr[xt],
    w0: RPtr[wt],
    s: RPtr[_F32],
    u: RPtr[_F32],
    v: RPtr[_F32],
    m_rows: Int,
    n_rows: Int,
    k: Int,
    r: Int,
    ctx: DeviceContext,
) raises:
    """t = x @ v (1-2 launches, none when r == 0), then the main kernel."""
    if m_rows == 0 or n_rows == 0:
        return
    var t = ctx.enqueue_create_buffer[_F32](max(m_rows * r, 1))
    var tp = t.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    lowrank_t_gpu[xt](tp, x, v, m_rows, k, r, ctx)
    launch_main_gpu[xt, wt, yt, False](
        y, x, w0, s, u, tp, r, w0, s, u, tp, r, m_rows, n_rows, k, ctx
    )
    _ = t^


def generated_mlp_gpu[
    xt: DType, wt: DType, yt: DType
](
    y: WPtr[yt],
    x: RPtr[xt],
    gw0: RPtr[wt],
    gs: RPtr[_F32],
    gu: RPtr[_F32],
    gv: RPtr[_F32],
    rg: Int,
    uw0: RPtr[wt],
    us: RPtr[_F32],
    uu: RPtr[_F32],
    uv: RPtr[_F32],
    ru: Int,
    dw0: RPtr[wt],
    ds: RPtr[_F32],
    du: RPtr[_F32],
    dv: RPtr[_F32],
    rd: Int,
    m_rows: Int,
    hidden: Int,
    inter: Int,
    out_features: Int,
    ctx: DeviceContext,
) raises:
    """Up to 8 launches on one stream: t_gate and t_up (x @ v, 1-2 launches
    each), the DUAL main kernel writing h = gelu_tanh(gate) * up as float32
    [M, I] into a scratch buffer, t_down = h @ v_down, and the main kernel
    for down reading h (float32 activations, W0 in the model dtype)."""
    if m_rows == 0 or out_features == 0:
        return
    var tg = ctx.enqueue_create_buffer[_F32](max(m_rows * rg, 1))
    var tu = ctx.enqueue_create_buffer[_F32](max(m_rows * ru, 1))
    var td = ctx.enqueue_create_buffer[_F32](max(m_rows * rd, 1))
    var h = ctx.enqueue_create_buffer[_F32](max(m_rows * inter, 1))
    var tgp = tg.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var tup = tu.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var tdp = td.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var hp = h.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    lowrank_t_gpu[xt](tgp, x, gv, m_rows, hidden, rg, ctx)
    lowrank_t_gpu[xt](tup, x, uv, m_rows, hidden, ru, ctx)
    launch_main_gpu[xt, wt, _F32, True](
        hp, x, gw0, gs, gu, tgp, rg, uw0, us, uu, tup, ru, m_rows, inter, hidden, ctx
    )
    lowrank_t_gpu[_F32](tdp, hp, dv, m_rows, inter, rd, ctx)
    launch_main_gpu[_F32, wt, yt, False](
        y, hp, dw0, ds, du, tdp, rd, dw0, ds, du, tdp, rd, m_rows, out_features, inter, ctx
    )
    _ = tg^
    _ = tu^
    _ = td^
    _ = h^
