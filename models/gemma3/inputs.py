"""Model inputs with the buffer ABI that device graph capture needs."""

from __future__ import annotations

from dataclasses import dataclass

from max import tree
from max.driver import Buffer
from max.nn.kv_cache import KVCacheInputs
from max.pipelines.architectures.gemma3_modulev3.batch_processor import (
    Gemma3ModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma3_modulev3.inputs import Gemma3Inputs


@dataclass
class AttnQuantGemma3Inputs(Gemma3Inputs):
    """MAX's Gemma 3 inputs, plus ``buffers``.

    MAX's own Gemma 3 inputs define no ``buffers``, which is why its Gemma 3
    cannot be captured (``... does not define model ABI buffers``). The order
    here is the compiled graph's input order: ``Gemma3.forward(tokens,
    return_n_logits, input_row_offsets, *kv_cache_leaves)``.
    """

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        kv_leaves = tree.leaves(self.kv_cache_inputs) if self.kv_cache_inputs else ()
        return (self.tokens, self.return_n_logits, self.input_row_offsets, *kv_leaves)


class AttnQuantGemma3BatchProcessor(Gemma3ModuleV3BatchProcessor):
    def _make_inputs(
        self,
        *,
        tokens: Buffer,
        input_row_offsets: Buffer,
        return_n_logits: Buffer,
        kv_cache_inputs: KVCacheInputs[Buffer, Buffer],
    ) -> AttnQuantGemma3Inputs:
        return AttnQuantGemma3Inputs(
            tokens=tokens,
            input_row_offsets=input_row_offsets,
            return_n_logits=return_n_logits,
            kv_cache_inputs=kv_cache_inputs,
        )
