# attnquant custom ops for MAX 26.7 (Mojo 1.2).
#
#   attnquant.nvfp4_matmul        ModelOpt layout, CPU (float32) + generic GPU
#   attnquant.nvfp4_dequant       ModelOpt layout -> dense W[N, K], CPU + GPU
#   attnquant.nvfp4_gemv_sm90     prepared layout, bf16, NVIDIA sm_80+ tensor cores
#                                 (variants 3-8: sm_90 bulk copies / cluster split-K)
#   attnquant.nvfp4_dequant_sm90  prepared layout -> bf16 W[N, K] (large-M route)
#   attnquant.generated_linear    y = s * (x @ W0.T) + (x @ v) @ u.T, CPU + GPU
#   attnquant.generated_mlp       down(gelu_tanh(gate(x)) * up(x)), each a theta
#   attnquant.residual_rms_norm   norm, add to the residual, next norm; NVIDIA GPUs
#
# The Python side: one backend per file in attnquant/graph/nvfp4/ (and the
# chooser in its __init__); the prepared layout is produced at load by
# kernels/sm90_layout.py's prepare_weights().

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from std.memory import bitcast

from .generated_linear import (
    check_theta,
    generated_linear_cpu,
    generated_linear_gpu,
    generated_mlp_cpu,
    generated_mlp_gpu,
)
from .nvfp4_gemv_bulk import nvfp4_gemv_sm90_dispatch
from .residual_norm import residual_norm_gpu
from .nvfp4_matmul import (
    nvfp4_dequant_cpu,
    nvfp4_dequant_generic_gpu,
    nvfp4_dequant_sm90,
    nvfp4_matmul_cpu,
    nvfp4_matmul_generic_gpu,
)


def _check_modelopt(n: Int, k: Int, packed_cols: Int, scale_rows: Int, scale_cols: Int) raises:
    if k % 16 != 0:
        raise Error(t"nvfp4: K={k} must be a multiple of 16 (one E4M3 scale per 16 codes)")
    if packed_cols * 2 != k:
        raise Error(t"nvfp4: packed has {packed_cols} columns, expected K/2={k // 2}")
    if scale_rows != n or scale_cols * 16 != k:
        raise Error(
            t"nvfp4: scale_bits is [{scale_rows}, {scale_cols}], expected [{n}, {k // 16}]"
        )


def _check_prepared(n: Int, k: Int, code_rows: Int, code_cols: Int, scale_rows: Int, scale_cols: Int) raises:
    if k % 16 != 0:
        raise Error(t"nvfp4_sm90: K={k} must be a multiple of 16")
    if code_rows % 16 != 0 or (2 * code_cols) % 64 != 0:
        raise Error(
            t"nvfp4_sm90: prepared codes [{code_rows}, {code_cols}] are not padded to 16 rows x 64 k"
        )
    if code_rows < n or 2 * code_cols < k:
        raise Error(
            t"nvfp4_sm90: prepared codes [{code_rows}, {code_cols}] are smaller than N={n}, K={k}"
        )
    if scale_rows != code_rows or scale_cols * 16 != code_cols * 2:
        raise Error(
            t"nvfp4_sm90: prepared scales [{scale_rows}, {scale_cols}] do not match codes [{code_rows}, {code_cols}]"
        )


@extensibility.register("attnquant.nvfp4_matmul")
struct NVFP4Matmul:
    """y[M, N] = x[M, K] . (E2M1(code) * E4M3(scale) * global_scale)^T, ModelOpt layout."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        packed: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale_bits: InputTensor[dtype=DType.uint8, rank=2, ...],
        global_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var k = x.dim_size(1)
        var n = packed.dim_size(0)
        _check_modelopt(n, k, packed.dim_size(1), scale_bits.dim_size(0), scale_bits.dim_size(1))
        if y.dim_size(0) != m or y.dim_size(1) != n:
            raise Error("nvfp4_matmul: output must be [M, N]")
        comptime if target == "cpu":
            comptime if y.dtype == DType.float32:
                nvfp4_matmul_cpu(
                    y.unsafe_ptr().bitcast[Float32](),
                    x.unsafe_ptr().bitcast[Float32](),
                    packed.unsafe_ptr(),
                    scale_bits.unsafe_ptr(),
                    global_scale.unsafe_ptr().unsafe_load(0),
                    m,
                    n,
                    k,
                )
            else:
                raise Error("nvfp4_matmul: the CPU kernel takes float32 activations")
        else:
            nvfp4_matmul_generic_gpu[y.dtype](
                y.unsafe_ptr(),
                x.unsafe_ptr(),
                packed.unsafe_ptr(),
                scale_bits.unsafe_ptr(),
                global_scale.unsafe_ptr(),
                m,
                n,
                k,
                ctx,
            )


@extensibility.register("attnquant.nvfp4_dequant")
struct NVFP4Dequant:
    """W[N, K] = E2M1(code) * E4M3(scale) * global_scale, ModelOpt layout."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        w: OutputTensor[rank=2, ...],
        packed: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale_bits: InputTensor[dtype=DType.uint8, rank=2, ...],
        global_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var n = w.dim_size(0)
        var k = w.dim_size(1)
        if packed.dim_size(0) != n:
            raise Error("nvfp4_dequant: output rows must equal packed rows")
        _check_modelopt(n, k, packed.dim_size(1), scale_bits.dim_size(0), scale_bits.dim_size(1))
        comptime if target == "cpu":
            comptime if w.dtype == DType.float32:
                nvfp4_dequant_cpu(
                    w.unsafe_ptr().bitcast[Float32](),
                    packed.unsafe_ptr(),
                    scale_bits.unsafe_ptr(),
                    global_scale.unsafe_ptr().unsafe_load(0),
                    n,
                    k,
                )
            else:
                raise Error("nvfp4_dequant: the CPU kernel writes float32")
        else:
            nvfp4_dequant_generic_gpu[w.dtype](
                w.unsafe_ptr(),
                packed.unsafe_ptr(),
                scale_bits.unsafe_ptr(),
                global_scale.unsafe_ptr(),
                n,
                k,
                ctx,
            )


@extensibility.register("attnquant.nvfp4_gemv_sm90")
struct NVFP4GemvSM90:
    """Tensor-core NVFP4 GEMV on the prepared layout; fast for M <= 16, correct
    for any M (activation rows are processed in chunks of 8 or 16).

    Parameters: variant (-1 = pick from M; 0-8 force one kernel, see
    nvfp4_gemv_bulk.mojo; each graph compiles only the kernels its variant can
    launch), kw (0 = pick warps along K), splitk (variants 3-8: blocks of one
    cluster along K, 1/2/4; 0 = pick), pdl (variants 0, 2, 3-6, 8, and -1 up
    to 8 rows: programmatic dependent launch, see pdl.mojo),
    wide_variant and wide_kw (for M > 8: a kernel measured faster there than
    the one `variant` names for M <= 8; -1 = as `variant` and `kw`), gated
    (the weight is an MLP's gate|up with rows interleaved in blocks of 8
    by kernels/sm90_layout.py's interleave_gate_up: y[M, N/2] is
    gelu_tanh(gate) * up, computed in the kernel's epilogue)."""

    @staticmethod
    def execute[
        target: StaticString,
        variant: Int = -1,
        kw: Int = 0,
        splitk: Int = 0,
        pdl: Bool = False,
        wide_variant: Int = -1,
        wide_kw: Int = 0,
        gated: Bool = False,
    ](
        y: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        x: InputTensor[dtype=DType.bfloat16, rank=2, ...],
        codes: InputTensor[dtype=DType.uint8, rank=2, ...],
        scales: InputTensor[dtype=DType.uint8, rank=2, ...],
        global_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var k = x.dim_size(1)
        var n = y.dim_size(1) * (2 if gated else 1)  # weight rows
        if y.dim_size(0) != m:
            raise Error("nvfp4_gemv_sm90: output must be [M, N] ([M, N/2] gated)")
        _check_prepared(
            n, k, codes.dim_size(0), codes.dim_size(1), scales.dim_size(0), scales.dim_size(1)
        )
        comptime if target == "cpu":
            raise Error("nvfp4_gemv_sm90 runs on NVIDIA GPUs only")
        else:

            @parameter
            def run[v: Int](kw_: Int) raises:
                nvfp4_gemv_sm90_dispatch[v, pdl, gated](
                    y.unsafe_ptr(),
                    x.unsafe_ptr(),
                    codes.unsafe_ptr(),
                    scales.unsafe_ptr(),
                    global_scale.unsafe_ptr(),
                    m,
                    y.dim_size(1),
                    k,
                    codes.dim_size(0) // 16,
                    codes.dim_size(1) // 32,
                    kw_,
                    splitk,
                    ctx,
                )

            comptime if wide_variant < 0:
                run[variant](kw)
            else:
                if m <= 8:
                    run[variant](kw)
                else:
                    run[wide_variant](wide_kw)


@extensibility.register("attnquant.nvfp4_dequant_sm90")
struct NVFP4DequantSM90:
    """Prepared layout -> bf16 W[N, K] (N, K from the output type)."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        w: OutputTensor[dtype=DType.bfloat16, rank=2, ...],
        codes: InputTensor[dtype=DType.uint8, rank=2, ...],
        scales: InputTensor[dtype=DType.uint8, rank=2, ...],
        global_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var n = w.dim_size(0)
        var k = w.dim_size(1)
        _check_prepared(
            n, k, codes.dim_size(0), codes.dim_size(1), scales.dim_size(0), scales.dim_size(1)
        )
        comptime if target == "cpu":
            raise Error("nvfp4_dequant_sm90 runs on NVIDIA GPUs only")
        else:
            nvfp4_dequant_sm90(
                w.unsafe_ptr(),
                codes.unsafe_ptr(),
                scales.unsafe_ptr(),
                global_scale.unsafe_ptr(),
                n,
                k,
                codes.dim_size(0) // 16,
                codes.dim_size(1) // 32,
                ctx,
            )


@extensibility.register("attnquant.generated_linear")
struct GeneratedLinear:
    """y[M, N] = s * (x @ W0.T) + (x @ v) @ u.T in float32, output in x's dtype.

    x [M, K] and W0 [N, K] in the model dtype; s [N], u [N, r], v [K, r]
    float32; 0 <= r <= 64 (see generated_linear.mojo)."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        w0: InputTensor[dtype=y.dtype, rank=2, ...],
        scale: InputTensor[dtype=DType.float32, rank=1, ...],
        u: InputTensor[dtype=DType.float32, rank=2, ...],
        v: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var k = x.dim_size(1)
        var n = w0.dim_size(0)
        var r = u.dim_size(1)
        check_theta(
            "generated_linear", n, k, w0.dim_size(0), w0.dim_size(1), scale.dim_size(0),
            u.dim_size(0), r, v.dim_size(0), v.dim_size(1),
        )  # fmt: skip
        if y.dim_size(0) != m or y.dim_size(1) != n:
            raise Error(
                t"generated_linear: output is [{y.dim_size(0)}, {y.dim_size(1)}], expected [M={m}, N={n}]"
            )
        comptime if target == "cpu":
            generated_linear_cpu[y.dtype, y.dtype, y.dtype](
                y.unsafe_ptr(), x.unsafe_ptr(), w0.unsafe_ptr(), scale.unsafe_ptr(),
                u.unsafe_ptr(), v.unsafe_ptr(), m, n, k, r, ctx,
            )  # fmt: skip
        else:
            generated_linear_gpu[y.dtype, y.dtype, y.dtype](
                y.unsafe_ptr(), x.unsafe_ptr(), w0.unsafe_ptr(), scale.unsafe_ptr(),
                u.unsafe_ptr(), v.unsafe_ptr(), m, n, k, r, ctx,
            )  # fmt: skip


@extensibility.register("attnquant.generated_mlp")
struct GeneratedMLP:
    """y[M, H'] = down(gelu_tanh(gate(x)) * up(x)), each projection a theta
    (w0, s, u, v) as in attnquant.generated_linear: gate and up [I, H],
    down [H', I]. The intermediate h [M, I] is float32."""

    @staticmethod
    def execute[
        target: StaticString
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        gate_w0: InputTensor[dtype=y.dtype, rank=2, ...],
        gate_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        gate_u: InputTensor[dtype=DType.float32, rank=2, ...],
        gate_v: InputTensor[dtype=DType.float32, rank=2, ...],
        up_w0: InputTensor[dtype=y.dtype, rank=2, ...],
        up_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        up_u: InputTensor[dtype=DType.float32, rank=2, ...],
        up_v: InputTensor[dtype=DType.float32, rank=2, ...],
        down_w0: InputTensor[dtype=y.dtype, rank=2, ...],
        down_scale: InputTensor[dtype=DType.float32, rank=1, ...],
        down_u: InputTensor[dtype=DType.float32, rank=2, ...],
        down_v: InputTensor[dtype=DType.float32, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var hidden = x.dim_size(1)
        var inter = gate_w0.dim_size(0)
        var n_out = down_w0.dim_size(0)
        var rg = gate_u.dim_size(1)
        var ru = up_u.dim_size(1)
        var rd = down_u.dim_size(1)
        check_theta(
            "generated_mlp gate", inter, hidden, gate_w0.dim_size(0), gate_w0.dim_size(1),
            gate_scale.dim_size(0), gate_u.dim_size(0), rg, gate_v.dim_size(0), gate_v.dim_size(1),
        )  # fmt: skip
        check_theta(
            "generated_mlp up", inter, hidden, up_w0.dim_size(0), up_w0.dim_size(1),
            up_scale.dim_size(0), up_u.dim_size(0), ru, up_v.dim_size(0), up_v.dim_size(1),
        )  # fmt: skip
        check_theta(
            "generated_mlp down", n_out, inter, down_w0.dim_size(0), down_w0.dim_size(1),
            down_scale.dim_size(0), down_u.dim_size(0), rd, down_v.dim_size(0), down_v.dim_size(1),
        )  # fmt: skip
        if y.dim_size(0) != m or y.dim_size(1) != n_out:
            raise Error(
                t"generated_mlp: output is [{y.dim_size(0)}, {y.dim_size(1)}], expected [M={m}, N={n_out}]"
            )
        comptime if target == "cpu":
            generated_mlp_cpu[y.dtype, y.dtype, y.dtype](
                y.unsafe_ptr(), x.unsafe_ptr(),
                gate_w0.unsafe_ptr(), gate_scale.unsafe_ptr(), gate_u.unsafe_ptr(), gate_v.unsafe_ptr(), rg,
                up_w0.unsafe_ptr(), up_scale.unsafe_ptr(), up_u.unsafe_ptr(), up_v.unsafe_ptr(), ru,
                down_w0.unsafe_ptr(), down_scale.unsafe_ptr(), down_u.unsafe_ptr(), down_v.unsafe_ptr(), rd,
                m, hidden, inter, n_out, ctx,
            )  # fmt: skip
        else:
            generated_mlp_gpu[y.dtype, y.dtype, y.dtype](
                y.unsafe_ptr(), x.unsafe_ptr(),
                gate_w0.unsafe_ptr(), gate_scale.unsafe_ptr(), gate_u.unsafe_ptr(), gate_v.unsafe_ptr(), rg,
                up_w0.unsafe_ptr(), up_scale.unsafe_ptr(), up_u.unsafe_ptr(), up_v.unsafe_ptr(), ru,
                down_w0.unsafe_ptr(), down_scale.unsafe_ptr(), down_u.unsafe_ptr(), down_v.unsafe_ptr(), rd,
                m, hidden, inter, n_out, ctx,
            )  # fmt: skip


@extensibility.register("attnquant.residual_rms_norm")
struct ResidualRMSNorm:
    """residual_out = residual * scale[0] (scaled) + norm(x, gamma1); normed =
    norm(residual_out, gamma2); norm(v, g) = v / rms(v) * (offset + g), each
    rounded to the model dtype as MAX's Gemma norms round it (see
    residual_norm.mojo). Rows [M, H], H a multiple of 8 up to 8192.

    Parameters: scaled (multiply the residual by scale[0]; otherwise scale is
    not read), eps1_bits, eps2_bits, offset1_bits, offset2_bits (each norm's
    epsilon and weight offset, as the bits of a float32), pdl (launch with
    programmatic stream serialization, see pdl.mojo)."""

    @staticmethod
    def execute[
        target: StaticString,
        scaled: Bool = False,
        eps1_bits: Int = 0,
        eps2_bits: Int = 0,
        offset1_bits: Int = 0,
        offset2_bits: Int = 0,
        pdl: Bool = False,
    ](
        normed: OutputTensor[rank=2, ...],
        residual_out: OutputTensor[dtype=normed.dtype, rank=2, ...],
        x: InputTensor[dtype=normed.dtype, rank=2, ...],
        residual: InputTensor[dtype=normed.dtype, rank=2, ...],
        gamma1: InputTensor[dtype=normed.dtype, rank=1, ...],
        gamma2: InputTensor[dtype=normed.dtype, rank=1, ...],
        scale: InputTensor[dtype=normed.dtype, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        var m = x.dim_size(0)
        var h = x.dim_size(1)
        if residual.dim_size(0) != m or residual.dim_size(1) != h:
            raise Error(t"residual_rms_norm: residual is [{residual.dim_size(0)}, {residual.dim_size(1)}], x [{m}, {h}]")
        if gamma1.dim_size(0) != h or gamma2.dim_size(0) != h:
            raise Error(t"residual_rms_norm: gammas have {gamma1.dim_size(0)} and {gamma2.dim_size(0)} values, rows {h}")
        comptime if target == "cpu":
            raise Error("residual_rms_norm runs on NVIDIA GPUs only")
        else:
            residual_norm_gpu[normed.dtype, scaled, pdl](
                normed.unsafe_ptr(), residual_out.unsafe_ptr(), x.unsafe_ptr(), residual.unsafe_ptr(),
                gamma1.unsafe_ptr(), gamma2.unsafe_ptr(), scale.unsafe_ptr(), m, h,
                bitcast[DType.float32](Int32(eps1_bits)), bitcast[DType.float32](Int32(eps2_bits)),
                bitcast[DType.float32](Int32(offset1_bits)), bitcast[DType.float32](Int32(offset2_bits)),
                ctx,
            )  # fmt: skip
