"""Gemma 4 model inputs with the buffer ABI that device graph capture needs."""

from __future__ import annotations

from dataclasses import dataclass

from max import tree
from max.driver import Buffer
from max.nn.kv_cache import KVCacheInputs
from max.pipelines.architectures.gemma4_modulev3.batch_processor import (
    Gemma4ModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma4_modulev3.inputs import Gemma4Inputs


@dataclass
class AttnQuantGemma4Inputs(Gemma4Inputs):
    """MAX's ModuleV3 Gemma 4 inputs, plus ``buffers``.

    MAX's define none, so its ModuleV3 Gemma 4 cannot be captured. The order
    is the compiled language graph's input order, the one
    ``Gemma4Model.execute`` calls it with: tokens, return_n_logits,
    input_row_offsets, the image embeddings and their scatter indices (one
    device: one of each; zero-row empties on a text-only or decode step,
    set by MAX's vision-encoder cache, also during capture warm-up), then
    the KV-cache leaves.
    """

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        kv_leaves = tree.leaves(self.kv_cache_inputs) if self.kv_cache_inputs else ()
        return (
            self.tokens,
            self.return_n_logits,
            self.input_row_offsets,
            *self.vision_embeddings,
            *self.vision_scatter_indices,
            *kv_leaves,
        )


class AttnQuantGemma4BatchProcessor(Gemma4ModuleV3BatchProcessor):
    def _make_inputs(
        self,
        *,
        tokens: Buffer,
        input_row_offsets: Buffer,
        return_n_logits: Buffer,
        kv_cache_inputs: KVCacheInputs[Buffer, Buffer],
    ) -> AttnQuantGemma4Inputs:
        return AttnQuantGemma4Inputs(
            tokens=tokens,
            input_row_offsets=input_row_offsets,
            return_n_logits=return_n_logits,
            kv_cache_inputs=kv_cache_inputs,
        )
