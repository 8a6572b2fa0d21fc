"""``mojo-sm90``: the tensor-core GEMV over weights re-laid out at load.

``mma.sync`` bf16 with float32 accumulation on NVIDIA sm_80+ (built for and
measured on sm_90: Hopper has no FP4 tensor cores, so the E2M1 codes are
decoded to bf16 in registers). M <= ``GEMV_MAX_M`` runs the GEMV; larger M
(prefill) dequantizes to bf16 once per call and uses MAX's matmul. The
kernels, their variants and their layout: docs/dev/kernels.md.

Which GEMV variant a layer runs is chosen once, with the backend
(:meth:`MojoSM90Backend.kernel_parameters`): a measured fast variant from
``SM90_TUNED`` for its shape, or ``ATTNQUANT_SM90_VARIANT`` to force one;
otherwise, and wherever the fast variants cannot run (below sm_90, shapes
that are not whole 16 x 64 tiles, fewer k-groups than the split), the
original kernels, with the reason logged.
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
from kernels.sm90_layout import TILE_K, TILE_N, prepare_weights

SM90_TUNED: dict[tuple[int, int], tuple[int, int, int]] = {}
"""(N, K) -> (variant, kw, splitk) of ``attnquant.nvfp4_gemv_sm90`` for M <= 16:
a variant measured on the H200 (bench/kernel_timing/kernels_h200.py) to be at
least as fast as the original kernels at every M from 1 to 16. None is yet:
none was measured at least as fast at every M (docs/dev/kernels.md)."""
SM90_MAX_VARIANT = 8  # nvfp4_gemv_bulk.mojo: SM90_VARIANTS - 1
_BULK_VARIANTS = (3, 4, 5, 6, 8)  # the bulk-copy rings: the ones with programmatic dependent launch


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
    def kernel_parameters(cls, config: NVFP4LayerConfig) -> tuple[tuple[tuple[str, int], ...], str]:
        """The GEMV variant for this layer (empty: the original kernels) and why."""
        if config.sm90_variant:
            fields = [int(f) for f in config.sm90_variant.split(":")] + [0, 0, 0]
            wanted = {"variant": fields[0], "kw": fields[1], "splitk": fields[2], "pdl": fields[3]}
            source = f"ATTNQUANT_SM90_VARIANT={config.sm90_variant}"
        elif (config.n, config.k) in SM90_TUNED:
            wanted = dict(zip(("variant", "kw", "splitk"), SM90_TUNED[(config.n, config.k)])) | {"pdl": 0}
            source = "the fastest variant measured for this shape"
        else:
            return (), "original kernels (no variant measured faster for this shape)"
        problem = _fast_variant_problem(wanted, config)
        if problem:
            return (), f"{source} not taken: {problem}; original kernels"
        if wanted["variant"] >= 3 and wanted["splitk"] == 0:
            wanted["splitk"] = 1  # 0 lets the op pick a cluster split-K, which faults (above)
        if wanted["pdl"]:
            wanted["pdl"] = True  # the op's parameter is a Bool: an integer does not convert
        else:
            del wanted["pdl"]
        return tuple(wanted.items()), source

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        return gemv_or_dequant_matmul(
            x, [packed, scale_bits, global_scale], config,
            gemv_op="attnquant.nvfp4_gemv_sm90", dequant_op="attnquant.nvfp4_dequant_sm90",
            weight_dtype=DType.bfloat16,
        )  # fmt: skip


def _fast_variant_problem(wanted: dict[str, int], config: NVFP4LayerConfig) -> str | None:
    """Why this layer cannot run the variant asked for, or None."""
    if not -1 <= wanted["variant"] <= SM90_MAX_VARIANT or wanted["splitk"] not in (0, 1, 2, 4) or wanted["kw"] < 0:
        return f"variant -1..{SM90_MAX_VARIANT}, splitk 0/1/2/4 and kw >= 0 are the choices"
    if wanted["splitk"] > 1:
        return "the cluster split-K variants fault on the H200 (illegal instruction; docs/dev/kernels.md)"
    if wanted["pdl"] and wanted["variant"] not in _BULK_VARIANTS:
        return f"programmatic dependent launch needs a bulk-ring variant {_BULK_VARIANTS}"
    if wanted["variant"] < 3:
        return None
    if config.cuda_capability < 90:
        return f"the fast variants need sm_90 (bulk copies, clusters), device is {config.device_arch}"
    if config.n % TILE_N or config.k % TILE_K:
        return f"[{config.n}, {config.k}] is not whole {TILE_N}x{TILE_K} tiles (the fast variants stream whole tiles)"
    return None
