"""``mojo-cpu``: the Mojo CPU kernel on the ModelOpt layout, float32.

It decodes one weight row to float32, then a 16-wide SIMD dot per activation
row (MAX has no bfloat16 on CPU, so CPU models run in float32)."""

from __future__ import annotations

from max.dtype import DType
from max.experimental.tensor import Tensor

from attnquant.graph.nvfp4.base import NVFP4Backend, NVFP4LayerConfig, common_refusal
from attnquant.graph.ops import rowwise_op


class MojoCPUBackend(NVFP4Backend):
    name = "mojo-cpu"

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        if (why := common_refusal(cls, config)) is not None:
            return False, why
        if config.device_api != "cpu":
            return False, f"CPU only, device is {config.device_api}"
        if config.act_dtype != DType.float32:
            return False, f"needs float32 activations (MAX has no CPU bf16), got {config.act_dtype}"
        return True, "Mojo CPU kernel, float32"

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        return rowwise_op("attnquant.nvfp4_matmul", x, [packed, scale_bits, global_scale], config.n)
