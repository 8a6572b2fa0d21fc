"""A random-weight Gemma 3 checkpoint at a real geometry, with a synthetic tokenizer.

``python bench/checkpoints/make_random_gemma3.py OUT_DIR [--geometry 1b]`` writes
config.json, bf16 N(0, 0.02) weights and a word-level tokenizer with a chat
template (``bench/checkpoints/random_checkpoint.py``). For benchmarks only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from random_checkpoint import GEMMA_ROLES, write_random_weights, write_word_tokenizer

GEOMETRIES = {
    # google/gemma-3-1b-it's text geometry.
    "1b": dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    ),
}  # fmt: skip
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)


def write_config(out: Path, geometry: dict) -> dict:
    from transformers import Gemma3TextConfig

    n = geometry["num_hidden_layers"]
    config = Gemma3TextConfig(
        **geometry,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
        max_position_embeddings=32768,
        query_pre_attn_scalar=256,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config.architectures = ["Gemma3ForCausalLM"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)
    return json.loads((out / "config.json").read_text())


def write_weights(out: Path, device: str) -> int:
    from transformers import AutoConfig, Gemma3ForCausalLM

    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Gemma3ForCausalLM(config).state_dict().items()}
    shapes.pop("lm_head.weight")  # tied to the embedding
    # Gemma 3 norms scale by (1 + w): zeros are the identity.
    return write_random_weights(out, shapes, device, lambda n: 0.0 if n.endswith("norm.weight") else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    geometry = GEOMETRIES[args.geometry]
    write_config(args.out, geometry)
    write_weights(args.out, args.device)
    write_word_tokenizer(
        args.out, geometry["vocab_size"], SPECIALS, CHAT_TEMPLATE,
        GEMMA_ROLES,
    )  # fmt: skip
    print(f"wrote random Gemma 3 {args.geometry} to {args.out}")


if __name__ == "__main__":
    main()
