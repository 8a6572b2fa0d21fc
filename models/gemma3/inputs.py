"""Model inputs with the buffer ABI that device graph capture needs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.graph import BufferType, DeviceRef, TensorType
from max.nn.kv_cache import KVCacheInputs
from max.nn.kv_cache.cache_params import KVCacheParamInterface
from max.pipelines.architectures.gemma3_modulev3.batch_processor import (
    Gemma3ModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma3_modulev3.inputs import Gemma3Inputs
from max.pipelines.architectures.gemma3multimodal_modulev3.batch_processor import (
    Gemma3MultiModalModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma3multimodal_modulev3.inputs import (
    Gemma3MultiModalModelInputs,
)
from max.pipelines.lib.interfaces.batch_processor import (
    modulev3_gemma_multimodal_language_symbolic_inputs,
)
from max.pipelines.lib.vision_batching import create_empty_image_embeddings_single

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


# --- Text + vision (Gemma3ForConditionalGeneration) ----------------------------


@dataclass
class AttnQuantGemma3MultiModalInputs(Gemma3MultiModalModelInputs):
    """MAX's Gemma 3 multimodal inputs, plus the image embeddings a text-only
    step feeds the language graph, and ``buffers``.

    ``buffers`` is the compiled language graph's input order, the one
    ``Gemma3MultiModalModelV3.execute`` calls it with: tokens,
    return_n_logits, input_row_offsets, image_embeddings,
    image_token_indices, then the KV-cache leaves.

    Device graph capture and images: MAX captures and replays decode steps
    only (``OverlapTextGenerationPipeline`` replays a batch only when its
    ``batch_type`` is token generation; everything else goes through
    ``execute``). A prompt's images ride on its prefill (a context's
    ``next_images`` are the images past its processed tokens, and chunked
    prefill is off for this architecture), which runs eagerly: ``execute``
    runs the vision tower, then the language graph with its embeddings. A
    decode step carries no pixels; the captured graph is the language graph
    with the zero-row ``image_embeddings`` set here. ``buffers`` refuses
    inputs that carry pixels, which no captured graph could encode.
    """

    image_embeddings: Buffer | None = None
    """Zero-row image embeddings in the model dtype, for a step without images."""

    @property
    def buffers(self) -> tuple[Buffer, ...]:
        if self.pixel_values is not None:
            raise RuntimeError(
                "Gemma 3 inputs that carry images have no capture ABI: their step runs the vision tower "
                "first (execute); MAX captures decode steps only, which carry no images"
            )
        assert self.image_embeddings is not None and self.image_token_indices is not None
        return abi_buffers(self, self.image_embeddings, self.image_token_indices)


class AttnQuantGemma3MultiModalBatchProcessor(Gemma3MultiModalModuleV3BatchProcessor):
    """MAX's batching for Gemma 3 text + vision, with:

    * the image-embedding input in the model dtype (MAX's is always
      bfloat16, which a float32 CPU graph cannot take), cached;
    * inputs with the capture ABI, the empty embeddings and indices on them;
    * contexts without images (``TextContext``, which MAX's capture warm-up
      builds) accepted: MAX's reads ``next_images`` of every context.
    """

    def empty_image_embeddings(self) -> Buffer:
        if self._cached_empty_embeddings is None:
            self._cached_empty_embeddings = create_empty_image_embeddings_single(
                self.runtime.devices[0], self._gemma_config.text_config.hidden_size, self._gemma_config.dtype
            )
        return self._cached_empty_embeddings

    def get_language_symbolic_inputs(
        self, *, kv_params: KVCacheParamInterface, device_ref: DeviceRef, hidden_size: int
    ) -> list[TensorType | BufferType]:
        return modulev3_gemma_multimodal_language_symbolic_inputs(
            kv_params=kv_params,
            device_ref=device_ref,
            hidden_size=hidden_size,
            embedding_dtype=self._gemma_config.dtype,
        )

    def _prepare_vision_inputs(self, context_batch: Sequence[Any], device0: Device) -> Buffer | None:
        if not any(getattr(context, "next_images", ()) for context in context_batch):
            return None
        return super()._prepare_vision_inputs(context_batch, device0)

    def _batch_image_token_indices(self, context_batch: Sequence[Any], device0: Device) -> Buffer:
        image_token = self._gemma_config.image_token_index
        if not any(np.any(context.tokens.active == image_token) for context in context_batch):
            return self.empty_image_token_indices()  # cached: no allocation per decode step
        return super()._batch_image_token_indices(context_batch, device0)

    def prepare_initial_token_inputs(
        self,
        replica_batches: Sequence[Sequence[Any]],
        kv_cache_inputs: KVCacheInputs[Buffer, Buffer] | None = None,
        return_n_logits: int = 1,
    ) -> AttnQuantGemma3MultiModalInputs:
        inputs = super().prepare_initial_token_inputs(
            replica_batches, kv_cache_inputs=kv_cache_inputs, return_n_logits=return_n_logits
        )
        fields = {f.name: getattr(inputs, f.name) for f in dataclasses.fields(inputs) if f.init}
        return AttnQuantGemma3MultiModalInputs(**fields, image_embeddings=self.empty_image_embeddings())
