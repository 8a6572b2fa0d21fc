"""Gemma 4 with a drafter: the names MAX rewrites the target to, served by us.

With ``--draft-model``, MAX renames a Gemma 4 target before looking it up
(``_apply_speculative_target_architecture`` in ``max/pipelines/lib/config/
config.py``) and serves a fused target+draft graph under the new name. Were
that name left to MAX, adding a drafter would silently serve MAX's
unquantized target. So:

* a Gemma 4 assistant (MTP) drafter -> ``UnifiedMTPGemma4ForCausalLM``: MAX's
  ModuleV3 fused MTP model, with our projections in its target;
* a DSpark or DFlash drafter -> ``UnifiedDSparkGemma4_31BForCausalLM``,
  ``UnifiedDflashGemma4_31BForCausalLM``, ``UnifiedDSparkGemma4_12BForCausalLM``:
  MAX has those only as graph-API models, whose layers cannot take our
  ModuleV3 projections; they are refused, before any weight is read.
"""

from __future__ import annotations

from typing import Any, ClassVar

from max.driver import Device

from max.experimental import functional as F
from max.experimental.tensor import Tensor, default_device, default_dtype
from max.graph.weights import WeightData, Weights
from max.pipelines.architectures.gemma4.model_config import (
    Gemma4ForConditionalGenerationConfig,
)
from max.pipelines.architectures.unified_mtp_gemma4_modulev3.gemma4_assistant_modulev3 import (
    Gemma4AssistantModuleV3,
)
from max.pipelines.architectures.unified_mtp_gemma4_modulev3.model import (
    UnifiedMTPGemma4ModuleV3Model,
)
from max.pipelines.architectures.unified_mtp_gemma4_modulev3.unified_mtp_gemma4_modulev3 import (
    UnifiedMTPGemma4ModuleV3,
)
from max.pipelines.lib import PipelineConfig
from transformers import AutoConfig
from typing_extensions import Self

from attnquant.graph.matmul import on_full_row_tiles, run_on_padded_rows
from attnquant.max_compat import SM90_ROW_TILE, RowPadding
from attnquant.plan import ProjectionPlan

from .model import (
    LANGUAGE_PREFIX,
    AttnQuantGemma4Model,
    logger,
    prepare_language_weights,
    use_projections,
)
from ..common.layer_boundary import norm_kernel_of
from ..common.layer_subgraphs import layer_subgraphs_of
from ..common.prepare import attach_settings, single_device_mesh
from .model_config import AttnQuantGemma4Config

MTP_TARGET = "UnifiedMTPGemma4ForCausalLM"
REFUSED_TARGETS = (
    "UnifiedDSparkGemma4_31BForCausalLM",
    "UnifiedDflashGemma4_31BForCausalLM",
    "UnifiedDSparkGemma4_12BForCausalLM",
)


def prepare_target_weights(
    target: dict[str, Any],
    config: AttnQuantGemma4Config,
    checkpoint: Weights,
    device: Device,
    graph_capture: bool | None = None,
) -> tuple[dict[str, Any], ProjectionPlan]:
    """The MTP target's served weights (its bare names) and their plan.

    Prepared under the ModuleV3 tree's names, as ``AttnQuantGemma4Model``
    does: the quantized-weight cache is keyed by checkpoint and settings, not
    names, and ``ATTNQUANT_QUANT_IGNORE`` fragments must mean the same with
    and without a drafter. The plan keeps the prefixed names.
    """
    prepared = prepare_language_weights(
        {LANGUAGE_PREFIX + name: value for name, value in target.items()}, config, checkpoint, device,
        graph_capture=graph_capture,
    )  # fmt: skip
    served = {
        name.removeprefix(LANGUAGE_PREFIX): value for name, value in prepared.state_dict.items()
    }
    return served, prepared.plan


def with_target_weights(
    weights: dict[str, WeightData], target: dict[str, Any]
) -> dict[str, Any]:
    """MAX's fused-module weights with the target's replaced by ours.

    The draft shares the target's embedding module, so its
    ``draft.embed_tokens.weight`` entry must be the served embedding too.
    """
    merged = {k: v for k, v in weights.items() if not k.startswith("target.")}
    merged.update({f"target.{k}": v for k, v in target.items()})
    merged["draft.embed_tokens.weight"] = target["embed_tokens.weight"]
    return merged


class RowPaddedAssistant(Gemma4AssistantModuleV3):
    """MAX's assistant with its tied output head on padded rows."""

    def _tied_logits(self, h: Tensor) -> Tensor:
        return on_full_row_tiles(super()._tied_logits, h, RowPadding.FIXED)


def pad_draft_rows(draft: Gemma4AssistantModuleV3) -> None:
    """Runs every MAX matmul of the drafter on padded token rows, as ours run.

    The drafter is MAX's, unquantized, and its matmuls are MAX's: in prefill
    they see one row per prompt token (2 to 63 for a short prompt), the row
    counts where MAX 26.7's sm_90 matmul writes past its output
    (``attnquant.max_compat``) into whatever the fused graph holds next.
    """
    run_on_padded_rows(draft.pre_projection)
    run_on_padded_rows(draft.post_projection)
    for layer in draft.layers:
        run_on_padded_rows(layer.self_attn.q_proj)
        run_on_padded_rows(layer.self_attn.o_proj)
        run_on_padded_rows(layer.mlp)
    draft.__class__ = RowPaddedAssistant
    logger.info(
        "attnquant: the MTP drafter's matmuls (MAX's) run on token rows padded to a multiple "
        "of %d, as ours do", SM90_ROW_TILE,
    )


def plan_row_padding(plan: ProjectionPlan) -> RowPadding:
    """The row padding the device step chose for the plan's matmuls (one for all)."""
    return RowPadding(next(part.row_padding for parts in plan.values() for part in parts))


class AttnQuantUnifiedMTPGemma4Model(UnifiedMTPGemma4ModuleV3Model):
    """MAX's ModuleV3 Gemma 4 + MTP assistant, with attnquant projections in the target.

    The draft (the assistant: q-only attention into the target's cache) is
    MAX's, unquantized.
    """

    # MAX's base initializes this class first, in the model worker, from a
    # config it has just parsed; MAX's own class reads fields a
    # ``gemma4_unified`` text config lacks (AttributeError: no 'num_experts').
    # Ours fills them in that shared config object (so MAX's parse in
    # _create_model_config finds them) and refuses what we do not serve.
    model_config_cls: ClassVar[type[Any]] = AttnQuantGemma4Config

    _served_target: dict[str, Any]
    _projection_plan: ProjectionPlan

    def _create_model_config(
        self, state_dict: dict[str, Any]
    ) -> Gemma4ForConditionalGenerationConfig:
        single_device_mesh(self.devices)
        # MAX's body parses with its own config class, not model_config_cls:
        # the settings are ours to attach.
        config = attach_settings(super()._create_model_config(state_dict))
        # MAX's own build (kept raw in _target_state_dict) still runs; ours
        # replaces its target weights in _build_module.
        self._served_target, self._projection_plan = prepare_target_weights(
            self._target_state_dict, config, self.weights, self.devices[0],
            graph_capture=self.pipeline_config.runtime.device_graph_capture,
        )  # fmt: skip
        return config

    def _build_module(
        self, model_config: Gemma4ForConditionalGenerationConfig
    ) -> tuple[UnifiedMTPGemma4ModuleV3, dict[str, Any]]:
        module, weights = super()._build_module(model_config)
        mesh = single_device_mesh(self.devices)
        # The build context MAX's _build_module used for the target.
        with F.lazy(), default_dtype(model_config.dtype), default_device(mesh):
            use_projections(
                module.target,
                self._projection_plan,
                activation=model_config.text_config.hidden_activation,
                layer_subgraphs=layer_subgraphs_of(self, model_config.attnquant),
                norm_kernel=norm_kernel_of(
                    self, model_config.attnquant, model_config.text_config.hidden_size, model_config.dtype
                ),
            )
        if plan_row_padding(self._projection_plan) is not RowPadding.OFF:
            pad_draft_rows(module.draft)
        return module, with_target_weights(weights, self._served_target)


class RefusedDrafterConfig(AttnQuantGemma4Config):
    """Config of the drafter pairings we do not serve: refuses at initialization."""

    @classmethod
    def initialize_from_config(
        cls,
        pipeline_config: PipelineConfig,
        huggingface_config: AutoConfig,
        *,
        max_seq_len: int,
    ) -> Self:
        raise ValueError(refusal_message(pipeline_config))


def refusal_message(pipeline_config: PipelineConfig) -> str:
    draft = pipeline_config.draft_model
    draft_arch = (
        draft.huggingface_config.architectures[0]
        if draft is not None and draft.huggingface_config is not None
        else "unknown"
    )
    return (
        f"attnquant cannot serve Gemma 4 with a {draft_arch} drafter: MAX runs that pairing "
        f"as a graph-API fused model ({' / '.join(REFUSED_TARGETS)}) whose target layers "
        "cannot take attnquant's quantized projections, so it would serve unquantized "
        "weights. Use a Gemma 4 assistant drafter (Gemma4AssistantForCausalLM, MTP), "
        "serve without --draft-model, or drop --custom-architectures attnquant."
    )


class RefusedDrafterModel(AttnQuantGemma4Model):
    """Never builds: its config refuses first (also when MAX skips memory planning)."""

    model_config_cls = RefusedDrafterConfig
