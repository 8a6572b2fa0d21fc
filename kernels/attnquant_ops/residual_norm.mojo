# A norm, added to the residual stream, then the next norm, in one kernel:
#
#   residual_out = residual * s + rms_norm(x, gamma1)      (s only when SCALED)
#   normed       = rms_norm(residual_out, gamma2)
#
# where rms_norm(v, g) = cast(v * rsqrt(mean(v^2) + eps) * (offset + g)), in
# float32 and rounded once to the model dtype (MAX's Gemma norms:
# multiply_before_cast). Every intermediate is rounded where MAX's own
# "norm, add, norm" kernel rounds it: the first norm's output, residual * s,
# and their sum, which the second norm reads.
#
# Why a kernel of our own: at decode a row is a few KB, so the time is the
# chain of dependent steps, not bytes. MAX's fused kernel ran as one block of
# 256 threads looping over the row and loading gamma1, the residual and gamma2
# after its reductions (5.2-5.4 us a call on an H100 at 5376 columns, against
# 2.3 us for a one-block elementwise kernel). Here one block holds a whole row
# in registers, VEC values a thread, and issues every global load before the
# first reduction; each reduction is one barrier.
#
# One block per row; threads = ceil(cols / VEC) rounded up to a warp, so
# cols must be a multiple of VEC and at most VEC * MAX_THREADS (the Python
# side checks both and uses MAX's ops otherwise).
#
# PDL (pdl.mojo): launched with programmatic stream serialization, the kernel
# lets the next one start at once and loads the two gammas (weights) before
# waiting on the kernel that wrote x; x and the residual are loaded as data
# that kernel writes (not invariant), so they stay after the wait.

from std.math import ceildiv, rsqrt
from std.memory import stack_allocation

from max.gpu import barrier, block_idx, lane_id, thread_idx
from max.gpu.host import DeviceContext
from max.gpu.memory import AddressSpace
from max.gpu.primitives.warp import sum as warp_sum

from .pdl import pdl_attributes, pdl_launch_dependents, pdl_wait, produced_invariant

comptime VEC = 8
comptime MAX_THREADS = 1024
comptime _WARPS = MAX_THREADS // 32
comptime _F32 = DType.float32

comptime RPtr[dt: DType] = Pointer[Scalar[dt], ImmutAnyOrigin]
comptime WPtr[dt: DType] = Pointer[Scalar[dt], MutAnyOrigin]


@always_inline
def _block_sum(value: Float32, red: Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED], warps: Int) -> Float32:
    """The sum of ``value`` over the block, in every thread: each warp writes
    its sum to ``red``, and after one barrier each warp sums those again
    (no second barrier, no broadcast). ``red`` must not be reused by a later
    call before every warp has read it: callers pass distinct slots."""
    var s = warp_sum(value)
    var lane = Int(lane_id())
    if lane == 0:
        red.unsafe_store(Int(thread_idx.x) // 32, s)
    barrier()
    var part = red.unsafe_load(lane) if lane < warps else Float32(0)
    return warp_sum(part)


def _residual_norm_kernel[
    dt: DType, SCALED: Bool, PDL: Bool = False, PDL_LATE: Bool = False
](
    normed: WPtr[dt],
    residual_out: WPtr[dt],
    x: RPtr[dt],
    residual: RPtr[dt],
    gamma1: RPtr[dt],
    gamma2: RPtr[dt],
    scale: RPtr[dt],
    cols: Int64,
    eps1: Float32,
    eps2: Float32,
    offset1: Float32,
    offset2: Float32,
):
    var n = Int(cols)
    var col = Int(thread_idx.x) * VEC
    var base = Int(block_idx.x) * n + col
    var active = col < n
    var xv = SIMD[_F32, VEC](0)
    var rv = SIMD[dt, VEC](0)
    var g1 = SIMD[_F32, VEC](0)
    var g2 = SIMD[_F32, VEC](0)
    comptime if PDL and not PDL_LATE:
        pdl_launch_dependents()
    if active:  # every load issued before the first reduction waits on any
        g1 = gamma1.unsafe_load[width=VEC, alignment=16](col).cast[_F32]() + offset1
        g2 = gamma2.unsafe_load[width=VEC, alignment=16](col).cast[_F32]() + offset2
    comptime if PDL:
        pdl_wait()
    comptime XINV = produced_invariant[PDL]()  # x and the residual: the previous kernels' outputs
    if active:
        xv = x.unsafe_load[width=VEC, alignment=16, invariant=XINV](base).cast[_F32]()
        rv = residual.unsafe_load[width=VEC, alignment=16, invariant=XINV](base)
    comptime if SCALED:
        rv = rv * scale.unsafe_load(0)
    var warps = ceildiv(ceildiv(n, VEC), 32)
    var red = stack_allocation[2 * _WARPS, Float32, address_space=AddressSpace.SHARED]()
    var inv1 = rsqrt(_block_sum((xv * xv).reduce_add(), red, warps) / Float32(n) + eps1)
    var r = rv + (xv * inv1 * g1).cast[dt]()
    var rf = r.cast[_F32]()
    var inv2 = rsqrt(_block_sum((rf * rf).reduce_add(), red.unsafe_offset(_WARPS), warps) / Float32(n) + eps2)
    if active:
        residual_out.unsafe_store[alignment=16](base, r)
        normed.unsafe_store[alignment=16](base, (rf * inv2 * g2).cast[dt]())
    comptime if PDL_LATE:  # bench harness only: the next kernel starts after the stores
        comptime assert PDL, "PDL_LATE is a form of PDL"
        pdl_launch_dependents()


def residual_norm_gpu[
    dt: DType, SCALED: Bool, PDL: Bool = False
](
    normed: WPtr[dt],
    residual_out: WPtr[dt],
    x: RPtr[dt],
    residual: RPtr[dt],
    gamma1: RPtr[dt],
    gamma2: RPtr[dt],
    scale: RPtr[dt],
    rows: Int,
    cols: Int,
    eps1: Float32,
    eps2: Float32,
    offset1: Float32,
    offset2: Float32,
    ctx: DeviceContext,
) raises:
    """Enqueues the kernel on ctx: one block per row; nothing for no rows."""
    if cols % VEC != 0 or cols > VEC * MAX_THREADS:
        raise Error(t"residual_rms_norm: {cols} columns; the kernel takes a multiple of {VEC} up to {VEC * MAX_THREADS}")
    if rows == 0:
        return
    ctx.enqueue_function[_residual_norm_kernel[dt, SCALED, PDL]](
        normed, residual_out, x, residual, gamma1, gamma2, scale,
        Int64(cols), eps1, eps2, offset1, offset2,
        grid_dim=rows,
        block_dim=ceildiv(ceildiv(cols, VEC), 32) * 32,
        attributes=pdl_attributes[PDL](),
    )  # fmt: skip
