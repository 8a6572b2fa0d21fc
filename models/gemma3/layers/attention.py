"""Gemma 3 attention whose q|k|v and o projections are attnquant modules.

It adopts the configuration (rotary tables, QK norms, window, KV params) of
MAX's own ``Gemma3Attention`` and replaces the projections; between the two
matmuls it runs MAX's kernels, with two changes:

- the q and k norms run as one RMS norm over every q and k head of the fused
  projection (``common.attention.normed_heads``): at one decode row MAX's two
  norms and the concat after them are three launches of a few microseconds;
  the per-head table of their weights is made of weights alone, in the
  enclosing graph (a layer value), as Gemma 4's;
- the scale: transformers' ``query_pre_attn_scalar ** -0.5``, which MAX 26.7
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

from ...common.attention import (
    LayerValues,
    head_norm_scales,
    layer_values,
    normed_heads,
    rope_store_attend,
    shared_eps,
)

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
        self.eps = shared_eps("Gemma 3", (base.q_norm, base.k_norm))
        self.head_dim = base.kv_params.head_dim
        self.qkv_proj = build_projection(qkv)
        self.o_proj = build_projection(o)

    def rope(self) -> Module:
        return self.rope_local if self.is_sliding else self.rope_global

    def _qk_norm_scales(self) -> Tensor:
        """[q|k heads, head_dim] float32: each head's ``1 + weight``."""
        groups = ((self.q_norm.weight, self.n_heads), (self.k_norm.weight, self.kv_weight_dim // self.head_dim))
        return head_norm_scales(groups, self.head_dim, offset=1.0)  # Gemma's norms scale by 1 + weight

    def layer_values(self) -> LayerValues:
        """This layer's cache index, rotary table and q/k norm weights per
        head, ``qk_norm_scales`` (``common.attention.layer_values``)."""
        return layer_values(self.rope(), self.layer_idx, qk_norm_scales=self._qk_norm_scales)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, **kwargs
    ) -> Tensor:
        layer = self.layer_values()
        x_qk, x_v = F.split(self.qkv_proj(x), [self.q_weight_dim + self.kv_weight_dim, self.kv_weight_dim], axis=-1)
        qkv = F.concat([normed_heads(x_qk, layer["qk_norm_scales"], self.eps), x_v], axis=-1)
        attn_out = rope_store_attend(
            qkv,
            kv_params=self.kv_params,
            kv_collection=kv_collection,
            input_row_offsets=kwargs["input_row_offsets"],
            layer=layer,
            interleaved=self.rope().interleaved,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            sliding_window=self.local_window_size if self.is_sliding else None,
            scale=self.scale,
        )
        return self.o_proj(attn_out)
