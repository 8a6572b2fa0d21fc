# Instantiates every attnquant op's GPU path (execute["gpu"]) so that it
# type-checks and compiles for sm_90a here, without a GPU or MAX's graph
# compiler (which would only compile it on the device). Never run.
#   mojo build -I kernels --target-accelerator sm_90a --emit asm -o /tmp/h.s \
#       bench/checks/nvfp4_ops_gpu_harness.mojo
# Every variant of attnquant.nvfp4_gemv_sm90 (-1, 0-8) and every cluster
# split (1, 2, 4) of the split-K variants is instantiated, and the gated form
# of variants 0, 1, 2, 3 and 5: tests/test_nvfp4_kernel.py
# checks the PTX (and assembles it with ptxas where one is installed).
from max.gpu.host import DeviceContext
from extensibility import InputTensor, OutputTensor
from extensibility import ManagedTensorSlice, StaticTensorSpec
from std.utils.index import IndexList
from attnquant_ops import NVFP4GemvSM90, NVFP4DequantSM90, NVFP4Matmul, NVFP4Dequant

def main() raises:
    with DeviceContext() as ctx:
        var yb = ctx.enqueue_create_buffer[DType.bfloat16](1024)
        var xb = ctx.enqueue_create_buffer[DType.bfloat16](1024)
        var cb = ctx.enqueue_create_buffer[DType.uint8](1024)
        var sb = ctx.enqueue_create_buffer[DType.uint8](1024)
        var gb = ctx.enqueue_create_buffer[DType.float32](1)
        var y = OutputTensor[static_spec=StaticTensorSpec[DType.bfloat16, 2].get_unknown()](yb.unsafe_ptr(), IndexList[2](1, 16))
        var x = InputTensor[static_spec=StaticTensorSpec[DType.bfloat16, 2].get_unknown()](xb.unsafe_ptr(), IndexList[2](1, 64))
        var c = InputTensor[static_spec=StaticTensorSpec[DType.uint8, 2].get_unknown()](cb.unsafe_ptr(), IndexList[2](16, 32))
        var s = InputTensor[static_spec=StaticTensorSpec[DType.uint8, 2].get_unknown()](sb.unsafe_ptr(), IndexList[2](16, 4))
        var g = InputTensor[static_spec=StaticTensorSpec[DType.float32, 1].get_unknown()](gb.unsafe_ptr(), IndexList[1](1))
        NVFP4GemvSM90.execute["gpu"](y, x, c, s, g, ctx)
        comptime for v in range(9):
            NVFP4GemvSM90.execute["gpu", v](y, x, c, s, g, ctx)
        comptime for v in range(3, 9):
            NVFP4GemvSM90.execute["gpu", v, 4, 2](y, x, c, s, g, ctx)
        NVFP4GemvSM90.execute["gpu", 3, 4, 2, True](y, x, c, s, g, ctx)
        # A measured pair: one kernel for M <= 8, another above (no new kernels).
        NVFP4GemvSM90.execute["gpu", 0, 10, 1, False, 2, 16](y, x, c, s, g, ctx)
        NVFP4GemvSM90.execute["gpu", 3, 2, 1, False, 1, 0](y, x, c, s, g, ctx)
        # Gated (an MLP's gate|up, gelu_tanh(gate) * up stored): the kernels gate|up shapes run.
        NVFP4GemvSM90.execute["gpu", -1, 0, 0, False, -1, 0, True](y, x, c, s, g, ctx)
        NVFP4GemvSM90.execute["gpu", 0, 0, 0, False, 2, 0, True](y, x, c, s, g, ctx)
        NVFP4GemvSM90.execute["gpu", 3, 2, 1, False, 5, 2, True](y, x, c, s, g, ctx)
        NVFP4DequantSM90.execute["gpu"](y, c, s, g, ctx)
        NVFP4Matmul.execute["gpu"](y, x, c, s, g, ctx)
        NVFP4Dequant.execute["gpu"](y, c, s, g, ctx)
        ctx.synchronize()
