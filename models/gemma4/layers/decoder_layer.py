"""Gemma 4's decoder layer, ending with the next layer's input norm.

MAX's ``Gemma4TransformerBlock`` with its forward taking and returning a
``common.layer_boundary.LayerInput``. The layer ends with
``(h + norm(m, w)) * s`` (``s`` the layer's learned scalar); it is computed as
``h * s + norm(m, w * s)``, the same sum with ``w * s`` made of weights alone
(a per-layer value, made at load), because MAX fuses "add, norm" after a
norm but not with a multiply between them: so written, the post-MLP norm,
the residual and the next input norm are one kernel on a GPU. In bfloat16
``w * s`` is rounded once, where MAX rounds the norm's output before the
multiply: at most a bfloat16 step apart.
"""

from __future__ import annotations

from max.experimental.nn.common_layers.kv_cache import PagedCacheValues
from max.experimental.tensor import Tensor
from max.pipelines.architectures.gemma4_modulev3.layers.transformer_block import (
    Gemma4TransformerBlock,
)

from ...common.layer_boundary import BoundaryLayer, LayerInput


class Gemma4DecoderLayer(BoundaryLayer, Gemma4TransformerBlock):
    """Gemma 4 decoder layer: 4 norms, the MLP, the layer scalar, the next input norm."""

    hidden_arg = 0
    norm_offset = 0.0  # Gemma 4 checkpoints store the norms' whole scale

    def ending_values(self) -> dict[str, Tensor]:
        return {"post_feedforward_scaled": self.post_feedforward_layernorm.weight * self.layer_scalar}

    def forward(  # type: ignore[override]
        self, x: LayerInput, kv_collection: PagedCacheValues, input_row_offsets: Tensor
    ) -> LayerInput:
        # One device: the projections' outputs are whole, no reduction before the norms.
        residual, normed = x
        attn_out = self.self_attn(normed, kv_collection, input_row_offsets=input_row_offsets)
        h, mlp_in = self.after_attention(attn_out, residual)
        scaled = self.boundary_values()["post_feedforward_scaled"]
        post_mlp = self.norm_spec(self.post_feedforward_layernorm, weight=scaled)
        return self.ending(self.mlp(mlp_in), h, post_mlp, scale=self.layer_scalar)
