"""Gemma 4 attention whose q|k(|v) and o projections are attnquant modules.

It adopts the configuration of MAX's own ``Gemma4Attention`` (per-layer-type
head size and KV heads, rotary tables, q/k/v norms, window, cache slot) and
replaces only the projections, so everything between the two matmuls is
MAX's code path unchanged.

Layers with ``attention_k_eq_v`` (Gemma 4 31B's full-attention layers) have
no ``v_proj``: the fused input projection is then q|k, and v is k before the
norms, exactly as MAX and transformers compute it.

The q, k and v norms run as one RMS norm over every head of the fused
projection: at one decode row MAX's three norms and the concat after them
are four launches of a few microseconds each. The per-head weights it
multiplies by are made of weights alone, in the enclosing graph (a layer
value, passed to a shared layer subgraph as an argument), so MAX makes them
once at load rather than every step (docs/performance.md).
"""

from __future__ import annotations

from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.kv_cache import PagedCacheValues
from max.experimental.tensor import Tensor
from max.pipelines.architectures.gemma4_modulev3.layers.attention import (
    Gemma4Attention,
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
    "n_heads", "kv_params", "scale", "use_local", "layer_idx_in_cache",
    "local_window_size", "head_dim", "num_key_value_heads", "q_weight_dim",
    "kv_weight_dim",
)  # fmt: skip


class ProjectedGemma4Attention(Module[..., Tensor]):
    """Gemma 4 attention: fused input projection, q/k/v norms, RoPE, flash attention."""

    def __init__(
        self,
        base: Gemma4Attention,
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
        self.eps = shared_eps("Gemma 4", (base.q_norm, base.k_norm, base.v_norm))
        self.has_v_proj = "v_proj" in {m for part in qkv for m in part.members}
        self.qkv_proj = build_projection(qkv)
        self.o_proj = build_projection(o)

    def _project_qkv(self, x: Tensor) -> Tensor:
        """[tokens, q|k|v], v being k where the layer has no ``v_proj``."""
        qkv = self.qkv_proj(x)
        if self.has_v_proj:
            return qkv
        _, x_k = F.split(qkv, [self.q_weight_dim, self.kv_weight_dim], axis=-1)
        return F.concat([qkv, x_k], axis=-1)

    def _qkv_norm_scales(self) -> Tensor:
        """[q|k|v heads, head_dim] float32: each head's norm weight (v's: ones)."""
        kv = self.num_key_value_heads
        v_weight = Tensor.ones_like(self.k_norm.weight)  # v's norm has none
        groups = ((self.q_norm.weight, self.n_heads), (self.k_norm.weight, kv), (v_weight, kv))
        return head_norm_scales(groups, self.head_dim)

    def rope(self) -> Module:
        return self.rope_local if self.use_local else self.rope_global

    def layer_values(self) -> LayerValues:
        """This layer's cache index, rotary table and q/k/v norm weights per
        head, ``qkv_norm_scales`` (``common.attention.layer_values``)."""
        return layer_values(self.rope(), self.layer_idx_in_cache, qkv_norm_scales=self._qkv_norm_scales)

    def forward(
        self, x: Tensor, kv_collection: PagedCacheValues, *, input_row_offsets: Tensor
    ) -> Tensor:
        layer = self.layer_values()
        qkv = normed_heads(self._project_qkv(x), layer["qkv_norm_scales"], self.eps)
        attn_out = rope_store_attend(
            qkv,
            kv_params=self.kv_params,
            kv_collection=kv_collection,
            input_row_offsets=input_row_offsets,
            layer=layer,
            interleaved=self.rope().interleaved,
            n_heads=self.n_heads,
            head_dim=self.head_dim,
            sliding_window=self.local_window_size if self.use_local else None,
            scale=self.scale,
        )
        return self.o_proj(attn_out)


def check_qkv_widths(layer: int, base: Gemma4Attention, qkv: tuple[PartPlan, ...]) -> None:
    """The checkpoint's q|k(|v) must match the geometry MAX derived from the config.

    A mismatch (say ``attention_k_eq_v`` in a config whose checkpoint has a
    ``v_proj`` on that layer) would otherwise surface as a shape error deep
    in MAX's weight binding, or not at all.
    """
    expects_v = base._has_v_proj  # noqa: SLF001 (MAX keeps it private)
    expected = [base.q_weight_dim, base.kv_weight_dim] + [base.kv_weight_dim] * expects_v
    got = [n for part in qkv for n in part.out_dims]
    if got != expected:
        members = [m for part in qkv for m in part.members]
        kind = "sliding" if base.use_local else "full"
        raise ValueError(
            f"Gemma 4 layer {layer} ({kind} attention): the checkpoint has {members} with "
            f"output widths {got}, the config implies {expected} (v_proj "
            f"{'present' if expects_v else 'absent: attention_k_eq_v'}); check head_dim, "
            "global_head_dim, the KV head counts and attention_k_eq_v in config.json"
        )
