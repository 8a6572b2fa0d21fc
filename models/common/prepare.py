"""What every attnquant architecture does at load: read the settings once,
prepare the weights, convert them for the device."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from max.driver import Device
from max.dtype import DType
from max.experimental.sharding import DeviceMesh
from max.graph.weights import Weights
from max.pipelines.modeling.config_enums import SupportedEncoding

from attnquant.config import AttnQuantConfig
from attnquant.graph import runtime
from attnquant.graph.projections import build_output_head
from attnquant.load import pipeline
from attnquant.load.head import OutputHead
from attnquant.load.importance import ResidualStream
from attnquant.max_compat import weight_files
from attnquant.plan import ProjectionPlan


SUPPORTED_ENCODINGS: frozenset[SupportedEncoding] = frozenset({"bfloat16", "float32", "float4_e2m1fnx2"})
"""The MAX encodings every attnquant architecture serves: ``bfloat16`` (a GPU),
``float32`` (a CPU, where MAX refuses bfloat16: ``run_max.py`` passes
``--quantization-encoding float32``) and ``float4_e2m1fnx2``, the encoding MAX
gives a ModelOpt NVFP4 checkpoint on a GPU (its NVFP4 projections served as
stored, the rest in bf16; see ``model_dtype``)."""


@dataclasses.dataclass(kw_only=True)
class AttnQuantFields:
    """What every attnquant architecture's config adds to MAX's: list it
    first among the bases, so its encodings win over MAX's."""

    SUPPORTED_ENCODINGS: ClassVar[frozenset[SupportedEncoding]] = SUPPORTED_ENCODINGS

    attnquant: AttnQuantConfig = dataclasses.field(default_factory=AttnQuantConfig)
    """The ATTNQUANT_* settings of this load (read once, in ``initialize_from_config``)."""
    projection_plan: ProjectionPlan = dataclasses.field(default_factory=dict)
    """Per projection group of the language model, its run-time parts (see attnquant.plan)."""


def read_settings() -> AttnQuantConfig:
    """The ATTNQUANT_* settings, read once per load by the architecture's
    config (``initialize_from_config``) and carried on it from there."""
    settings = AttnQuantConfig.from_env()
    settings.apply_log_level()
    return settings


def attach_settings(config: Any) -> Any:
    """What each architecture's ``initialize_from_config`` adds to MAX's
    parsed config: the settings, read once, and the model dtype."""
    config.attnquant = read_settings()
    config.dtype = model_dtype(config.dtype)
    return config


def single_device_mesh(devices: list[Any]) -> DeviceMesh:
    """The one-device mesh our models build on (no tensor parallelism yet)."""
    if len(devices) != 1:
        raise ValueError(
            f"attnquant serves on one device; got {len(devices)} "
            "(tensor parallelism is not supported yet): pass one --devices entry"
        )
    return DeviceMesh(tuple(devices), (1,), ("tp",))


def model_dtype(dtype: DType) -> DType:
    """The dtype of the model's activations and unquantized weights: MAX gives
    a checkpoint stored as NVFP4 the ``float4_e2m1fnx2`` encoding (``uint8``),
    whose other tensors are bf16."""
    return DType.bfloat16 if dtype == DType.uint8 else dtype


def prepare_for_device(
    state_dict: Mapping[str, Any],
    settings: AttnQuantConfig,
    *,
    weights: Weights,
    num_layers: int,
    dtype: DType,
    device: Device,
    graph_capture: bool | None,
    head: OutputHead,
    stream: ResidualStream,
    mlp_activation: str,
) -> pipeline.PreparedWeights:
    """The load pipeline's weights and plan, converted for ``device``.

    ``graph_capture``: ``pipeline_config.runtime.device_graph_capture``;
    ``mlp_activation``: the text config's ``hidden_activation``;
    ``head``: where the model's output head is (the architecture computes it
    through attnquant's matmul, with the plan's ``head.group`` entry);
    ``stream``: the architecture's residual stream (``attnquant.load.importance``).
    """
    prepared = pipeline.prepare_weights(
        state_dict, settings, checkpoint_files=weight_files(weights), num_layers=num_layers,
        dtype=dtype, device_api=str(device.api), device_id=device.id, head=head, stream=stream,
    )  # fmt: skip
    plan = runtime.for_device(
        prepared.state_dict, prepared.plan, settings, dtype=dtype, device=device, graph_capture=graph_capture,
        mlp_activation=mlp_activation,
    )  # fmt: skip
    return dataclasses.replace(prepared, plan=plan)


def use_output_head(text_model: Any, parts: tuple[Any, ...]) -> None:
    """Makes MAX's text model (``Gemma3TextModel``, ``Gemma4TextModel``) compute
    its output head with attnquant's projection for ``parts`` instead of its
    own tied matmul (MAX calls ``lm_head(h)`` once the head is untied; its
    logit soft-capping and float32 cast stay as they are)."""
    text_model.tie_word_embeddings = False
    text_model.lm_head = build_output_head(parts, text_model.embed_tokens.weight)
