"""Model inputs with the buffer ABI that device graph capture needs."""

from __future__ import annotations

from dataclasses import dataclass

from max.driver import Buffer
from max.pipelines.architectures.gemma3_modulev3.batch_processor import (
    Gemma3ModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma3_modulev3.inputs import Gemma3Inputs

from ..common.inputs import MakesABIInputs, abi_buffers


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
        return abi_buffers(self)


class AttnQuantGemma3BatchProcessor(MakesABIInputs, Gemma3ModuleV3BatchProcessor):
    inputs_cls = AttnQuantGemma3Inputs
