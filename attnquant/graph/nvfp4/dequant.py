"""``graph-dequant``: NVFP4 with stock MAX ops only, the portable path.

The packed weights stay packed in device memory; every forward pass decodes
them with two table lookups (a packed byte -> its two E2M1 values, a scale
byte -> its E4M3 value) and feeds the result to an ordinary matmul. It runs on
any device MAX runs on, which makes it the last resort; it is not fast: the
decoded weight is materialized each step.

Scales travel as uint8 bits, not float8: MAX has no float8_e4m3fn on CPU.
"""

from __future__ import annotations

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor

from attnquant.formats import nvfp4
from attnquant.graph import matmul
from attnquant.graph.nvfp4.base import NVFP4Backend, NVFP4LayerConfig, common_refusal


def dequantize_weight(packed: Tensor, scale_bits: Tensor, global_scale: Tensor, dtype: DType) -> Tensor:
    """Decodes ModelOpt NVFP4 ``[N, K/2]`` bytes to a ``[N, K]`` weight."""
    n, half_k = int(packed.shape[0]), int(packed.shape[1])
    k = 2 * half_k
    block = nvfp4.BLOCK_SIZE
    if int(scale_bits.shape[1]) * block != k:
        raise ValueError(
            f"NVFP4 scale shape {list(scale_bits.shape)} does not match packed "
            f"shape {[n, half_k]}: expected [{n}, {k // block}]"
        )
    device = packed.device
    pair_table = F.constant(nvfp4.packed_byte_decode_table().numpy(), device=device)
    scale_table = F.constant(nvfp4.e4m3_decode_table().numpy(), device=device)
    # gather wants integer indices wider than a byte.
    values = F.gather(pair_table, F.cast(packed, DType.int32), axis=0)
    scales = F.gather(scale_table, F.cast(scale_bits, DType.int32), axis=0)
    blocks = F.reshape(values, [n, k // block, block]) * F.unsqueeze(scales, -1)
    weight = F.reshape(blocks, [n, k]) * F.cast(global_scale, DType.float32)
    return F.cast(weight, dtype)


class GraphDequantBackend(NVFP4Backend):
    name = "graph-dequant"

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        if (why := common_refusal(cls, config)) is not None:
            return False, why
        return True, "stock MAX ops (decode tables + matmul)"

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        weight = dequantize_weight(packed, scale_bits, global_scale, x.dtype)
        return matmul.linear(x, weight, config.padding)
