"""Registers our Gemma 3 under MAX's own name, so it replaces the built-in.

A custom architecture with a built-in's name wins the lookup
(``--custom-architectures``), and MAX's registry resolves the base name
before any ``_ModuleV3`` variant, so ``Gemma3ForCausalLM`` checkpoints are
served by this one, on CPU and GPU alike.
"""

from __future__ import annotations

from max.graph.weights import WeightsFormat
from max.pipelines.context import TextContext
from max.pipelines.kv_cache.memory_planner import PagedMemoryPlanner
from max.pipelines.lib import SupportedArchitecture
from max.pipelines.modeling.types import PipelineTask

from attnquant.load.memory import with_served_weights_size

from ..common.tokenizer import AttnQuantTextTokenizer
from . import weight_adapters
from .inputs import AttnQuantGemma3BatchProcessor
from .model import AttnQuantGemma3Model
from .model_config import AttnQuantGemma3Config

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
