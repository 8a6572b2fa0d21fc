"""The random benchmark checkpoints' weights (bench/random_checkpoint.py).

The H200 figures rest on them: a Gemma 4 checkpoint whose model repeats a
special token streamed no text and measured nothing (docs/throughput.md, run 5).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def random_checkpoint():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("random_checkpoint")
    finally:
        sys.path.remove(str(BENCH))


def _written(module, tmp_path: Path, shapes: dict, init) -> dict[str, torch.Tensor]:
    total = module.write_random_weights(tmp_path, shapes, "cpu", init)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        tensors |= load_file(file)
    assert total == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def test_fill_noise_and_zeroed_rows(random_checkpoint, tmp_path: Path) -> None:
    noise = random_checkpoint.Noise(std=0.002, zero_rows=21)
    shapes = {"norm.weight": torch.Size([64]), "embed.weight": torch.Size([4096, 64]), "w": torch.Size([256, 64])}
    init = {"norm.weight": 1.0, "embed.weight": noise, "w": None}.__getitem__
    tensors = _written(random_checkpoint, tmp_path, shapes, init)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert torch.equal(tensors["norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    embed = tensors["embed.weight"].float()
    assert not embed[:21].any(), "special tokens' rows must be zero"
    assert embed[21].abs().sum() > 0
    assert embed[21:].std().item() == pytest.approx(0.002, rel=0.05)
    assert tensors["w"].float().std().item() == pytest.approx(0.02, rel=0.05)


def test_gemma4_embedding_never_emits_special_tokens(random_checkpoint) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        gemma4 = importlib.import_module("make_random_gemma4")
    finally:
        sys.path.remove(str(BENCH))
    from tests.gemma4_fixtures import SPECIAL_TOKENS

    embedding = gemma4._init("model.language_model.embed_tokens.weight")
    assert embedding == random_checkpoint.Noise(std=0.002, zero_rows=len(SPECIAL_TOKENS) + 1)
    assert gemma4._init("model.language_model.layers.0.input_layernorm.weight") == 1.0
    assert gemma4._init("model.language_model.layers.0.self_attn.q_proj.weight") is None
