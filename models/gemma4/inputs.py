"""Gemma 4 model inputs with the buffer ABI that device graph capture needs."""

from __future__ import annotations

from dataclasses import dataclass

from max.driver import Buffer
from max.pipelines.architectures.gemma4_modulev3.batch_processor import (
    Gemma4ModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma4_modulev3.inputs import Gemma4Inputs

from ..common.inputs import MakesABIInputs, abi_buffers


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
        return abi_buffers(self, *self.vision_embeddings, *self.vision_scatter_indices)


class AttnQuantGemma4BatchProcessor(MakesABIInputs, Gemma4ModuleV3BatchProcessor):
    inputs_cls = AttnQuantGemma4Inputs
