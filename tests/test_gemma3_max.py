"""The product end to end: real MAX serving our Gemma 3 on CPU, real Gemma 3 270M.

One ``max serve`` (through run_max.py) per configuration, shared by the
tests of that configuration: each distinct graph costs MAX minutes to
compile on 2 cores, so there are three (passthrough, NVFP4 everywhere, NVFP4
MLP-only). The host reference is transformers in float32, with the same
weights MAX serves (dequantized where they are NVFP4).
"""

from __future__ import annotations

import re

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnquant import nvfp4
from attnquant.checkpoint import load_state_dict
from attnquant.config import AttnQuantConfig
from attnquant.demo_model import ensure_demo_model
from attnquant.reconstruct import precompute_outside

from .serving import Server, start_server

pytestmark = pytest.mark.max

PROMPTS = ("The Eiffel Tower is located in the city of", "def fibonacci(n):")
CONFIGS = {
    "passthrough": {"ATTNQUANT_QUANT": "none"},
    "nvfp4": {"ATTNQUANT_QUANT": "nvfp4"},
    "nvfp4_mlp_only": {"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_QUANT_IGNORE": "self_attn"},
}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("attnquant-cache")


@pytest.fixture(scope="module", params=list(CONFIGS))
def served(request, model_dir: Path, cache_dir: Path, tmp_path_factory) -> Iterator[tuple[str, Server]]:
    name = request.param
    env = {**CONFIGS[name], "ATTNQUANT_CACHE_DIR": str(cache_dir)}
    log = tmp_path_factory.mktemp("logs") / f"serve-{name}.log"
    server = start_server(model_dir, env, log)
    try:
        yield name, server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


def reference_model(model_dir: Path, env: dict[str, str]) -> torch.nn.Module:
    """transformers float32 with the weights MAX serves under ``env``."""
    config = AttnQuantConfig.from_env({**env, "ATTNQUANT_CACHE": "0"})
    served = precompute_outside(load_state_dict(model_dir), config, progress=False).state_dict
    weights = {}
    for name, tensor in served.items():
        module = name.removesuffix(".weight")
        if f"{module}.weight_scale" in served and name.endswith(".weight"):
            packed = nvfp4.NVFP4Weight(
                tensor, served[f"{module}.weight_scale"], served[f"{module}.weight_scale_2"]
            )
            weights[name] = nvfp4.dequantize(packed)
        elif not name.endswith(("weight_scale", "weight_scale_2", "input_scale")):
            weights[name] = tensor.float()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return model.eval()


def _completion_logprobs(server: Server, prompt: str, n: int) -> tuple[str, list[float]]:
    choice = server.completion(prompt, max_tokens=n, logprobs=1)["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_completions_match_host_reference(served, model_dir: Path, tokenizer) -> None:
    name, server = served
    reference = reference_model(model_dir, CONFIGS[name])
    for prompt in PROMPTS:
        text, max_logprobs = _completion_logprobs(server, prompt, 12)
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = reference.generate(prompt_ids, max_new_tokens=12, do_sample=False)
        ref_text = tokenizer.decode(greedy[0, prompt_ids.shape[1] :], skip_special_tokens=True)
        # Same weights, both float32: the greedy paths must agree token for token.
        assert text == ref_text, f"{name}: MAX {text!r} != reference {ref_text!r}"
        with torch.no_grad():
            logits = reference(greedy).logits[0, prompt_ids.shape[1] - 1 : -1]
        ref_logprobs = torch.log_softmax(logits.double(), -1).gather(
            1, greedy[0, prompt_ids.shape[1] :, None]
        )[:, 0]
        got = torch.tensor(max_logprobs[: len(ref_logprobs)], dtype=torch.float64)
        assert torch.allclose(got, ref_logprobs[: len(got)], atol=2e-2), (got, ref_logprobs)


def test_completion_is_coherent(served) -> None:
    name, server = served
    text = server.completion("Question: What is the capital of France?\nAnswer:", 6)["choices"][0]["text"]
    assert "paris" in text.lower(), f"{name}: {text!r}"


def test_chat_endpoint_answers(served) -> None:
    # The embedded 270M is the pretrained (not instruction-tuned) model, so
    # its chat replies are not graded; the endpoint must serve them.
    name, server = served
    reply = server.chat("Hello!", 8)
    assert reply["choices"][0]["message"]["content"].strip(), name


def test_load_line_reports_path_and_coverage(served) -> None:
    name, server = served
    line = next(l for l in server.log().splitlines() if "attnquant load:" in l)
    expected = {"passthrough": "NVFP4 0/126", "nvfp4": "NVFP4 126/126", "nvfp4_mlp_only": "NVFP4 54/126"}
    assert expected[name] in line, line
    # Bytes a decode step reads: only the projections change, so the whole
    # model shrinks by exactly what the projections do (two-decimal rounding
    # aside), and what is left includes the embedding/LM head.
    mib = re.search(r"projection bytes ([\d.]+) MiB -> ([\d.]+) MiB", line)
    gib = re.search(r"weights per decode token ([\d.]+) GiB -> ([\d.]+) GiB", line)
    assert mib and gib, line
    projections_saved = (float(mib[1]) - float(mib[2])) / 1024
    assert abs((float(gib[1]) - float(gib[2])) - projections_saved) < 0.011, line
    assert float(gib[2]) > float(mib[2]) / 1024 + 0.1, line  # the embedding counted too
    # MAX sized the KV cache with the served bytes (attnquant.memory), which
    # only differ from the checkpoint's when projections were quantized.
    memory = re.search(r"attnquant memory: weights ([\d.]+) GiB served, not the checkpoint's ([\d.]+) GiB", server.log())
    assert (memory is not None) == (name != "passthrough"), name
    if memory:
        assert abs((float(memory[2]) - float(memory[1])) - projections_saved) < 0.011, memory[0]


def test_second_start_hits_the_cache(served, model_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    """A second server while the first NVFP4 one (which filled the cache) is up."""
    name, _ = served
    if name != "nvfp4":
        pytest.skip("one configuration is enough")
    env = {**CONFIGS["nvfp4"], "ATTNQUANT_CACHE_DIR": str(cache_dir)}
    server = start_server(model_dir, env, tmp_path / "serve-again.log")
    try:
        log = server.log()
        assert "quantized-weight cache hit" in log
        assert "computing served weights" not in log
        assert server.completion("Hello", max_tokens=2)["choices"][0]["text"]
    finally:
        server.stop()
