"""Registers our Gemma 3 under MAX's own names, so it replaces the built-ins.

A custom architecture with a built-in's name wins the lookup
(``--custom-architectures``), and MAX's registry resolves the base name
before any ``_ModuleV3`` variant, so ``Gemma3ForCausalLM`` (270M, 1B) and
``Gemma3ForConditionalGeneration`` (4B, 12B, 27B: text + vision)
checkpoints are served by these, on CPU and GPU alike (images on GPU only).
"""

from __future__ import annotations

from dataclasses import replace

from max.graph.weights import WeightsFormat
from max.pipelines.architectures.gemma3multimodal_modulev3.arch import (
    gemma3_multimodal_modulev3_arch,
)
from max.pipelines.context import TextContext
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.lib import SupportedArchitecture
from max.pipelines.modeling.types import PipelineTask

from attnquant.load.memory import with_served_weights_size

from ..common.tokenizer import AttnQuantTextAndVisionTokenizer, AttnQuantTextTokenizer
from . import weight_adapters
from .inputs import AttnQuantGemma3BatchProcessor, AttnQuantGemma3MultiModalBatchProcessor
from .memory_planner import Gemma3MultiModalMemoryPlanner
from .model import AttnQuantGemma3Model, AttnQuantGemma3MultiModalModel
from .model_config import AttnQuantGemma3Config, AttnQuantGemma3MultiModalConfig

gemma3_arch = SupportedArchitecture(
    name="Gemma3ForCausalLM",
    example_repo_ids=["google/gemma-3-270m-it", "google/gemma-3-1b-it"],
    default_encoding="bfloat16",
    supported_encodings=AttnQuantGemma3Config.SUPPORTED_ENCODINGS,
    pipeline_model=AttnQuantGemma3Model,
    task=PipelineTask.TEXT_GENERATION,
    # MAX's, refusing prompt ids outside the vocabulary (HTTP 400) and missing tokenizer files.
    tokenizer=AttnQuantTextTokenizer,
    context_type=TextContext,
    default_weights_format=WeightsFormat.safetensors,
    multi_gpu_supported=False,
    weight_adapters={
        WeightsFormat.safetensors: weight_adapters.convert_safetensor_state_dict,
    },
    config=AttnQuantGemma3Config,
    batching=AttnQuantGemma3BatchProcessor,
    # KV cache sized with the served (NVFP4) weight bytes, not the files'.
    memory_planner=with_served_weights_size(PagedMemoryPlanner),
    # Our inputs define the buffer ABI (inputs.py), so the decode step can be
    # captured and replayed as one device graph.
    supports_device_graph_capture=True,
    supports_overlap_scheduler=False,
)

# Text + vision: MAX's ModuleV3 Gemma 3 multimodal architecture (context,
# required arguments, input modalities, MAX's own renaming in the model's
# _load_state_dict) with our model, config, batching, tokenizer and planner.
gemma3_multimodal_arch = replace(
    gemma3_multimodal_modulev3_arch,
    name="Gemma3ForConditionalGeneration",
    default_encoding="bfloat16",
    supported_encodings=AttnQuantGemma3MultiModalConfig.SUPPORTED_ENCODINGS,
    pipeline_model=AttnQuantGemma3MultiModalModel,
    # MAX's, with the token checks of the text line, and image requests
    # refused (HTTP 400) on a CPU server (MAX's vision tower is GPU-only).
    tokenizer=AttnQuantTextAndVisionTokenizer,
    multi_gpu_supported=False,
    config=AttnQuantGemma3MultiModalConfig,
    batching=AttnQuantGemma3MultiModalBatchProcessor,
    # MAX's reservation for the vision tower on GPU, none on CPU
    # (memory_planner.py); the KV cache sized with the served weight bytes.
    memory_planner=with_served_weights_size(Gemma3MultiModalMemoryPlanner),
    # The language graph's decode step is captured (MAX's cannot be: its
    # inputs have no buffer ABI); steps with images run eagerly (inputs.py).
    supports_device_graph_capture=True,
)
