"""Gemma 3 configuration: MAX's, plus what attnquant decided at load."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from max.pipelines.architectures.gemma3_modulev3.model_config import Gemma3Config
from max.pipelines.modeling.config_enums import SupportedEncoding

from attnquant.max_compat import DevicesFromMesh
from attnquant.runtime_layout import ProjectionPlan


@dataclass(kw_only=True)
class AttnQuantGemma3Config(DevicesFromMesh, Gemma3Config):
    """MAX's ModuleV3 Gemma 3 config that also runs in float32.

    MAX refuses bfloat16 on CPU, so CPU runs use ``--quantization-encoding
    float32`` (``run_max.py`` adds it): the bf16 checkpoint is widened
    exactly, which is also what makes CPU output comparable to transformers.
    """

    SUPPORTED_ENCODINGS: ClassVar[set[SupportedEncoding]] = {"bfloat16", "float32"}

    projection_plan: ProjectionPlan = field(default_factory=dict)
    """Per projection group, its run-time parts (see attnquant.runtime_layout)."""
