"""``max-sm100``: MAX's own NVFP4 block-scaled matmul on Blackwell (sm_100 / sm_103).

MAX 26.7 runs NVFP4 on Blackwell only as **W4A4**: ``max.nn.quant_ops._matmul_float4``
quantizes the bf16 activations to NVFP4 in the graph
(``quantize_dynamic_block_scaled``: E2M1 codes, one E4M3 scale per 16, and a
per-tensor scale ``tensor_sf = 1 / input_scale``), then calls the SM100
tensor-core block-scaled matmul (``dynamic_block_scaled_matmul``,
``mo.matmul.dynamic.block.scaled``, UMMA kind MXF4NVF4). Both operands' block
scales must be in the rank-5 TCGEN layout ``[ceil(rows/128), ceil(K/64), 32, 4, 4]``
(scale of row ``r``, 16-block ``b`` at ``[r//128, b//4, r%32, (r%128)//32, b%4]``,
``set_scale_factor`` in MAX's ``linalg/fp4_utils.mojo``).

So this backend's numerics differ from ``mojo-sm90`` / ``mojo-gpu``
(weight-only, bf16 activations): activations lose precision to E2M1 with
16-element E4M3 block scales. Nothing here has been measured: no Blackwell GPU
has been available. ``tests/test_nvfp4_sm100.py`` compiles a graph using it for a
virtual sm_100a device (MAX's virtual-device mode) and checks the load-time
scale interleave against MAX's formula; that is all.

What the backend does
---------------------
- ``prepare_weights`` (load time, pure torch): the packed codes are used as they
  are (ModelOpt packing, low nibble = even k, is the ``float4_e2m1fnx2`` byte
  order MAX's kernels read); the E4M3 scale bits are interleaved to the TCGEN
  layout once, stored flattened as uint8 ``[N, K/16]`` (N a multiple of 128,
  K of 64 here, so no padding is needed) as ``float8_e4m3fn`` (the same
  bytes; MAX graphs have no bitcast, so ``WeightLayout.SM100.scale_dtype`` is
  float8 and the model declares its scale parameter with it), and re-viewed
  as rank 5 in the graph, the way MAX treats "pre-interleaved" checkpoints.
- ``apply`` (graph time): quantize x to NVFP4 with a **static** per-tensor
  activation scale (MAX's kernel takes ``tensor_sf`` as a host scalar, so a
  per-call amax would need a device-to-host copy in every step); block-scaled
  matmul to bf16; multiply by the weight's global scale in float32 (a device
  tensor in this project, so it is applied after the matmul rather than folded
  into MAX's host-scalar ``tensor_sf``).
  The static activation scale is ``ATTNQUANT_SM100_INPUT_SCALE`` (default
  1.0, i.e. E4M3 block scales cover activation block maxima from ~0.09 to 2688
  as normals); a checkpoint's calibrated ``input_scale`` is the right value.
- ``can_implement``: CUDA sm_100-sm_109 (tcgen05), bf16 activations, N a
  multiple of 128 and K a multiple of 64 (the scale atom; every Gemma 3/4
  projection qualifies); anything else is refused with the reason, and the
  chooser falls through to the next backend.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import TensorValue

from attnquant.graph.nvfp4.base import NVFP4Backend, NVFP4LayerConfig, WeightLayout, common_refusal
from kernels.sm90_layout import BLOCK, check_modelopt_tensors

SF_MN_GROUP = 128  # rows per scale atom group (32 x 4)
SF_ATOM_K = 4  # 16-element blocks per atom along K (64 elements)


def interleave_scales(scale_bits: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/16]`` (row-major E4M3 bits) -> the same bytes in MAX's
    rank-5 TCGEN order ``[N/128, K/64, 32, 4, 4]``, returned flattened as
    ``[N, K/16]``. N must be a multiple of 128 and K/16 of 4 (``can_implement``
    checks); pure torch, on the input's device."""
    n, kb = scale_bits.shape
    if n % SF_MN_GROUP or kb % SF_ATOM_K:
        raise ValueError(f"max-sm100 scales need N % 128 == 0 and K % 64 == 0, got [{n}, {kb}] blocks")
    # row r = 128a + 32b + c, block j = 4d + e  ->  [a, d, c, b, e]
    five = scale_bits.reshape(n // SF_MN_GROUP, 4, 32, kb // SF_ATOM_K, SF_ATOM_K).permute(0, 3, 2, 1, 4)
    return five.contiguous().reshape(n, kb)


def interleaved_index(row: int, block: int, n: int, kb: int) -> int:
    """Flat offset of (row, 16-block) in ``interleave_scales``' output (MAX's
    ``set_scale_factor`` formula, for tests)."""
    idx = (row // SF_MN_GROUP, block // SF_ATOM_K, row % 32, (row % SF_MN_GROUP) // 32, block % SF_ATOM_K)
    dims = (n // SF_MN_GROUP, kb // SF_ATOM_K, 32, 4, SF_ATOM_K)
    off = 0
    for i, d in zip(idx, dims):
        off = off * d + i
    return off


def _sm100_linear(
    x: TensorValue, packed: TensorValue, scales: TensorValue, global_scale: TensorValue, in_scale: float
) -> TensorValue:
    """Graph ops: W4A4 block-scaled matmul (MAX's SM100 kernel), bf16 out."""
    from max.nn.kernels import dynamic_block_scaled_matmul, quantize_dynamic_block_scaled

    n, kb = int(packed.shape[0]), int(scales.shape[1])
    x_fp4, x_scales = quantize_dynamic_block_scaled(
        x,
        tensor_sf=1.0 / in_scale,
        sf_vector_size=BLOCK,
        scales_type=DType.float8_e4m3fn,
        out_type=DType.uint8,
    )
    w_scales = scales.reshape([n // SF_MN_GROUP, kb // SF_ATOM_K, 32, SF_MN_GROUP // 32, SF_ATOM_K])
    y = dynamic_block_scaled_matmul(
        x_fp4, packed, x_scales, w_scales, tensor_sf=in_scale, sf_vector_size=BLOCK, out_type=DType.bfloat16
    )
    gs = global_scale.cast(DType.float32).reshape([1, 1])
    return (y.cast(DType.float32) * gs).cast(DType.bfloat16)


_sm100_linear_f = F.functional(_sm100_linear)


class MaxSM100Backend(NVFP4Backend):
    name: ClassVar[str] = "max-sm100"
    layout: ClassVar[WeightLayout] = WeightLayout.SM100

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        if (why := common_refusal(cls, config)) is not None:
            return False, why
        if config.device_api != "cuda":
            return False, f"needs an NVIDIA GPU, device is {config.device_api}"
        if not 100 <= config.cuda_capability < 110:
            return False, f"needs Blackwell tcgen05 (sm_100-sm_109), device is {config.device_arch or 'unknown'}"
        if config.act_dtype != DType.bfloat16:
            return False, f"needs bf16 activations, got {config.act_dtype}"
        if config.n % SF_MN_GROUP:
            return False, f"N={config.n} is not a multiple of {SF_MN_GROUP} (scale atom rows)"
        if config.k % (BLOCK * SF_ATOM_K):
            return False, f"K={config.k} is not a multiple of {BLOCK * SF_ATOM_K} (scale atom)"
        return True, (
            f"MAX's SM100 NVFP4 block-scaled matmul on {config.device_arch}: W4A4 (activations quantized "
            f"to NVFP4, static input scale {config.sm100_input_scale:g}); compile-checked, not measured"
        )

    @classmethod
    def prepare_weights(
        cls, packed: torch.Tensor, scale_bits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_modelopt_tensors(packed, scale_bits)
        return packed, interleave_scales(scale_bits).view(torch.float8_e4m3fn)

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        return _sm100_linear_f(x, packed, scale_bits, global_scale, config.sm100_input_scale)
