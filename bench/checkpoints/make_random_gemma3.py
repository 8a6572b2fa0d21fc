"""A random-weight Gemma 3 checkpoint at a real geometry, with a synthetic tokenizer.

``python bench/checkpoints/make_random_gemma3.py OUT_DIR [--geometry 1b|4b|27b] [--layers N]``
writes config.json, bf16 N(0, 0.02) weights and a word-level tokenizer with a
chat template (``bench/checkpoints/random_checkpoint.py``). 1b is
``Gemma3ForCausalLM`` (text only); 4b and 27b are
``Gemma3ForConditionalGeneration`` with the SigLIP vision tower at its real
geometry, tensors named as the Hub's google/gemma-3-*-it name them
(``language_model.model.*``, ``vision_tower.vision_model.*``,
``multi_modal_projector.*``), and the processor files MAX's text-and-vision
tokenizer reads (image tokens at low ids of the synthetic vocabulary).
``--layers`` keeps the first N decoder layers (a 62-layer 27B is 55 GB).
For benchmarks only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from random_checkpoint import GEMMA_ROLES, Noise, write_random_weights, write_word_tokenizer

GEOMETRIES = {
    # google/gemma-3-1b-it's text geometry.
    "1b": dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256,
    ),
    # google/gemma-3-4b-it's and google/gemma-3-27b-it's text geometries.
    "4b": dict(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
        query_pre_attn_scalar=256,
    ),
    "27b": dict(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
        query_pre_attn_scalar=168,
    ),
}  # fmt: skip
MULTIMODAL = ("4b", "27b")
# Their SigLIP tower (the same in 4B, 12B and 27B): 896-pixel images, 256 tokens each.
VISION = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
    image_size=896, patch_size=14, vision_use_head=False,
)  # fmt: skip
IMAGE_TOKENS = 256
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
IMAGE_SPECIALS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
HUB_NAMES = (  # transformers' module names -> the Hub checkpoints' tensor names
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# Gemma 3's turn markup; a message's content is a string or (an OpenAI chat
# request with an image) a list of parts, an image part rendered as the
# <start_of_image> marker the processor expands into the image's tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<start_of_image>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)


def text_config(geometry: dict):
    from transformers import Gemma3TextConfig

    n = geometry["num_hidden_layers"]
    return Gemma3TextConfig(
        **geometry,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)],
        max_position_embeddings=32768,
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip


def write_config(out: Path, geometry: dict, image_ids: dict[str, int] | None):
    """The model's config (``Gemma3ForConditionalGeneration`` with ``image_ids``)."""
    from transformers import Gemma3Config

    config = text_config(geometry)
    config.architectures = ["Gemma3ForCausalLM"]
    if image_ids is not None:
        config = Gemma3Config(
            text_config=config.to_dict(), vision_config=VISION, mm_tokens_per_image=IMAGE_TOKENS, **image_ids,
        )  # fmt: skip
        config.architectures = ["Gemma3ForConditionalGeneration"]
    config.torch_dtype = "bfloat16"
    config.save_pretrained(out)
    return config


def write_weights(out: Path, config, specials: int) -> int:
    """Random weights; the embedding rows of the first ``specials`` ids (the
    special tokens and the bare "▁") zero, so the model never emits them: a
    completion of special tokens decodes to "" and ``max benchmark`` stops on
    it. (A random model tends to repeat its last input token, and the chat
    markup's role words are <unk> in the word vocabulary.)"""
    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    model_class = Gemma3ForConditionalGeneration if hasattr(config, "vision_config") else Gemma3ForCausalLM
    with torch.device("meta"):
        shapes = {hub_name(k): v.shape for k, v in model_class(config).state_dict().items()}
    shapes.pop("lm_head.weight")  # tied to the embedding
    # Gemma 3 norms scale by (1 + w): zeros are the identity. The vision
    # tower's LayerNorms scale by w: ones.
    return write_random_weights(out, shapes, lambda n: initial_value(n, specials))


def hub_name(name: str) -> str:
    for module_name, stored in HUB_NAMES:
        if name.startswith(module_name):
            return stored + name.removeprefix(module_name)
    return name


def initial_value(name: str, specials: int) -> float | Noise | None:
    if name.endswith("embed_tokens.weight"):
        return Noise(zero_rows=specials)
    if name.startswith("vision_tower.") and ("layer_norm" in name or "layernorm" in name):
        return 0.0 if name.endswith(".bias") else 1.0
    if name.endswith(".bias"):
        return 0.0
    return 0.0 if name.endswith("norm.weight") else None


def write_processor(out: Path, tokenizer) -> None:
    """The image processor and processor config of an 896-pixel, 256-token Gemma 3."""
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    try:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil as Images
    except ImportError:
        from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor as Images
    size = VISION["image_size"]
    processor = Gemma3Processor(
        image_processor=Images(size={"height": size, "width": size}), tokenizer=tokenizer,
        image_seq_length=IMAGE_TOKENS, chat_template=tokenizer.chat_template,
    )  # fmt: skip
    processor.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), default="1b")
    parser.add_argument("--layers", type=int, help="keep the first N decoder layers (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    geometry = dict(GEOMETRIES[args.geometry])
    if args.layers is not None:
        if not 1 <= args.layers <= geometry["num_hidden_layers"]:
            parser.error(f"--layers {args.layers}: {args.geometry} has {geometry['num_hidden_layers']} layers")
        geometry["num_hidden_layers"] = args.layers
    multimodal = args.geometry in MULTIMODAL
    specials = (*SPECIALS, *IMAGE_SPECIALS.values()) if multimodal else SPECIALS
    tokenizer = write_word_tokenizer(
        args.out, geometry["vocab_size"], specials, CHAT_TEMPLATE, GEMMA_ROLES,
        IMAGE_SPECIALS if multimodal else None,
    )  # fmt: skip
    image_ids = None
    if multimodal:
        ids = {role: specials.index(token) for role, token in IMAGE_SPECIALS.items()}
        image_ids = {"boi_token_index": ids["boi_token"], "eoi_token_index": ids["eoi_token"],
                     "image_token_index": ids["image_token"]}  # fmt: skip
        write_processor(args.out, tokenizer)
    config = write_config(args.out, geometry, image_ids)
    nbytes = write_weights(args.out, config, specials=len(specials) + 1)  # + the bare "▁"
    print(f"wrote random Gemma 3 {args.geometry} ({geometry['num_hidden_layers']} layers, "
          f"{nbytes / 2**30:.1f} GiB) to {args.out}")  # fmt: skip


if __name__ == "__main__":
    main()
