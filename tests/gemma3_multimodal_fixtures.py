"""A tiny random Gemma 3 text + vision checkpoint (``Gemma3ForConditionalGeneration``).

Written by transformers' ``save_pretrained`` (so in the layout transformers
5 writes: ``language_model.model.*``, ``vision_tower.*`` without
``vision_model.``, ``multi_modal_projector.*``), small enough to compile in
minutes on 2 cores: two decoder layers, one sliding-window and one
full-attention (``_sliding_window_pattern`` 2, which MAX and transformers
both read), the window at 256 (MAX's CPU sliding-window kernel needs at
least that), and a one-layer vision tower of 56-pixel images in 4 tokens.

The tokenizer is a SentencePiece-style BPE (``▁`` for spaces, as Gemma's)
trained on a few sentences, with Gemma 3's special tokens; the config's
image token ids point at them. The processor files (a Gemma 3 image
processor for 56-pixel images, 4 image tokens, a chat template) are what
MAX's ``TextAndVisionTokenizer`` loads offline. Special tokens, and the ids
past the small trained vocabulary, get zero embeddings (tied to the output
head), so they never win greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 256
NUM_LAYERS = 2
LAYER_TYPES = ["sliding_attention", "full_attention"]
# Ids 0-3 are <pad>, <eos>, <bos>, <unk>, as in Gemma's own vocabulary.
SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
    "<start_of_turn>", "<end_of_turn>",
)  # fmt: skip
IMAGE_IDS = {"boi_token_index": 4, "eoi_token_index": 5, "image_token_index": 6}
IMAGE_TOKENS = 4
IMAGE_SIZE = 56

TINY_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=256,  # MAX's CPU sliding-window kernel needs >= 256
    sliding_window_pattern=2,  # layer 0 sliding, layer 1 full attention
    max_position_embeddings=1024,
)
TINY_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=IMAGE_SIZE,
    patch_size=14,
    vision_use_head=False,
)

_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. "
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) "
    "Once upon a time there was a small model that could count to ten. "
    "One two three four five six seven eight nine ten. "
    "Look at this picture of a red square and a blue circle. What do you see? "
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def expected_projection_count() -> int:
    """q, k, v, o, gate, up, down per decoder layer (the vision tower's are not ours)."""
    return 7 * NUM_LAYERS


def write_processor(directory: Path) -> int:
    """Writes the tokenizer and processor files; returns the tokenizer's size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 16, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
        model_max_length=1024,
    )
    assert fast.image_token_id == IMAGE_IDS["image_token_index"]
    assert fast.convert_tokens_to_ids("<start_of_image>") == IMAGE_IDS["boi_token_index"]
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}),
        tokenizer=fast,
        image_seq_length=IMAGE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(directory)
    return len(fast)


def write_tiny_gemma3_multimodal(directory: Path, *, seed: int = 0) -> Path:
    """Writes the random bf16 checkpoint, its config and processor; returns ``directory``."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(seed)
    vocabulary = write_processor(directory)
    config = Gemma3Config(
        text_config=TINY_TEXT, vision_config=TINY_VISION, mm_tokens_per_image=IMAGE_TOKENS, **IMAGE_IDS
    )
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        # Random init leaves every norm at its identity value; perturb them so
        # a norm wired to the wrong tensor changes the output.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.rand_like(param))
        embeddings = model.get_input_embeddings().weight
        embeddings[: len(SPECIAL_TOKENS)] = 0
        embeddings[vocabulary:] = 0
    model.to(torch.bfloat16).save_pretrained(directory)
    _check(directory)
    return directory


def _check(directory: Path) -> None:
    from safetensors import safe_open

    saved = json.loads((directory / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"], saved
    assert saved["text_config"]["layer_types"] == LAYER_TYPES, saved["text_config"]
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    # The layout this fixture stands for (see the module docstring).
    assert any(n.startswith("language_model.model.layers.") for n in names)
    assert any(n.startswith("vision_tower.encoder.") for n in names)
    assert not any(n.startswith("vision_tower.vision_model.") for n in names)
