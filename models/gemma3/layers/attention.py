"""Gemma 3 attention whose q|k|v and o projections are attnquant modules.

It adopts the configuration (rotary tables, QK norms, window, KV params) of
MAX's own ``Gemma3Attention`` and replaces only the projections, so
everything between the two matmuls is MAX's code path unchanged, but for the
scale: transformers' ``query_pre_attn_scalar ** -0.5``, which MAX 26.7
ignores (``attnquant.max_compat.gemma3_attention_scale``).
"""

from __future__ import annotations

from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.kv_cache import PagedCacheValues
from max.experimental.tensor import Tensor
from max.pipelines.architectures.gemma3_modulev3.layers.attention import (
    Gemma3Attention,
)

from attnquant.graph.projections import build_projection
from attnquant.plan import PartPlan

from ...common.attention import LayerValues, layer_values, per_head, rope_store_attend

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
        scale: float,
    ) -> None:
        super().__init__()
        for name in _ADOPTED:
            setattr(self, name, getattr(base, name))
        self.scale = scale
        self.rope_global = base.rope_global
        self.rope_local = base.rope_local
        self.q_norm = base.q_norm
        self.k_norm = base.k_norm
        self.qkv_proj = build_projection(qkv)
        self.o_proj = build_projection(o)

    def rope(self) -> Module:
        return self.rope_local if self.is_sliding else self.rope_global

    def layer_values(self) -> LayerValues:
        """This layer's cache index and rotary table (``common.attention.layer_values``)."""
        return layer_values(self.rope(), self.layer_idx)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, **kwargs
    ) -> Tensor:
        head_dim = self.kv_params.head_dim
        q_dim, kv_dim = self.q_weight_dim, self.kv_weight_dim
        x_q, x_k, x_v = F.split(self.qkv_proj(x), [q_dim, kv_dim, kv_dim], axis=-1)
        qkv = F.concat(
            [
                per_head(self.q_norm, x_q, self.n_heads, head_dim),
                per_head(self.k_norm, x_k, kv_dim // head_dim, head_dim),
                x_v,
            ],
            axis=-1,
        )
        attn_out = rope_store_attend(
            qkv,
            kv_params=self.kv_params,
            kv_collection=kv_collection,
            input_row_offsets=kwargs["input_row_offsets"],
            layer=self.layer_values(),
            interleaved=self.rope().interleaved,
            n_heads=self.n_heads,
            head_dim=head_dim,
            sliding_window=self.local_window_size if self.is_sliding else None,
            scale=self.scale,
        )
        return self.o_proj(attn_out)
