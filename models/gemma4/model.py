"""Gemma 4 pipeline model: MAX's ModuleV3 Gemma 4 with attnquant projections.

Load time (``_create_model_config``, before either tower compiles) runs
attnquant's pipeline once over the language weights: theta -> W_eff ->
optional NVFP4 -> fused run-time layout, converted for the device. Build time
(``_compile_language_model``) builds MAX's Gemma 4 text model and swaps each
layer's attention and MLP for modules made from the resulting projection
plan. The vision tower, when the checkpoint has one, is MAX's, untouched.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

from max.driver import Device

from max.experimental import functional as F
from max.experimental.tensor import default_device, default_dtype
from max.graph import DeviceRef
from max.graph.weights import Weights
from max.pipelines.architectures.gemma4_modulev3.batch_processor import (
    Gemma4ModuleV3BatchProcessor,
)
from max.pipelines.architectures.gemma4_modulev3.gemma4 import Gemma4, Gemma4TextModel
from max.pipelines.architectures.gemma4_modulev3.model import Gemma4Model

from attnquant.config import LOGGER_NAME
from attnquant.graph.residual_norm import NormKernel
from attnquant.graph.theta import shared_blocks
from attnquant.load import importance
from attnquant.load.head import OutputHead
from attnquant.load.pipeline import PreparedWeights
from attnquant.plan import ProjectionPlan

from ..common.layer_boundary import adopt, hand_on_input_norms, norm_kernel_of, with_next_norms
from ..common.layer_subgraphs import LAYER_GROUPS, LayerSubgraphs, SubgraphChoice, layer_subgraphs_of
from ..common.mlp import build_mlp
from ..common.prepare import prepare_for_device, single_device_mesh, use_output_head
from .inputs import AttnQuantGemma4BatchProcessor
from .layers.attention import ProjectedGemma4Attention, check_qkv_widths
from .layers.decoder_layer import Gemma4DecoderLayer
from .model_config import AttnQuantGemma4Config
from .weight_adapters import bare_nvfp4_names, check_language_tensors


logger = logging.getLogger(LOGGER_NAME)

# Where MAX's ModuleV3 Gemma 4 keeps its text decoder; the names attnquant
# prepares (and caches) the language weights under, in every Gemma 4 path.
LANGUAGE_PREFIX = "language_model."


def prepare_language_weights(
    weights: Mapping[str, Any],
    config: AttnQuantGemma4Config,
    checkpoint: Weights,
    device: Device,
    graph_capture: bool | None = None,
) -> PreparedWeights:
    """attnquant's load-time pipeline over one Gemma 4 language tower.

    ``weights`` are named as in MAX's ModuleV3 tree (``language_model.layers.N...``);
    the result keeps those names, with each layer's q|k(|v) and gate|up fused
    and its copy of the next input norm's weight (``common.layer_boundary``).
    """
    weights = bare_nvfp4_names(weights)
    check_language_tensors(weights)
    prepared = prepare_for_device(
        weights, config.attnquant, weights=checkpoint, num_layers=config.text_config.num_hidden_layers,
        dtype=config.dtype, device=device, graph_capture=graph_capture, head=output_head(config),
        stream=importance.GEMMA4, mlp_activation=config.text_config.hidden_activation,
    )  # fmt: skip
    logger.info(describe_projections(prepared.plan, config.text_config.layer_types))
    if config.vision_config is None:
        # With no vision tower, unquantized_dtype only types the (empty)
        # image-embedding input; keep it the served dtype so a float32 CPU
        # graph holds no bfloat16 tensor.
        config.unquantized_dtype = config.dtype
    served = with_next_norms(prepared.state_dict, LANGUAGE_PREFIX, config.text_config.num_hidden_layers)
    return dataclasses.replace(prepared, state_dict=served)


def output_head(config: AttnQuantGemma4Config) -> OutputHead:
    """Gemma 4's output head, tied to the embedding as MAX's config says."""
    return OutputHead(
        f"{LANGUAGE_PREFIX}lm_head", f"{LANGUAGE_PREFIX}embed_tokens.weight", tied=config.tie_word_embeddings
    )


def describe_projections(plan: ProjectionPlan, layer_types: list[str]) -> str:
    """One log line: the decoder layers' projections, and the layers whose k
    and v share one (the output head, also in the plan, is on the load line)."""
    members = [m for key, parts in plan.items() if ".layers." in key for part in parts for m in part.members]
    shared_kv = [
        i
        for i in range(len(layer_types))
        if not any(
            "v_proj" in part.members
            for key, parts in plan.items()
            if key.endswith(f"layers.{i}.self_attn.qkv_proj")
            for part in parts
        )
    ]
    full = layer_types.count("full_attention")
    return (
        f"attnquant gemma4: {len(members)} projections in {len(layer_types)} layers "
        f"({len(layer_types) - full} sliding, {full} full attention); "
        f"{len(shared_kv)} layers share k and v (attention_k_eq_v, no v_proj)"
        + (f": {shared_kv}" if shared_kv else "")
    )


def use_projections(
    text_model: Gemma4TextModel,
    plan: ProjectionPlan,
    *,
    activation: str,
    layer_subgraphs: SubgraphChoice,
    norm_kernel: NormKernel | bool,
) -> None:
    """Swaps every decoder layer's attention and MLP for plan-built ones,
    each layer ending with the next one's input norm (``common.layer_boundary``).

    ``text_model`` is MAX's ``Gemma4TextModel`` (the ModuleV3 tower, or the
    MTP target, a subclass); ``plan`` is keyed by ``LANGUAGE_PREFIX`` names;
    ``layer_subgraphs``: layers of one structure share a subgraph or not
    (``choose_layer_subgraphs``); ``norm_kernel``: the layers add and norm
    with attnquant's kernel (``norm_kernel_of``). Call it in the same build context
    (``F.lazy()``, dtype, device) that built ``text_model``.
    """
    subgraphs = LayerSubgraphs("gemma4", layer_subgraphs)
    with shared_blocks():
        for i, block in enumerate(text_model.layers):
            layer = f"{LANGUAGE_PREFIX}layers.{i}"
            groups = [plan[f"{layer}.{name}"] for name in LAYER_GROUPS]
            qkv, o, gate_up, down = groups
            check_qkv_widths(i, block.self_attn, qkv)
            block.self_attn = ProjectedGemma4Attention(block.self_attn, qkv=qkv, o=o)
            block.mlp = build_mlp(gate_up=gate_up, down=down, activation=activation)
            adopt(block, Gemma4DecoderLayer)
            subgraphs.share(block, "sliding" if block.self_attn.use_local else "full", groups)
        hand_on_input_norms(text_model.layers, text_model.norm, norm_kernel=norm_kernel)
        use_output_head(text_model, plan[f"{LANGUAGE_PREFIX}lm_head"])
    subgraphs.log()


class AttnQuantGemma4Model(Gemma4Model):
    model_config_cls: ClassVar[type[Any]] = AttnQuantGemma4Config
    batch_processor_cls: ClassVar[type[Gemma4ModuleV3BatchProcessor]] = (
        AttnQuantGemma4BatchProcessor
    )

    @property
    def model(self) -> Any:
        """The compiled language tower: what MAX's device graph capture
        captures and replays (it looks for ``model``; decode steps never run
        the vision tower)."""
        return self.language_model

    def _create_model_config(self, state_dict: dict[str, Any]) -> AttnQuantGemma4Config:
        single_device_mesh(self.devices)
        config = self.model_config_cls.initialize_from_config(
            self.pipeline_config, self.huggingface_config, max_seq_len=self.max_seq_len
        )
        config.finalize(
            huggingface_config=self.huggingface_config,
            state_dict=state_dict,
            return_logits=self.return_logits,
        )
        prepared = prepare_language_weights(
            self._language_weights_dict, config, self.weights, self.devices[0],
            graph_capture=self.pipeline_config.runtime.device_graph_capture,
        )  # fmt: skip
        self._language_weights_dict = prepared.state_dict
        config.projection_plan = prepared.plan
        self.config = config
        return config

    def _compile_language_model(
        self, model_config: AttnQuantGemma4Config, state_dict: dict[str, Any]
    ) -> Any:
        mesh = single_device_mesh(self.devices)
        with F.lazy(), default_dtype(model_config.dtype), default_device(mesh):
            module = Gemma4(model_config, self.kv_params, mesh)
            use_projections(
                module.language_model,
                model_config.projection_plan,
                activation=model_config.text_config.hidden_activation,
                layer_subgraphs=layer_subgraphs_of(self, model_config.attnquant),
                norm_kernel=norm_kernel_of(
                    self, model_config.attnquant, model_config.text_config.hidden_size, model_config.dtype
                ),
            )
        assert isinstance(self._batch_processor, Gemma4ModuleV3BatchProcessor)
        input_types = self._batch_processor.get_language_symbolic_inputs(
            kv_params=self.kv_params,
            device_ref=DeviceRef.from_device(self.devices[0]),
            hidden_size=model_config.text_config.hidden_size,
            embedding_dtype=model_config.unquantized_dtype,
        )
        return module.compile(*input_types, weights=state_dict)
