"""Gemma 3 attention whose q|k|v and o projections are attnquant modules.

It adopts the configuration (rotary tables, QK norms, window, KV params) of
MAX's own ``Gemma3Attention`` and replaces only the projections, so
everything between the two matmuls is MAX's code path unchanged.
"""

from __future__ import annotations

from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.functional_kernels import (
    flash_attention_ragged,
    rope_split_store_ragged,
)
from max.experimental.nn.common_layers.kv_cache import PagedCacheValues
from max.experimental.tensor import Tensor
from max.nn.attention import MHAMaskVariant
from max.pipelines.architectures.gemma3_modulev3.layers.attention import (
    Gemma3Attention,
)

from attnquant.linear import build_projection
from attnquant.runtime_layout import PartPlan

# Plain configuration MAX's attention computes in its constructor.
_ADOPTED = (
    "n_heads", "layer_idx", "is_sliding", "scale", "local_window_size",
    "kv_params", "q_weight_dim", "kv_weight_dim",
)  # fmt: skip


class ProjectedGemma3Attention(Module[..., Tensor]):
    """Gemma 3 attention: fused QKV projection, QK norm, RoPE, flash attention."""

    def __init__(
        self,
        base: Gemma3Attention,
        qkv: tuple[PartPlan, ...],
        o: tuple[PartPlan, ...],
    ) -> None:
        super().__init__()
        for name in _ADOPTED:
            setattr(self, name, getattr(base, name))
        self.rope_global = base.rope_global
        self.rope_local = base.rope_local
        self.q_norm = base.q_norm
        self.k_norm = base.k_norm
        self.qkv_proj = build_projection(qkv)
        self.o_proj = build_projection(o)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, **kwargs
    ) -> Tensor:
        head_dim = self.kv_params.head_dim
        q_dim, kv_dim = self.q_weight_dim, self.kv_weight_dim
        layer_idx = F.constant(self.layer_idx, DType.uint32, device=CPU())

        x_q, x_k, x_v = F.split(self.qkv_proj(x), [q_dim, kv_dim, kv_dim], axis=-1)
        x_q = self.q_norm(x_q.reshape((-1, self.n_heads, head_dim))).reshape((-1, q_dim))
        x_k = self.k_norm(x_k.reshape((-1, kv_dim // head_dim, head_dim))).reshape(
            (-1, kv_dim)
        )
        qkv = F.concat([x_q, x_k, x_v], axis=-1)

        rope = self.rope_local if self.is_sliding else self.rope_global
        xq = rope_split_store_ragged(
            kv_params=self.kv_params,
            qkv=qkv,
            input_row_offsets=kwargs["input_row_offsets"],
            freqs_cis=rope.freqs_cis,
            kv_collection=kv_collection,
            layer_idx=layer_idx,
            n_heads=self.n_heads // kv_collection.n_devices,
            interleaved=rope.interleaved,
        ).rebind_mapping(qkv.mapping)
        xq = xq.reshape((-1, self.n_heads, head_dim))
        attn_out = flash_attention_ragged(
            self.kv_params,
            input=xq,
            kv_collection=kv_collection,
            layer_idx=layer_idx,
            input_row_offsets=kwargs["input_row_offsets"],
            mask_variant=(
                MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK
                if self.is_sliding
                else MHAMaskVariant.CAUSAL_MASK
            ),
            scale=self.scale,
            local_window_size=self.local_window_size,
        ).rebind_mapping(xq.mapping)
        return self.o_proj(attn_out.reshape((-1, self.n_heads * head_dim)))
