"""A tiny random Gemma 4 text checkpoint (``Gemma4UnifiedForConditionalGeneration``).

Small enough to compile in minutes on 2 cores, yet with the geometry that
makes Gemma 4 differ from Gemma 3: full-attention layers with their own head
size and KV head count, and ``attention_k_eq_v`` (those layers have no
``v_proj``), so projection shapes differ by layer. The text-only ``unified``
line is the one MAX runs on CPU: the regular line's vision tower is GPU-only.

The tokenizer is a SentencePiece-style BPE (``▁`` for spaces, as Gemma's)
trained on a few sentences, plus the special tokens MAX's ``Gemma4Tokenizer``
looks up (reasoning channel, tool calls, image delimiters); the config points
its token ids at them. Special tokens, and the ids past the small trained
vocabulary, get zero embeddings (tied to the output head), so they never win
greedy decoding: generations run to full length and decode to the same text
with or without special tokens.

MAX requires a ``vision_config`` even for the text-only line (it reads it to
size its vision cache), so the config has a tiny one; MAX ignores its weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_SIZE = 256
# Ids 0-3 are <pad>, <eos>, <bos>, <unk>, as in Gemma's own vocabulary.
SPECIAL_TOKENS = (
    "<pad>", "<eos>", "<bos>", "<unk>",
    "<|image>", "<image|>", "<|image|>", "<|video|>", "<|audio|>",
    "<|channel>", "<channel|>", "<|turn>", "<turn|>",
    "<|tool_call>", "<tool_call|>", "<|tool>", "<tool|>",
    "<|tool_response>", "<tool_response|>", '<|"|>',
)  # fmt: skip
IMAGE_IDS = {"boi_token_id": 4, "eoi_token_id": 5, "image_token_id": 6, "video_token_id": 7}

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TINY_GEMMA4_TEXT = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # Full-attention layers: wider heads, one KV head, k and v shared.
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=256,  # MAX's CPU sliding-window kernel needs >= 256
    max_position_embeddings=1024,
    final_logit_softcapping=30.0,
)
TINY_VISION = dict(
    patch_size=4, pooling_kernel_size=2, mm_embed_dim=64, mm_posemb_size=16, output_proj_dims=64
)
# Per layer type: (q rows, k rows, has v_proj).
EXPECTED_ATTENTION = {"sliding_attention": (64, 32, True), "full_attention": (128, 32, False)}

_CORPUS = (
    "The capital of France is Paris. The capital of Italy is Rome. "
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2) "
    "Once upon a time there was a small model that could count to ten. "
    "One two three four five six seven eight nine ten. "
)


def expected_projection_count() -> int:
    """q, k, (v), o, gate, up, down per layer: v only on sliding layers."""
    return sum(6 + EXPECTED_ATTENTION[t][2] for t in LAYER_TYPES)


def write_tokenizer(directory: Path) -> int:
    """Writes the tokenizer; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 16,  # room for the <|video|> MAX adds at load
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        additional_special_tokens=list(SPECIAL_TOKENS[4:]),
        model_max_length=1024,
    )
    for name, token_id in IMAGE_IDS.items():
        assert fast.convert_ids_to_tokens(token_id) == SPECIAL_TOKENS[token_id], name
    fast.save_pretrained(directory)
    return len(fast)


def write_tiny_gemma4(directory: Path, *, seed: int = 0) -> Path:
    """Writes the random bf16 checkpoint, its config and tokenizer; returns ``directory``."""
    from transformers import Gemma4UnifiedConfig
    from transformers.models.gemma4_unified.modeling_gemma4_unified import (
        Gemma4UnifiedForConditionalGeneration,
    )

    torch.manual_seed(seed)
    vocabulary = write_tokenizer(directory)
    config = Gemma4UnifiedConfig(
        text_config=TINY_GEMMA4_TEXT,
        vision_config=TINY_VISION,
        tie_word_embeddings=True,
        **IMAGE_IDS,
    )
    model = Gemma4UnifiedForConditionalGeneration(config)
    with torch.no_grad():
        # Random init leaves every norm at its identity value; perturb them so
        # a norm or layer_scalar wired to the wrong tensor changes the output.
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layer_scalar")):
                param.mul_(1 + 0.2 * torch.rand_like(param))
        embeddings = model.get_input_embeddings().weight
        embeddings[: len(SPECIAL_TOKENS)] = 0
        embeddings[vocabulary:] = 0
    model.to(torch.bfloat16).save_pretrained(directory)
    _check_config(directory)
    return directory


def _check_config(directory: Path) -> None:
    saved = json.loads((directory / "config.json").read_text())
    assert saved["architectures"] == ["Gemma4UnifiedForConditionalGeneration"], saved
    assert saved["text_config"]["attention_k_eq_v"] is True
