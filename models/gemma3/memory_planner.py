"""Memory planning for Gemma 3 text + vision: MAX's, except on CPU.

MAX's ``Gemma3ForConditionalGeneration`` planner reserves 15 GiB of
activation memory (headroom for the vision tower) and P2P signal buffers
(~270 MiB) before it sizes the KV cache. On a GPU ours keeps both. A CPU
server runs no vision tower (MAX's is GPU-only) and no collectives, and a
15 GiB reservation is more than a small host has: there ours reserves
neither. The served (NVFP4) weight size is applied on top, by
``attnquant.load.memory.with_served_weights_size`` (arch.py).
"""

from __future__ import annotations

from typing import Any

from max.pipelines.architectures.gemma3multimodal_modulev3.arch import (
    gemma3_multimodal_modulev3_arch,
)

from ..common.vision import serves_on_cpu

_MAX_PLANNER: Any = gemma3_multimodal_modulev3_arch.memory_planner


class Gemma3MultiModalMemoryPlanner(_MAX_PLANNER):  # type: ignore[misc, valid-type]
    def estimate_activation_memory(self, pipeline_config: Any, huggingface_config: Any) -> int:
        if serves_on_cpu(pipeline_config):
            return 0
        return super().estimate_activation_memory(pipeline_config, huggingface_config)

    def estimate_signal_buffer_memory(self, pipeline_config: Any, arch_config: Any | None = None) -> int:
        if serves_on_cpu(pipeline_config):
            return 0
        return super().estimate_signal_buffer_memory(pipeline_config, arch_config)
