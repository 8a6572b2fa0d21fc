"""Registers our Gemma 4 under MAX's own names, so it replaces the built-ins.

A custom architecture with a built-in's name wins the lookup
(``--custom-architectures``). Each is registered under the base name MAX
resolves first and its ``_ModuleV3`` twin (what ``--prefer-module-v3`` looks
up), plus the names MAX rewrites a Gemma 4 target to when a drafter is given
(see ``speculative.py``).

Everything but the model, config and encodings is MAX's ModuleV3 Gemma 4
architecture: tokenizer, context, batching, memory planner, parsers.
"""

from __future__ import annotations

from dataclasses import replace

from max.graph.weights import WeightsFormat
from max.pipelines.architectures.gemma4_modulev3.arch import (
    gemma4_modulev3_arch,
    gemma4_unified_modulev3_arch,
)
from max.pipelines.architectures.unified_mtp_gemma4_modulev3.arch import (
    unified_mtp_gemma4_modulev3_arch,
)
from max.pipelines.lib import SupportedArchitecture

from attnquant.load.memory import with_served_weights_size

from ..common.tokenizer import AttnQuantGemma4Tokenizer
from ..registration import with_module_v3_twin
from . import weight_adapters
from .inputs import AttnQuantGemma4BatchProcessor
from .model import AttnQuantGemma4Model
from .model_config import AttnQuantGemma4Config
from .speculative import (
    MTP_TARGET,
    REFUSED_TARGETS,
    AttnQuantUnifiedMTPGemma4Model,
    RefusedDrafterConfig,
    RefusedDrafterModel,
)

_OURS = dict(
    # MAX's, refusing prompt ids outside the vocabulary (HTTP 400) and missing tokenizer files.
    tokenizer=AttnQuantGemma4Tokenizer,
    default_encoding="bfloat16",
    supported_encodings=AttnQuantGemma4Config.SUPPORTED_ENCODINGS,
    config=AttnQuantGemma4Config,
    multi_gpu_supported=False,
)

# Our inputs define the buffer ABI (inputs.py), so the text model's decode
# step can be captured (MAX's own ModuleV3 Gemma 4 cannot); MAX then captures
# by default on CUDA (--no-device-graph-capture turns it off). On the H200 the
# greedy text is the same with capture on and off (docs/performance.md).
_TEXT_MODEL = dict(
    batching=AttnQuantGemma4BatchProcessor,
    supports_device_graph_capture=True,
)

# Image/video + text (google/gemma-4-31B-it): the text tower is ours, the
# vision tower MAX's. MAX's ModuleV3 vision attention runs on GPU only.
gemma4_arch = replace(
    gemma4_modulev3_arch,
    name="Gemma4ForConditionalGeneration",
    # KV cache sized with the served (NVFP4) weight bytes, not the files'.
    memory_planner=with_served_weights_size(gemma4_modulev3_arch.memory_planner),
    pipeline_model=AttnQuantGemma4Model,
    weight_adapters={WeightsFormat.safetensors: weight_adapters.convert_safetensor_state_dict},
    **_OURS,
    **_TEXT_MODEL,
)

# The text-only "gemma4_unified" line (google/gemma-4-12B-it); runs on CPU too.
gemma4_unified_arch = replace(
    gemma4_unified_modulev3_arch,
    name="Gemma4UnifiedForConditionalGeneration",
    memory_planner=gemma4_arch.memory_planner,
    pipeline_model=AttnQuantGemma4Model,
    weight_adapters=gemma4_arch.weight_adapters,
    **_OURS,
    **_TEXT_MODEL,
)

# Gemma 4 + a Gemma 4 assistant drafter (MTP speculative decoding).
gemma4_mtp_arch = replace(
    unified_mtp_gemma4_modulev3_arch,
    name=MTP_TARGET,
    pipeline_model=AttnQuantUnifiedMTPGemma4Model,
    memory_planner=with_served_weights_size(unified_mtp_gemma4_modulev3_arch.memory_planner),
    **_OURS,
)

# Gemma 4 + a DSpark / DFlash drafter: refused with a clear error.
refused_drafter_archs = [
    replace(
        gemma4_arch,
        name=name,
        pipeline_model=RefusedDrafterModel,
        config=RefusedDrafterConfig,
    )
    for name in REFUSED_TARGETS
]


GEMMA4_ARCHITECTURES: list[SupportedArchitecture] = [
    *with_module_v3_twin(gemma4_arch),
    *with_module_v3_twin(gemma4_unified_arch),
    *with_module_v3_twin(gemma4_mtp_arch),
    *refused_drafter_archs,
]
