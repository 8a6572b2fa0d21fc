"""Gemma 3's decoder layer, ending with the next layer's input norm.

MAX's ``Gemma3TransformerBlock`` with its forward taking and returning a
``common.layer_boundary.LayerInput``: the post-MLP norm, the residual and
the next layer's input norm are one kernel on a GPU, as are the
post-attention norm, the residual and the pre-MLP norm.
"""

from __future__ import annotations

from typing import Any

from max.experimental.nn.common_layers.kv_cache import PagedCacheValues
from max.experimental.tensor import Tensor
from max.pipelines.architectures.gemma3_modulev3.layers.transformer_block import (
    Gemma3TransformerBlock,
)

from ...common.layer_boundary import BoundaryLayer, LayerInput


class Gemma3DecoderLayer(BoundaryLayer, Gemma3TransformerBlock):
    """Gemma 3 decoder layer: 4 norms, the MLP, the next input norm."""

    hidden_arg = 1
    norm_offset = 1.0  # Gemma3RMSNorm scales by 1 + weight

    def forward(  # type: ignore[override]
        self,
        layer_idx: Tensor,
        x: LayerInput,
        kv_collection: PagedCacheValues,
        input_row_offsets: Tensor,
        **kwargs: Any,
    ) -> LayerInput:
        # One device: the projections' outputs are whole, no reduction before the norms.
        residual, normed = x
        attn_out = self.self_attn(normed, kv_collection, input_row_offsets=input_row_offsets, **kwargs)
        h, mlp_in = self.after_attention(attn_out, residual)
        return self.ending(self.mlp(mlp_in), h, self.norm_spec(self.post_feedforward_layernorm))
