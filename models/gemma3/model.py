"""Gemma 3 pipeline model: MAX's ModuleV3 Gemma 3 with attnquant projections.

Load time runs attnquant's pipeline once over the language weights: theta ->
W_eff -> optional NVFP4 -> fused run-time layout, converted for the device.
Build time builds MAX's Gemma 3 text model and swaps each layer's attention
and MLP for modules made from the resulting projection plan
(:func:`use_projections`), and computes the output head through attnquant.

``AttnQuantGemma3Model``: the text line (``Gemma3ForCausalLM``); load in
``_prepare_state_dict``, build in ``_instantiate_module``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from max.experimental.sharding import DeviceMesh
from max.experimental.tensor import default_device
from max.pipelines.architectures.gemma3_modulev3.gemma3 import Gemma3, Gemma3TextModel
from max.pipelines.architectures.gemma3_modulev3.model import Gemma3Model
from max.pipelines.architectures.gemma3_modulev3.model_config import Gemma3Config

from attnquant.graph.theta import shared_blocks
from attnquant.load.head import OutputHead
from attnquant.max_compat import gemma3_attention_scale
from attnquant.plan import ProjectionPlan

from ..common.mlp import build_mlp
from ..common.prepare import prepare_for_device, use_output_head
from .inputs import AttnQuantGemma3BatchProcessor
from .layers.attention import ProjectedGemma3Attention
from .model_config import AttnQuantGemma3Config

LANGUAGE_PREFIX = "language_model."
"""Where MAX's module tree keeps the text decoder; the names attnquant
prepares (and caches) the language weights under."""


def output_head(tied: bool) -> OutputHead:
    """Our Gemma 3's output head: ``lm_head`` beside the embedding, tied unless
    the checkpoint has a head of its own (MAX's rule, ``finalize``)."""
    return OutputHead(f"{LANGUAGE_PREFIX}lm_head", f"{LANGUAGE_PREFIX}embed_tokens.weight", tied=tied)


def use_projections(
    text_model: Gemma3TextModel, plan: ProjectionPlan, *, text_config: Gemma3Config, head: OutputHead
) -> None:
    """Swaps every decoder layer's attention and MLP of MAX's ``Gemma3TextModel``
    for plan-built ones, and computes its output head through attnquant.

    ``plan`` is keyed by ``LANGUAGE_PREFIX`` names; ``text_config`` is the
    one ``text_model`` was built from. Call it in the build context
    (``F.lazy()``, dtype, device) that built ``text_model``.
    """
    scale = gemma3_attention_scale(text_config.query_pre_attn_scalar, text_config.head_dim)
    activation = text_config.hidden_activation
    with shared_blocks():
        for i, block in enumerate(text_model.layers):
            layer = f"{LANGUAGE_PREFIX}layers.{i}"
            block.self_attn = ProjectedGemma3Attention(
                block.self_attn,
                qkv=plan[f"{layer}.self_attn.qkv_proj"],
                o=plan[f"{layer}.self_attn.o_proj"],
                scale=scale,
            )
            block.mlp = build_mlp(
                gate_up=plan[f"{layer}.mlp.gate_up_proj"],
                down=plan[f"{layer}.mlp.down_proj"],
                activation=activation,
            )
        use_output_head(text_model, plan[head.group])


def single_device_mesh(devices: list[Any]) -> DeviceMesh:
    if len(devices) != 1:
        raise ValueError(
            f"attnquant serves on one device; got {len(devices)} "
            "(tensor parallelism is not supported yet): pass one --devices entry"
        )
    return DeviceMesh(tuple(devices), (1,), ("tp",))


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
        )
        model_config.projection_plan = prepared.plan
        return prepared.state_dict

    def _instantiate_module(self, model_config: AttnQuantGemma3Config) -> Any:
        with default_device(single_device_mesh(self.devices)):
            module = Gemma3(model_config, self.kv_params)
            use_projections(
                module.language_model,
                model_config.projection_plan,
                text_config=model_config,
                head=output_head(model_config.tie_word_embeddings),
            )
        return module
