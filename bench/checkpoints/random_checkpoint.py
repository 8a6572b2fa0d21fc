"""Shared pieces of the random-weight benchmark checkpoints (Gemma 3 and Gemma 4).

Random weights N(0, 0.02) in bf16, written in ~4 GB safetensors shards with
an index (a 31B-geometry model does not fit one ``save_file`` call's host
copy comfortably), and a word-level tokenizer whose pieces start with "▁"
(``max benchmark --dataset-name random`` decodes random ids and needs such a
piece) with a chat template (the chat endpoint needs one). For benchmarks
only: the text these models produce is noise.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 4 << 30
GEMMA_ROLES = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
"""Tokenizer roles of Gemma's first special tokens (ids 0-3 are <pad>, <eos>, <bos>, <unk>)."""


@dataclass(frozen=True)
class Noise:
    """N(0, std) with the first ``zero_rows`` rows zero (an embedding's
    special tokens: their logits stay 0, so a random model never emits them)."""

    std: float = 0.02
    zero_rows: int = 0


def write_random_weights(
    out: Path,
    shapes: Mapping[str, torch.Size],
    init: Callable[[str], float | Noise | None],
) -> int:
    """Writes every tensor in ``shapes``; ``init(name)`` returns a constant
    fill (e.g. 1.0 for norms), a ``Noise``, or None for ``Noise()``.
    Returns bytes written.

    Drawn on the CPU from one seeded generator, so a checkpoint made on the
    GPU machine is the one made here: a run's random model can be replayed
    on this machine (bench/checks/invariance_margins.py prices its outputs)."""
    generator = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in shapes.items():
        fill = init(name)
        if isinstance(fill, float):
            tensor = torch.full(shape, fill, dtype=torch.bfloat16)
        else:
            noise = fill or Noise()
            sample = torch.randn(shape, generator=generator, dtype=torch.float32)
            sample[: noise.zero_rows] = 0
            tensor = (sample * noise.std).to(torch.bfloat16)
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
        total += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def write_word_tokenizer(
    out: Path,
    vocab_size: int,
    specials: Sequence[str],
    chat_template: str,
    named: Mapping[str, str],
    extra_named: Mapping[str, str] | None = None,
):
    """Specials take the first ids (in order), then the bare "▁" (``max
    benchmark``'s random dataset swaps special ids for it and fails without
    it), then every other id is the word "▁w<id>". Returns the tokenizer.

    ``named`` maps tokenizer roles (bos_token, eos_token, pad_token,
    unk_token) to special tokens; ``extra_named`` other roles (a processor's
    image_token, boi_token, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*specials, "▁"])}
    vocab |= {f"▁w{i}": i for i in range(len(vocab), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=named["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    roles = set(named.values())
    roles |= set((extra_named or {}).values())
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, **named,
        additional_special_tokens=[s for s in specials if s not in roles],
        **({"extra_special_tokens": dict(extra_named)} if extra_named else {}),
    )  # fmt: skip
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast
