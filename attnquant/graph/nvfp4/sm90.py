"""``mojo-sm90``: the tensor-core GEMV over weights re-laid out at load.

``mma.sync`` bf16 with float32 accumulation on NVIDIA sm_80+ (built for and
measured on sm_90: Hopper has no FP4 tensor cores, so the E2M1 codes are
decoded to bf16 in registers). M <= ``GEMV_MAX_M`` runs the GEMV; larger M
(prefill) dequantizes to bf16 once per call and uses MAX's matmul. The
kernel and its layout: docs/dev/kernels.md.
"""

from __future__ import annotations

import torch
from max.dtype import DType
from max.experimental.tensor import Tensor

from attnquant.graph.nvfp4.base import (
    GEMV_MAX_M,
    NVFP4Backend,
    NVFP4LayerConfig,
    WeightLayout,
    common_refusal,
    gemv_or_dequant_matmul,
)
from kernels.sm90_layout import prepare_weights


class MojoSM90Backend(NVFP4Backend):
    name = "mojo-sm90"
    layout = WeightLayout.SM90

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        if (why := common_refusal(cls, config)) is not None:
            return False, why
        if config.device_api != "cuda":
            return False, f"needs an NVIDIA GPU, device is {config.device_api}"
        if config.cuda_capability < 80:
            return False, f"needs mma.sync bf16 (sm_80+), device is {config.device_arch}"
        if config.act_dtype != DType.bfloat16:
            return False, f"needs bf16 activations, got {config.act_dtype}"
        return True, f"tensor-core GEMV for M<={GEMV_MAX_M} on {config.device_arch}"

    @classmethod
    def prepare_weights(cls, packed: torch.Tensor, scale_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return prepare_weights(packed, scale_bits)

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        return gemv_or_dequant_matmul(
            x, [packed, scale_bits, global_scale], config,
            gemv_op="attnquant.nvfp4_gemv_sm90", dequant_op="attnquant.nvfp4_dequant_sm90",
            weight_dtype=DType.bfloat16,
        )  # fmt: skip
