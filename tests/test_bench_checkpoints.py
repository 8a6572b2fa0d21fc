"""The random benchmark checkpoints' weights (bench/checkpoints/random_checkpoint.py).

The H200 figures rest on them: a Gemma 4 checkpoint whose model repeats a
special token streamed no text and measured nothing (the lab log, docs/dev/lab-log.md).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.bench_modules import bench_module


@pytest.fixture(scope="module")
def random_checkpoint():
    return bench_module("random_checkpoint")


def _written(module, tmp_path: Path, shapes: dict, init) -> dict[str, torch.Tensor]:
    total = module.write_random_weights(tmp_path, shapes, init)
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
    gemma4 = bench_module("make_random_gemma4")
    from tests.gemma4_fixtures import SPECIAL_TOKENS

    embedding = gemma4.initial_fill("model.language_model.embed_tokens.weight")
    assert embedding == random_checkpoint.Noise(std=0.002, zero_rows=len(SPECIAL_TOKENS) + 1)
    assert gemma4.initial_fill("model.language_model.layers.0.input_layernorm.weight") == 1.0
    assert gemma4.initial_fill("model.language_model.layers.0.self_attn.q_proj.weight") is None


def test_gemma3_embedding_never_emits_special_tokens(random_checkpoint) -> None:
    """A random Gemma 3 that emits special tokens answers "" and ``max benchmark`` stops."""
    gemma3 = bench_module("make_random_gemma3")
    for name in ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight"):
        assert gemma3.initial_value(name, specials=10) == random_checkpoint.Noise(zero_rows=10)
    assert gemma3.initial_value("model.layers.0.input_layernorm.weight", specials=10) == 0.0
    assert gemma3.initial_value("model.layers.0.self_attn.q_proj.weight", specials=10) is None


def test_gemma3_chat_template_marks_images(tmp_path: Path) -> None:
    """An image part of a chat request becomes the marker the processor expands
    (otherwise MAX answers an image request with HTTP 400)."""
    from jinja2 import Template

    gemma3 = bench_module("make_random_gemma3")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]}]
    text = Template(gemma3.CHAT_TEMPLATE).render(messages=messages, bos_token="<bos>")
    assert text == "<bos><start_of_turn>user\n<start_of_image>What colour?<end_of_turn>\n<start_of_turn>model"
    plain = Template(gemma3.CHAT_TEMPLATE).render(messages=[{"role": "user", "content": "hi"}], bos_token="")
    assert plain.startswith("<start_of_turn>user\nhi<end_of_turn>")


TINY_ASSISTANT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64)


def test_mtp_assistant_and_target_are_what_max_pairs(random_checkpoint, tmp_path: Path) -> None:
    """The random MTP pair for the H200: MAX rewrites the linked target to its
    fused MTP model (ours), and reads the assistant's geometry and the
    target's width from them as it would from google's checkpoints."""
    from max.pipelines.architectures.unified_mtp_gemma4.model import UnifiedMTPGemma4Model
    from max.pipelines.lib.config.config import _apply_speculative_target_architecture
    from max.pipelines.speculative import SpeculativeConfig
    from transformers import AutoConfig

    from tests.gemma4_fixtures import SPECIAL_TOKENS, write_tiny_gemma4

    assistant = bench_module("make_random_gemma4_assistant")
    target = write_tiny_gemma4(tmp_path / "target")
    assistant.write_assistant(target, tmp_path / "assistant", TINY_ASSISTANT)
    assistant.link_mtp_target(target, tmp_path / "mtp")

    tensors = load_file(next((tmp_path / "assistant").glob("*.safetensors")))
    assert tensors["pre_projection.weight"].shape == (32, 2 * 64)  # [hidden, 2 x target hidden]
    assert tensors["post_projection.weight"].shape == (64, 32)
    assert not [name for name in tensors if "k_proj" in name or "v_proj" in name or "lm_head" in name]
    assert not tensors["model.embed_tokens.weight"][: len(SPECIAL_TOKENS)].any()
    assert (tmp_path / "mtp" / "model.safetensors").resolve() == (target / "model.safetensors").resolve()

    configs = {name: AutoConfig.from_pretrained(tmp_path / name) for name in ("mtp", "assistant")}
    models = {"main": SimpleNamespace(huggingface_config=configs["mtp"]),
              "draft": SimpleNamespace(huggingface_config=configs["assistant"])}  # fmt: skip
    _apply_speculative_target_architecture(SpeculativeConfig(speculative_method="mtp", num_speculative_tokens=3), models)
    assert configs["mtp"].architectures == ["UnifiedMTPGemma4ForCausalLM"]
    assert configs["mtp"].model_type == "gemma4_unified"  # no vision tower built

    draft = UnifiedMTPGemma4Model._create_draft_config(
        SimpleNamespace(huggingface_config=configs["mtp"]), configs["assistant"], devices=[]
    )
    assert (draft.hidden_size, draft.backbone_hidden_size, draft.num_hidden_layers) == (32, 64, 4)
    assert (draft.vocab_size, draft.head_dim, draft.global_head_dim) == (256, 16, 32)


def test_assistant_heads_must_cover_the_targets_kv_heads(random_checkpoint, tmp_path: Path) -> None:
    assistant = bench_module("make_random_gemma4_assistant")
    target = {"text_config": {"hidden_size": 64, "num_key_value_heads": 2, "num_global_key_value_heads": 1}}
    with pytest.raises(ValueError, match="3 assistant heads: not a multiple of the target's 2 KV heads"):
        assistant.build_config(target, dict(TINY_ASSISTANT, num_attention_heads=3))
