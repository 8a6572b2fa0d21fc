"""``mojo-gpu``: a simple Mojo GPU kernel on the ModelOpt layout (any GPU, any
float dtype; one warp per output element, not tuned). The fallback on GPUs
the faster backends do not take."""

from __future__ import annotations

from max.experimental.tensor import Tensor

from attnquant.graph.nvfp4.base import NVFP4Backend, NVFP4LayerConfig, common_refusal, gemv_or_dequant_matmul


class MojoGenericGPUBackend(NVFP4Backend):
    name = "mojo-gpu"

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        if (why := common_refusal(cls, config)) is not None:
            return False, why
        if config.device_api not in ("cuda", "hip"):
            return False, f"GPU only, device is {config.device_api}"
        return True, "simple Mojo GPU kernel (not tuned)"

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        return gemv_or_dequant_matmul(
            x, [packed, scale_bits, global_scale], config,
            gemv_op="attnquant.nvfp4_matmul", dequant_op="attnquant.nvfp4_dequant",
            weight_dtype=x.dtype,
        )  # fmt: skip
