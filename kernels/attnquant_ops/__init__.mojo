# attnquant custom ops for MAX 26.7 (Mojo 1.2).
#
#   attnquant.nvfp4_matmul        ModelOpt layout, CPU (float32) + generic GPU
#   attnquant.nvfp4_dequant       ModelOpt layout -> dense W[N, K], CPU + GPU
#   attnquant.nvfp4_gemv_sm90     prepared layout, bf16, NVIDIA sm_80+ tensor cores
#   attnquant.nvfp4_dequant_sm90  prepared layout -> bf16 W[N, K] (large-M route)
#
# Python wrappers and the backend chooser live in attnquant/kernels.py; the
# prepared layout is produced there by prepare_weights().

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .nvfp4_matmul import (
    nvfp4_dequant_cpu,
    nvfp4_dequant_generic_gpu,
    nvfp4_dequant_sm90,
    nvfp4_gemv_sm90,
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

    Parameters: variant (-1 = pick from M), kw (0 = pick warps along K)."""

    @staticmethod
    def execute[
        target: StaticString, variant: Int = -1, kw: Int = 0
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
        var n = y.dim_size(1)
        if y.dim_size(0) != m:
            raise Error("nvfp4_gemv_sm90: output must be [M, N]")
        _check_prepared(
            n, k, codes.dim_size(0), codes.dim_size(1), scales.dim_size(0), scales.dim_size(1)
        )
        comptime if target == "cpu":
            raise Error("nvfp4_gemv_sm90 runs on NVIDIA GPUs only")
        else:
            nvfp4_gemv_sm90(
                y.unsafe_ptr(),
                x.unsafe_ptr(),
                codes.unsafe_ptr(),
                scales.unsafe_ptr(),
                global_scale.unsafe_ptr(),
                m,
                n,
                k,
                codes.dim_size(0) // 16,
                codes.dim_size(1) // 32,
                variant,
                kw,
                ctx,
            )


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
