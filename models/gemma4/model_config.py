"""Gemma 4 configuration: MAX's, plus the variants we refuse and our load-time plan.

MAX reads the Hugging Face config in ``initialize_from_config``, which it
calls while planning memory, before any weight is read; the checks here run
there, so an unsupported checkpoint fails in seconds, not after a compile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from max.pipelines.architectures.gemma4.model_config import (
    Gemma4ForConditionalGenerationConfig,
)
from max.pipelines.lib import PipelineConfig
from transformers import AutoConfig
from typing_extensions import Self

from ..common.prepare import AttnQuantFields, attach_settings

# Text-config fields MAX's Gemma4TextConfig reads that transformers'
# ``Gemma4UnifiedTextConfig`` (the google/gemma-4-12B-it line) does not
# define, with the value that means "feature absent" (what the regular
# Gemma 4 config says for a dense model without per-layer embeddings).
_UNIFIED_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size_per_layer_input": 0,
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
}


def fill_unified_text_defaults(text_config: Any) -> None:
    """Adds the fields MAX reads but a ``gemma4_unified`` text config lacks.

    Without them MAX's config raises ``AttributeError: 'Gemma4UnifiedTextConfig'
    object has no attribute 'hidden_size_per_layer_input'``.
    """
    for name, absent in _UNIFIED_TEXT_DEFAULTS.items():
        if not hasattr(text_config, name):
            setattr(text_config, name, absent)


def unsupported_features(huggingface_config: Any) -> list[str]:
    """What in this Gemma 4 config attnquant does not serve (empty: all fine).

    Each entry names the field, its value and why, so the error can be acted on.
    """
    text = huggingface_config.text_config
    problems = []
    quantization = getattr(huggingface_config, "quantization_config", None) or {}
    if not isinstance(quantization, dict):  # transformers may hand a config object
        quantization = quantization.to_dict()
    declared = (str(quantization.get("quant_method", "")).lower(), str(quantization.get("quant_algo", "")).upper())
    if quantization and declared != ("modelopt", "NVFP4"):
        problems.append(
            f"quantization_config {declared[0] or '?'}/{declared[1] or '?'}: attnquant serves bf16 checkpoints "
            "(quantized at load) and ModelOpt NVFP4 ones"
        )
    if getattr(text, "enable_moe_block", False) or (getattr(text, "num_experts", 0) or 0) > 0:
        problems.append(
            f"enable_moe_block={getattr(text, 'enable_moe_block', None)}, "
            f"num_experts={getattr(text, 'num_experts', None)} (mixture-of-experts "
            "layers, e.g. gemma-4-26B-A4B): only dense MLPs are quantized"
        )
    if (getattr(text, "hidden_size_per_layer_input", 0) or 0) > 0:
        problems.append(
            f"hidden_size_per_layer_input={text.hidden_size_per_layer_input} "
            "(per-layer input embeddings, e.g. gemma-4-E2B/E4B)"
        )
    if (getattr(text, "num_kv_shared_layers", 0) or 0) > 0:
        problems.append(
            f"num_kv_shared_layers={text.num_kv_shared_layers} (KV sharing across layers)"
        )
    if getattr(text, "use_double_wide_mlp", False):
        problems.append("use_double_wide_mlp=True")
    if getattr(text, "use_bidirectional_attention", None) == "all":
        problems.append("use_bidirectional_attention='all' (a non-causal encoder)")
    return problems


def check_supported(huggingface_config: Any) -> None:
    """Raises ValueError naming every unsupported feature of the checkpoint."""
    problems = unsupported_features(huggingface_config)
    if problems:
        raise ValueError(
            "attnquant does not serve this Gemma 4 checkpoint: "
            + "; ".join(problems)
            + ". Serve a dense bfloat16 Gemma 4 (31B, 12B) with attnquant, or this "
            "one with MAX's own architecture (drop --custom-architectures attnquant)."
        )


@dataclass(kw_only=True)
class AttnQuantGemma4Config(AttnQuantFields, Gemma4ForConditionalGenerationConfig):
    """MAX's Gemma 4 config that also runs in float32 and refuses what we cannot serve.

    MAX refuses bfloat16 on CPU, so CPU runs use ``--quantization-encoding
    float32`` (``run_max.py`` adds it). ``float4_e2m1fnx2`` is the encoding
    MAX gives a checkpoint stored as ModelOpt NVFP4: its NVFP4 projections are
    served as stored, everything else in bf16.
    """

    @classmethod
    def initialize_from_config(
        cls,
        pipeline_config: PipelineConfig,
        huggingface_config: AutoConfig,
        *,
        max_seq_len: int,
    ) -> Self:
        fill_unified_text_defaults(huggingface_config.text_config)
        check_supported(huggingface_config)
        config = super().initialize_from_config(pipeline_config, huggingface_config, max_seq_len=max_seq_len)
        return attach_settings(config)
