"""Gemma 3 pipeline model: MAX's ModuleV3 Gemma 3 with attnquant projections.

Load time (``_prepare_state_dict``) runs attnquant's pipeline once: theta ->
W_eff -> optional NVFP4 -> fused run-time layout, converted for the device.
Build time (``_instantiate_module``) builds MAX's Gemma 3 and swaps each
layer's attention and MLP for modules made from the resulting projection plan.
"""

from __future__ import annotations

from typing import Any, ClassVar

from max.experimental.sharding import DeviceMesh
from max.experimental.tensor import default_device
from max.pipelines.architectures.gemma3_modulev3.gemma3 import Gemma3
from max.pipelines.architectures.gemma3_modulev3.model import Gemma3Model

from attnquant.graph.theta import shared_blocks

from attnquant.load import importance
from attnquant.load.head import OutputHead

from ..common.mlp import build_mlp
from ..common.prepare import prepare_for_device, use_output_head
from .inputs import AttnQuantGemma3BatchProcessor
from .layers.attention import ProjectedGemma3Attention
from .model_config import AttnQuantGemma3Config


class AttnQuantGemma3Model(Gemma3Model):
    model_config_cls: ClassVar[type[Any]] = AttnQuantGemma3Config
    batch_processor_cls: ClassVar[type[AttnQuantGemma3BatchProcessor]] = (
        AttnQuantGemma3BatchProcessor
    )

    def _create_model_config(self, state_dict: dict[str, Any]) -> AttnQuantGemma3Config:
        if len(self.devices) != 1:
            raise ValueError(
                f"attnquant serves on one device; got {len(self.devices)} "
                "(tensor parallelism is not supported yet): pass one --devices entry"
            )
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
            head=output_head(model_config),
            stream=importance.GEMMA3,
        )
        model_config.projection_plan = prepared.plan
        return prepared.state_dict

    def _instantiate_module(self, model_config: AttnQuantGemma3Config) -> Any:
        mesh = DeviceMesh(tuple(self.devices), (len(self.devices),), ("tp",))
        plan = model_config.projection_plan
        with default_device(mesh), shared_blocks():
            module = Gemma3(model_config, self.kv_params)
            for i, block in enumerate(module.language_model.layers):
                prefix = f"language_model.layers.{i}"
                block.self_attn = ProjectedGemma3Attention(
                    block.self_attn,
                    qkv=plan[f"{prefix}.self_attn.qkv_proj"],
                    o=plan[f"{prefix}.self_attn.o_proj"],
                )
                block.mlp = build_mlp(
                    gate_up=plan[f"{prefix}.mlp.gate_up_proj"],
                    down=plan[f"{prefix}.mlp.down_proj"],
                    activation=model_config.hidden_activation,
                )
            use_output_head(module.language_model, plan[output_head(model_config).group])
        return module


def output_head(model_config: AttnQuantGemma3Config) -> OutputHead:
    """Our Gemma 3's output head: ``lm_head`` beside the embedding, tied unless
    the checkpoint has a head of its own (MAX's rule, ``finalize``)."""
    return OutputHead(
        "language_model.lm_head", "language_model.embed_tokens.weight", tied=model_config.tie_word_embeddings
    )
