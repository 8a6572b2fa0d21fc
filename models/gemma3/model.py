"""Gemma 3 pipeline models: MAX's ModuleV3 Gemma 3 with attnquant projections.

Load time runs attnquant's pipeline once over the language weights: theta ->
W_eff -> optional NVFP4 -> fused run-time layout, converted for the device.
Build time builds MAX's Gemma 3 text model and swaps each layer's attention
and MLP for modules made from the resulting projection plan
(:func:`use_projections`), and computes the output head through attnquant.

* ``AttnQuantGemma3Model``: the text line (``Gemma3ForCausalLM``); load in
  ``_prepare_state_dict``, build in ``_instantiate_module``.
* ``AttnQuantGemma3MultiModalModel``: text + vision
  (``Gemma3ForConditionalGeneration``); load in ``_create_model_config``
  (before either tower compiles), build in ``_compile_language_model``. The
  vision tower is MAX's, unquantized; on CPU it is not compiled (MAX's runs
  on GPU only) and image requests are refused.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar, cast

from max.experimental import functional as F
from max.experimental.tensor import default_device, default_dtype
from max.graph import DeviceRef
from max.pipelines.architectures.gemma3_modulev3.gemma3 import Gemma3, Gemma3TextModel
from max.pipelines.architectures.gemma3_modulev3.model import Gemma3Model
from max.pipelines.architectures.gemma3_modulev3.model_config import Gemma3Config
from max.pipelines.architectures.gemma3multimodal_modulev3.inputs import (
    Gemma3MultiModalModelInputs,
)
from max.pipelines.architectures.gemma3multimodal_modulev3.model import (
    Gemma3MultiModalModelV3,
)
from max.pipelines.architectures.gemma3multimodal_modulev3.vision_model.gemma3multimodal import (
    Gemma3LanguageModel,
)
from max.pipelines.lib import ModelInputs, ModelOutputs

from attnquant.config import LOGGER_NAME
from attnquant.graph.residual_norm import NormKernel
from attnquant.graph.theta import shared_blocks
from attnquant.load import importance
from attnquant.load.head import OutputHead
from attnquant.max_compat import gemma3_attention_scale
from attnquant.plan import ProjectionPlan

from ..common.layer_boundary import adopt, hand_on_input_norms, norm_kernel_of, with_next_norms
from ..common.layer_subgraphs import LAYER_GROUPS, LayerSubgraphs, SubgraphChoice, layer_subgraphs_of
from ..common.mlp import build_mlp
from ..common.prepare import prepare_for_device, single_device_mesh, use_output_head
from ..common.vision import IMAGES_NEED_A_GPU
from . import weight_adapters
from .inputs import AttnQuantGemma3BatchProcessor, AttnQuantGemma3MultiModalBatchProcessor
from .layers.attention import ProjectedGemma3Attention
from .layers.decoder_layer import Gemma3DecoderLayer
from .model_config import AttnQuantGemma3Config, AttnQuantGemma3MultiModalConfig

logger = logging.getLogger(LOGGER_NAME)

LANGUAGE_PREFIX = "language_model."
"""Where both MAX module trees keep the text decoder (``Gemma3`` and
``Gemma3LanguageModel`` alike); the names attnquant prepares (and caches) the
language weights under."""


def output_head(tied: bool) -> OutputHead:
    """Our Gemma 3's output head: ``lm_head`` beside the embedding, tied unless
    the checkpoint has a head of its own (MAX's rule, ``finalize``)."""
    return OutputHead(f"{LANGUAGE_PREFIX}lm_head", f"{LANGUAGE_PREFIX}embed_tokens.weight", tied=tied)


def use_projections(
    text_model: Gemma3TextModel,
    plan: ProjectionPlan,
    *,
    text_config: Gemma3Config,
    head: OutputHead,
    layer_subgraphs: SubgraphChoice,
    norm_kernel: NormKernel | bool,
) -> None:
    """Swaps every decoder layer's attention and MLP of MAX's ``Gemma3TextModel``
    for plan-built ones, each layer ending with the next one's input norm
    (``common.layer_boundary``), and computes its output head through attnquant.

    ``plan`` is keyed by ``LANGUAGE_PREFIX`` names; ``text_config`` is the
    one ``text_model`` was built from; ``layer_subgraphs``: layers of one
    structure share a subgraph or not (``choose_layer_subgraphs``); ``norm_kernel``:
    the layers add and norm with attnquant's kernel (``norm_kernel_of``). Call it in the
    build context (``F.lazy()``, dtype, device) that built ``text_model``.
    """
    scale = gemma3_attention_scale(text_config.query_pre_attn_scalar, text_config.head_dim)
    activation = text_config.hidden_activation
    subgraphs = LayerSubgraphs("gemma3", layer_subgraphs)
    with shared_blocks():
        for i, block in enumerate(text_model.layers):
            layer = f"{LANGUAGE_PREFIX}layers.{i}"
            groups = [plan[f"{layer}.{name}"] for name in LAYER_GROUPS]
            qkv, o, gate_up, down = groups
            block.self_attn = ProjectedGemma3Attention(block.self_attn, qkv=qkv, o=o, scale=scale)
            block.mlp = build_mlp(gate_up=gate_up, down=down, activation=activation)
            adopt(block, Gemma3DecoderLayer)
            subgraphs.share(block, "sliding" if block.self_attn.is_sliding else "full", groups)
        hand_on_input_norms(text_model.layers, text_model.norm, norm_kernel=norm_kernel)
        use_output_head(text_model, plan[head.group])
    subgraphs.log()


class AttnQuantGemma3Model(Gemma3Model):
    model_config_cls: ClassVar[type[Any]] = AttnQuantGemma3Config
    batch_processor_cls: ClassVar[type[AttnQuantGemma3BatchProcessor]] = (
        AttnQuantGemma3BatchProcessor
    )

    def _create_model_config(self, state_dict: dict[str, Any]) -> AttnQuantGemma3Config:
        single_device_mesh(self.devices)
        text_config = self._hf_config_for_weights()
        model_config = AttnQuantGemma3Config.initialize_from_config(
            self.pipeline_config, text_config, max_seq_len=self.max_seq_len
        )
        model_config.finalize(
            huggingface_config=text_config,
            state_dict=state_dict,
            return_logits=self.return_logits,
        )
        return model_config

    def _prepare_state_dict(
        self, state_dict: dict[str, Any], model_config: AttnQuantGemma3Config
    ) -> dict[str, Any]:
        prepared = prepare_for_device(
            state_dict,
            model_config.attnquant,
            weights=self.weights,
            num_layers=model_config.num_hidden_layers,
            dtype=model_config.dtype,
            device=self.devices[0],
            graph_capture=self.pipeline_config.runtime.device_graph_capture,
            head=output_head(model_config.tie_word_embeddings),
            stream=importance.GEMMA3,
            mlp_activation=model_config.hidden_activation,
        )
        model_config.projection_plan = prepared.plan
        return with_next_norms(prepared.state_dict, LANGUAGE_PREFIX, model_config.num_hidden_layers)

    def _instantiate_module(self, model_config: AttnQuantGemma3Config) -> Any:
        with default_device(single_device_mesh(self.devices)):
            module = Gemma3(model_config, self.kv_params)
            use_projections(
                module.language_model,
                model_config.projection_plan,
                text_config=model_config,
                head=output_head(model_config.tie_word_embeddings),
                layer_subgraphs=layer_subgraphs_of(self, model_config.attnquant),
                norm_kernel=norm_kernel_of(self, model_config.attnquant, model_config.hidden_size, model_config.dtype),
            )
        return module


class AttnQuantGemma3MultiModalModel(Gemma3MultiModalModelV3):
    """MAX's ModuleV3 Gemma 3 text + vision, its language model ours.

    Device graph capture replays the language graph on decode steps (see
    ``AttnQuantGemma3MultiModalInputs``): a step with images, always a
    prefill, runs eagerly through :meth:`execute`, vision tower first.
    """

    model_config_cls: ClassVar[type[Any]] = AttnQuantGemma3MultiModalConfig
    batch_processor_cls: ClassVar[type[AttnQuantGemma3MultiModalBatchProcessor]] = (
        AttnQuantGemma3MultiModalBatchProcessor
    )

    @property
    def model(self) -> Any:
        """The compiled language graph: what MAX's device graph capture
        captures and replays (it looks for ``model``)."""
        return self.language_model

    @property
    def vision_on_device(self) -> bool:
        """Whether MAX's vision tower can run here (it is GPU-only)."""
        return not self.devices[0].is_host

    def _load_state_dict(self) -> dict[str, Any]:
        weights = dict(self.weights.items())
        self._language_weights_dict = weight_adapters.convert_multimodal_language_state_dict(weights)
        self._vision_weights_dict = weight_adapters.convert_multimodal_vision_state_dict(weights)
        return {name: value.data() for name, value in weights.items()}

    def _create_model_config(self, state_dict: dict[str, Any]) -> AttnQuantGemma3MultiModalConfig:
        device = self.devices[0]
        single_device_mesh(self.devices)
        config = AttnQuantGemma3MultiModalConfig.initialize_from_config(
            self.pipeline_config, self.huggingface_config, max_seq_len=self.max_seq_len
        )
        # The language tensors under our names, whatever the checkpoint's
        # layout: MAX ties the head when language_model.lm_head.weight is absent.
        config.finalize(
            huggingface_config=self.huggingface_config,
            state_dict=self._language_weights_dict,
            return_logits=self.return_logits,
        )
        prepared = prepare_for_device(
            self._language_weights_dict,
            config.attnquant,
            weights=self.weights,
            num_layers=config.text_config.num_hidden_layers,
            dtype=config.dtype,
            device=device,
            graph_capture=self.pipeline_config.runtime.device_graph_capture,
            head=output_head(config.text_config.tie_word_embeddings),
            stream=importance.GEMMA3,
            mlp_activation=config.text_config.hidden_activation,
        )
        self._language_weights_dict = with_next_norms(
            prepared.state_dict, LANGUAGE_PREFIX, config.text_config.num_hidden_layers
        )
        config.projection_plan = prepared.plan
        logger.info(self._describe_vision_tower())
        self.config = config
        return config

    def _describe_vision_tower(self) -> str:
        tensors = self._vision_weights_dict.values()
        mib = sum(math.prod(int(d) for d in t.shape) * t.dtype.size_in_bytes for t in tensors) / 2**20
        where = (
            "it runs on the GPU"
            if self.vision_on_device
            else "not compiled: MAX's runs on GPU only, so this CPU server serves text and refuses image requests"
        )
        return (
            f"attnquant gemma3: vision tower and projector ({len(tensors)} tensors, {mib:.1f} MiB) "
            f"are MAX's, unquantized; {where}"
        )

    def _compile_vision_model(  # type: ignore[override]
        self, model_config: AttnQuantGemma3MultiModalConfig, state_dict: dict[str, Any]
    ) -> Any | None:
        """MAX's vision tower, or None on CPU (MAX's is GPU-only)."""
        if not self.vision_on_device:
            return None
        return super()._compile_vision_model(model_config, state_dict)

    def _compile_language_model(
        self, model_config: AttnQuantGemma3MultiModalConfig, state_dict: dict[str, Any]
    ) -> Any:
        mesh = single_device_mesh(self.devices)
        with F.lazy(), default_dtype(model_config.dtype), default_device(mesh):
            module = Gemma3LanguageModel(model_config, self.kv_params)
            use_projections(
                module.language_model,
                model_config.projection_plan,
                text_config=model_config.text_config,
                head=output_head(model_config.text_config.tie_word_embeddings),
                layer_subgraphs=layer_subgraphs_of(self, model_config.attnquant),
                norm_kernel=norm_kernel_of(
                    self, model_config.attnquant, model_config.text_config.hidden_size, model_config.dtype
                ),
            )
        assert isinstance(self._batch_processor, AttnQuantGemma3MultiModalBatchProcessor)
        input_types = self._batch_processor.get_language_symbolic_inputs(
            kv_params=self.kv_params,
            device_ref=DeviceRef.from_device(self.devices[0]),
            hidden_size=model_config.text_config.hidden_size,
        )
        return module.compile(*input_types, weights=state_dict)

    def execute(self, model_inputs: ModelInputs) -> ModelOutputs:
        """MAX's: the vision tower for a step with images, then the language graph."""
        inputs = cast(Gemma3MultiModalModelInputs, model_inputs)
        if inputs.has_vision_inputs and self.vision_model is None:
            # The tokenizer refuses these first (HTTP 400); this keeps the
            # model from running a batch whose images nothing can encode.
            raise ValueError(IMAGES_NEED_A_GPU)
        return super().execute(model_inputs)
