"""The buffer ABI that device graph capture needs, shared by our Gemma 3 and 4.

MAX captures a decode step and replays it with ``model(*inputs.buffers)``:
``buffers`` must list the compiled graph's inputs in its order. Both of
MAX's ModuleV3 Gemma graphs take tokens, return_n_logits, input_row_offsets,
then model-specific inputs, then the KV-cache leaves; MAX's own inputs
classes define no ``buffers``, so their models cannot be captured.
"""

from __future__ import annotations

from typing import Any, ClassVar

from max import tree
from max.driver import Buffer
from max.nn.kv_cache import KVCacheInputs


def abi_buffers(inputs: Any, *middle: Buffer) -> tuple[Buffer, ...]:
    """``inputs``' buffers in the compiled graph's order, ``middle`` between
    the token inputs and the KV-cache leaves."""
    kv_leaves = tree.leaves(inputs.kv_cache_inputs) if inputs.kv_cache_inputs else ()
    return (inputs.tokens, inputs.return_n_logits, inputs.input_row_offsets, *middle, *kv_leaves)


class MakesABIInputs:
    """Mixin for a MAX ModuleV3 batch processor: ``_make_inputs`` builds
    ``inputs_cls`` (MAX's inputs class plus ``buffers``) instead of MAX's."""

    inputs_cls: ClassVar[type[Any]]

    def _make_inputs(
        self,
        *,
        tokens: Buffer,
        input_row_offsets: Buffer,
        return_n_logits: Buffer,
        kv_cache_inputs: KVCacheInputs[Buffer, Buffer],
    ) -> Any:
        return self.inputs_cls(
            tokens=tokens,
            input_row_offsets=input_row_offsets,
            return_n_logits=return_n_logits,
            kv_cache_inputs=kv_cache_inputs,
        )
