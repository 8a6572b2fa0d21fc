"""Gemma 3 configurations: MAX's, plus attnquant's settings and load-time plan.

``AttnQuantGemma3Config`` for the text-only line (``Gemma3ForCausalLM``,
270M/1B), ``AttnQuantGemma3MultiModalConfig`` for text + vision
(``Gemma3ForConditionalGeneration``, 4B/12B/27B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from max.pipelines.architectures.gemma3_modulev3.model_config import Gemma3Config
from max.pipelines.architectures.gemma3multimodal_modulev3.model_config import (
    Gemma3ForConditionalGenerationConfig,
)
from max.pipelines.lib import PipelineConfig
from typing_extensions import Self

from attnquant.max_compat import DevicesFromMesh

from ..common.prepare import AttnQuantFields, attach_settings, model_dtype


@dataclass(kw_only=True)
class AttnQuantGemma3Config(AttnQuantFields, DevicesFromMesh, Gemma3Config):
    """MAX's ModuleV3 Gemma 3 config that also runs in float32.

    MAX refuses bfloat16 on CPU, so CPU runs use ``--quantization-encoding
    float32`` (``run_max.py`` adds it): the bf16 checkpoint is widened
    exactly, which is also what makes CPU output comparable to transformers.
    ``float4_e2m1fnx2`` is the encoding MAX gives a checkpoint stored as
    ModelOpt NVFP4 (on a GPU): its NVFP4 projections are served as stored,
    everything else in bf16.
    """

    @classmethod
    def initialize_from_config(
        cls, pipeline_config: PipelineConfig, huggingface_config: Any, *, max_seq_len: int
    ) -> Self:
        config = super().initialize_from_config(pipeline_config, huggingface_config, max_seq_len=max_seq_len)
        return attach_settings(config)


@dataclass(kw_only=True)
class AttnQuantGemma3MultiModalConfig(AttnQuantFields, Gemma3ForConditionalGenerationConfig):
    """MAX's ModuleV3 Gemma 3 text + vision config that also runs in float32.

    float32 is for CPU (``run_max.py`` passes ``--quantization-encoding
    float32`` there), where MAX's vision tower cannot run: a CPU server
    serves the language model only (models/common/vision.py). A ModelOpt
    NVFP4 export is served as the text-only model serves one; its vision
    tower is bf16. MAX's config already has the ``devices`` its memory
    planner needs.
    """

    @classmethod
    def initialize_from_config(
        cls, pipeline_config: PipelineConfig, huggingface_config: Any, *, max_seq_len: int
    ) -> Self:
        config = super().initialize_from_config(pipeline_config, huggingface_config, max_seq_len=max_seq_len)
        config.text_config.dtype = model_dtype(config.text_config.dtype)
        return attach_settings(config)
