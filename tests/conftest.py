"""Shared fixtures: MAX's NVFP4 host reference and a tiny Gemma 3 checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch


@pytest.fixture(scope="session")
def max_fp4_reference() -> ModuleType:
    """``max.pipelines.weights.fp4_quantization``, loaded from its file.

    Importing it as ``max.pipelines...`` runs ``max.pipelines/__init__`` (about
    6 s); the module itself needs only numpy.
    """
    spec = importlib.util.find_spec("max")
    assert spec is not None and spec.submodule_search_locations, "MAX is not installed"
    path = Path(list(spec.submodule_search_locations)[0]) / "pipelines/weights/fp4_quantization.py"
    module_spec = importlib.util.spec_from_file_location("max_fp4_reference", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


TINY_GEMMA3 = dict(
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=256,
    head_dim=16,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random bf16 Gemma 3 text checkpoint (2 layers, hidden 64) with a
    tokenizer_config.json, written by transformers' save_pretrained."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TINY_GEMMA3)).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("tiny_gemma3")
    model.save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return directory
