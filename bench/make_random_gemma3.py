"""A random-weight Gemma 3 checkpoint at a real geometry, with a synthetic tokenizer.

``python bench/make_random_gemma3.py OUT_DIR [--geometry 1b]`` writes
config.json, model.safetensors (bf16, N(0, 0.02)) and a word-level tokenizer
whose pieces start with "▁" (``max benchmark --dataset-name random`` decodes
random ids and needs such a piece) and which has a chat template (the chat
endpoint needs one). For benchmarks only: the text it produces is noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

GEOMETRIES = {
    # google/gemma-3-1b-it's text geometry.
    "1b": dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
    ),
}  # fmt: skip
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


def write_weights(out: Path, geometry: dict, device: str) -> None:
    from transformers import AutoConfig, Gemma3ForCausalLM

    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Gemma3ForCausalLM(config).state_dict().items()}
    generator = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        if name.endswith("norm.weight"):
            tensors[name] = torch.zeros(shape, dtype=torch.bfloat16)  # Gemma norms scale by 1 + w
            continue
        w = torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02
        tensors[name] = w.to(torch.bfloat16).cpu()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab |= {f"▁w{i}": i for i in range(len(specials), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", unk_token="<unk>", additional_special_tokens=specials[4:],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    geometry = GEOMETRIES[args.geometry]
    write_config(args.out, geometry)
    write_weights(args.out, geometry, args.device)
    write_tokenizer(args.out, geometry["vocab_size"])
    print(f"wrote random Gemma 3 {args.geometry} to {args.out}")


if __name__ == "__main__":
    main()
