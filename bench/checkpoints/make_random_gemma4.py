"""A random-weight Gemma 4 checkpoint at the 31B text geometry, with a synthetic tokenizer.

``python bench/checkpoints/make_random_gemma4.py OUT_DIR [--layers 60]`` writes the
text-only ``Gemma4UnifiedForConditionalGeneration`` line (the line MAX and
attnquant serve without a vision tower; MAX still reads a small
``vision_config``): hidden 5376, intermediate 21504, sliding layers with 32
query / 16 KV heads of 256, every sixth layer full attention with heads of
512 and k = v (``attention_k_eq_v``: no ``v_proj``), vocab 262144, tied
embeddings. ``--layers`` keeps the 5:1 pattern with fewer layers when the disk
or the lease demands it. Weights and tokenizer: ``bench/checkpoints/random_checkpoint.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from random_checkpoint import GEMMA_ROLES, Noise, write_random_weights, write_word_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.gemma4_fixtures import IMAGE_IDS, SPECIAL_TOKENS, TINY_VISION  # noqa: E402

GEOMETRY_31B = dict(
    vocab_size=262144, hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
    num_attention_heads=32, num_key_value_heads=16, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
    sliding_window=1024, max_position_embeddings=8192, final_logit_softcapping=30.0,
)  # fmt: skip
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n"
    "{{ m['content'] }}<turn|>\n{% endfor %}<|turn>model\n"
)


def build_config(layers: int):
    from transformers import Gemma4UnifiedConfig

    text = dict(GEOMETRY_31B, num_hidden_layers=layers)
    text["layer_types"] = [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
    ]
    return Gemma4UnifiedConfig(
        text_config=text, vision_config=TINY_VISION, tie_word_embeddings=True, **IMAGE_IDS
    )


def write_weights(out: Path, config) -> int:
    from transformers.models.gemma4_unified.modeling_gemma4_unified import (
        Gemma4UnifiedForConditionalGeneration,
    )

    with torch.device("meta"):
        model = Gemma4UnifiedForConditionalGeneration(config)
        shapes = {k: v.shape for k, v in model.state_dict().items() if not k.startswith("lm_head.")}
    return write_random_weights(out, shapes, initial_fill)


# The input embedding is scaled by sqrt(hidden) = 73, so at N(0, 0.02) each
# token's own logit (~ std^2 hidden^1.5 / sqrt(2 layers)) beats the best of
# 262144 random ones (~ 5 std sqrt(hidden)): the model only repeats its last
# input token. After a chat prompt (last token <unk>) that is a special token,
# which streams no text, and `max benchmark` fails with "No text content
# captured" (seen on the H200, 2026-12-01). Measured in transformers at 6 layers,
# last token w1234: own logit 26.1, next best 7.3 at std 0.02; own 0.59, best
# 0.68 at 0.002 (the own term shrinks as 1/sqrt(layers) beside the rest).
# Specials' rows (and the bare "▁") are zero: logit 0, never the argmax.
EMBEDDING = Noise(std=0.002, zero_rows=len(SPECIAL_TOKENS) + 1)  # + the bare "▁"


def initial_fill(name: str) -> float | Noise | None:
    if name.endswith(("norm.weight", "layer_scalar")):
        return 1.0  # Gemma 4 norms and layer scalars multiply: ones are the identity
    return EMBEDDING if name.endswith("embed_tokens.weight") else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=60)
    args = parser.parse_args()
    if args.layers < 6 or args.layers % 6:
        parser.error(f"--layers {args.layers}: use a multiple of 6 (5 sliding : 1 full)")
    args.out.mkdir(parents=True, exist_ok=True)
    config = build_config(args.layers)
    config.architectures = ["Gemma4UnifiedForConditionalGeneration"]
    # MAX's graph-API Gemma 4 reads attributes of the regular (non-unified)
    # text config even for the unified line (seen on the H200, 2026-12-01):
    # no per-layer inputs (width 0), no MoE block.
    config.text_config.vocab_size_per_layer_input = GEOMETRY_31B["vocab_size"]
    config.text_config.hidden_size_per_layer_input = 0
    config.text_config.enable_moe_block = False
    config.save_pretrained(args.out)
    total = write_weights(args.out, config)
    write_word_tokenizer(
        args.out, GEOMETRY_31B["vocab_size"], SPECIAL_TOKENS, CHAT_TEMPLATE,
        GEMMA_ROLES,
    )  # fmt: skip
    print(f"wrote random Gemma 4 31B geometry, {args.layers} layers, {total / 1e9:.1f} GB, to {args.out}")


if __name__ == "__main__":
    main()
