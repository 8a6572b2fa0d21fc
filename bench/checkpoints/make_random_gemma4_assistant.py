"""A random Gemma 4 assistant (MTP drafter) for a random Gemma 4 target, and the target's MTP twin.

``python bench/checkpoints/make_random_gemma4_assistant.py TARGET_DIR OUT_DIR --mtp-target MTP_DIR``

* ``OUT_DIR``: the assistant, at google/gemma-4-31B-it-assistant's geometry
  by default (hidden 1024, 4 layers: 3 sliding + 1 full, 32 query heads,
  intermediate 8192), with the target's vocabulary, head sizes, sliding window
  and tokenizer. No k/v projections and no LM head: MAX's assistant attends
  over the target's KV cache (its last layer of each attention type) and ties
  its output to its embedding. ``pre_projection`` takes the target's hidden
  state and the token's embedding ([hidden, 2 × target hidden]);
  ``post_projection`` maps back to the target's width.
* ``MTP_DIR``: the target again (its files linked, not copied) with
  ``architectures`` set to ``Gemma4ForConditionalGeneration``: MAX rewrites
  only that name to its fused MTP model (``UnifiedMTPGemma4ForCausalLM``,
  which attnquant registers too). The config's ``model_type`` stays
  ``gemma4_unified``, so MAX builds no vision tower. No real checkpoint
  pairs the two; it serves the 31B text geometry's speculative path without
  the vision geometry, which these benchmarks do not have.

What MAX 26.7 reads (``unified_mtp_gemma4/model.py``, ``_create_draft_config``):
every size from the assistant's ``text_config``, and the backbone width from
the *target*. Weights are random (``random_checkpoint``): the drafter's
guesses are noise, so the acceptance rate measures nothing; the run shows
that the speculative path serves with our target, and what it costs.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

from make_random_gemma4 import initial_fill  # this directory: same fills, same zeroed special rows
from random_checkpoint import write_random_weights

ASSISTANT_31B = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=32, intermediate_size=8192)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MTP_ARCHITECTURE = "Gemma4ForConditionalGeneration"


def build_config(target: dict, geometry: dict):
    """The assistant's transformers config for the target's ``config.json``."""
    from transformers import Gemma4AssistantConfig

    text = target["text_config"]
    heads = geometry["num_attention_heads"]
    for kv_heads in (text["num_key_value_heads"], text.get("num_global_key_value_heads") or 1):
        # Each query head reads one of the target's cached KV heads.
        if heads % kv_heads:
            raise ValueError(f"{heads} assistant heads: not a multiple of the target's {kv_heads} KV heads")
    layers = geometry["num_hidden_layers"]
    shared = ("vocab_size", "head_dim", "global_head_dim", "num_key_value_heads",
              "num_global_key_value_heads", "attention_k_eq_v", "sliding_window",
              "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "final_logit_softcapping")  # fmt: skip
    config = Gemma4AssistantConfig(
        text_config={
            **{key: text[key] for key in shared if key in text},
            **geometry,
            "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
        },
        backbone_hidden_size=text["hidden_size"],
    )
    config.architectures = ["Gemma4AssistantForCausalLM"]
    return config


def write_assistant(target_dir: Path, out: Path, geometry: dict) -> int:
    """Writes config, random bf16 weights and the target's tokenizer; returns bytes."""
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import (
        Gemma4AssistantForCausalLM,
    )

    config = build_config(json.loads((target_dir / "config.json").read_text()), geometry)
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(config)
    shapes = {k: v.shape for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    total = write_random_weights(out, shapes, initial_fill)
    for name in TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)
    return total


def link_mtp_target(target_dir: Path, out: Path) -> None:
    """``out``: ``target_dir``'s files linked, its config naming the MTP architecture."""
    out.mkdir(parents=True, exist_ok=True)
    for path in target_dir.iterdir():
        if path.name != "config.json" and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    config = json.loads((target_dir / "config.json").read_text())
    config["architectures"] = [MTP_ARCHITECTURE]
    (out / "config.json").write_text(json.dumps(config, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="a make_random_gemma4.py checkpoint")
    parser.add_argument("out", type=Path)
    parser.add_argument("--mtp-target", type=Path, help="also write the target's MTP twin here")
    args = parser.parse_args()
    total = write_assistant(args.target, args.out, ASSISTANT_31B)
    print(f"wrote a random Gemma 4 assistant ({total / 1e9:.2f} GB) to {args.out}")
    if args.mtp_target:
        link_mtp_target(args.target, args.mtp_target)
        print(f"linked {args.target} as {MTP_ARCHITECTURE} at {args.mtp_target}")


if __name__ == "__main__":
    main()
