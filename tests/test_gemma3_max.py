"""The product end to end: real MAX serving our Gemma 3 on CPU, real Gemma 3 270M.

One ``max serve`` (through run_max.py) per configuration, shared by the
tests of that configuration: each distinct graph costs MAX minutes to
compile on 2 cores, so there are four (passthrough, NVFP4 everywhere, NVFP4
MLP-only, NVFP4 everywhere with the NVFP4 output head). The host reference is
transformers in float32, with the same weights MAX serves (dequantized where
they are NVFP4): every completion is checked token for token against it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch
from transformers import AutoTokenizer

from attnquant.tools.demo_model import ensure_demo_model
from attnquant.tools.verify import transformers_model

from .serving import Server, start_server

pytestmark = pytest.mark.max

PROMPTS = ("The Eiffel Tower is located in the city of", "def fibonacci(n):")
CONFIGS = {
    "passthrough": {"ATTNQUANT_QUANT": "none"},
    "nvfp4": {"ATTNQUANT_QUANT": "nvfp4"},
    "nvfp4_mlp_only": {"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_QUANT_IGNORE": "self_attn"},
    "nvfp4_head": {"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_LM_HEAD": "nvfp4"},
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


@pytest.fixture(scope="module")
def reference(served, model_dir: Path) -> torch.nn.Module:
    """transformers float32 with the weights MAX serves in this configuration."""
    name, _ = served
    return transformers_model(model_dir, {**CONFIGS[name], "ATTNQUANT_CACHE": "0"})


def greedy(reference: torch.nn.Module, tokenizer, prompt_ids: torch.Tensor, n: int) -> str:
    with torch.no_grad():
        out = reference.generate(prompt_ids, max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)


def _completion_logprobs(server: Server, prompt: str, n: int) -> tuple[str, list[float]]:
    choice = server.completion(prompt, max_tokens=n, logprobs=1)["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def test_completions_match_host_reference(served, reference, tokenizer) -> None:
    name, server = served
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


def test_completion_is_coherent(served, reference, tokenizer) -> None:
    name, server = served
    prompt = "Question: What is the capital of France?\nAnswer:"
    text = server.completion(prompt, 6)["choices"][0]["text"]
    assert "paris" in text.lower(), f"{name}: {text!r}"
    assert text == greedy(reference, tokenizer, tokenizer(prompt, return_tensors="pt").input_ids, 6)


def test_chat_endpoint_answers(served, reference, tokenizer) -> None:
    """The chat endpoint renders the checkpoint's chat template and answers as
    the reference does for the same rendered prompt (the embedded 270M is the
    pretrained model, so what it says is not graded, only that it is right)."""
    name, server = served
    reply = server.chat("Hello!", 8)["choices"][0]["message"]["content"]
    messages = [{"role": "user", "content": "Hello!"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert reply.strip() and reply == greedy(reference, tokenizer, ids["input_ids"], 8), name


def test_load_line_reports_path_and_coverage(served) -> None:
    name, server = served
    line = next(l for l in server.log().splitlines() if "attnquant load:" in l)
    expected = {
        "passthrough": "NVFP4 0/126", "nvfp4": "NVFP4 126/126", "nvfp4_mlp_only": "NVFP4 54/126",
        "nvfp4_head": "quant=nvfp4 lm_head=nvfp4; NVFP4 126/126",
    }  # fmt: skip
    assert expected[name] in line, line
    if name == "nvfp4_head":
        return  # the head's bytes, not only the projections', changed
    # Bytes a decode step reads: only the projections change, so the whole
    # model shrinks by exactly what the projections do (two-decimal rounding
    # aside), and what is left includes the embedding/LM head.
    mib = re.search(r"projection bytes ([\d.]+) MiB -> ([\d.]+) MiB", line)
    gib = re.search(r"weights per decode token ([\d.]+) GiB -> ([\d.]+) GiB", line)
    assert mib and gib, line
    projections_saved = (float(mib[1]) - float(mib[2])) / 1024
    assert abs((float(gib[1]) - float(gib[2])) - projections_saved) < 0.011, line
    assert float(gib[2]) > float(mib[2]) / 1024 + 0.1, line  # the embedding counted too
    # MAX sized the KV cache with the served bytes (attnquant.load.memory), which
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
        first = served[1].completion(PROMPTS[0], max_tokens=8)["choices"][0]["text"]
        assert server.completion(PROMPTS[0], max_tokens=8)["choices"][0]["text"] == first
    finally:
        server.stop()


def test_a_bad_token_id_is_a_400_and_the_server_goes_on(served) -> None:
    """An id outside the vocabulary would crash MAX's model worker in the
    embedding gather; ours refuses the request and serves the next one."""
    name, server = served
    if name != "nvfp4":
        pytest.skip("one configuration is enough")
    for bad in ([2, 999999999, 5], [2, -5]):
        response = requests.post(
            server.url + "/v1/completions", json={"model": server.model, "prompt": bad, "max_tokens": 4}, timeout=120
        )
        assert response.status_code == 400, response.text
        assert f"prompt token id {bad[1]} (position 1) is outside this model's vocabulary [0, 262144)" in response.text
    good = server.completion(PROMPTS[0], max_tokens=4)["choices"][0]["text"]
    assert good and "Worker crashed" not in server.log()


CONCURRENT_PROMPTS = (
    "The Eiffel Tower is located in the city of",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
)


def test_concurrent_requests_give_the_completions_of_requests_alone(served) -> None:
    """Batch invariance on CPU: four requests decoded together (one batch,
    run_max.py serves several sequences at once) give each the completion
    it gets alone, token for token."""
    name, server = served
    if name not in ("nvfp4", "nvfp4_head"):
        pytest.skip("the NVFP4 configurations are enough")

    def complete(prompt: str) -> tuple[str, list[str] | None]:
        choice = server.completion(prompt, max_tokens=16, logprobs=1)["choices"][0]
        return choice["text"], choice["logprobs"].get("tokens")

    alone = [complete(p) for p in CONCURRENT_PROMPTS]
    with ThreadPoolExecutor(len(CONCURRENT_PROMPTS)) as pool:
        together = list(pool.map(complete, CONCURRENT_PROMPTS))
    assert together == alone


def test_a_modelopt_export_serves_the_tokens_of_quantizing_at_load(
    served, model_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """`attnquant quantize` the 270M, serve the export with no ATTNQUANT_*
    setting: its NVFP4 is served as stored, and the greedy tokens are those
    of the original served with ATTNQUANT_QUANT=nvfp4 (and the same ignore
    list). The graph is the same, so MAX compiles nothing new."""
    from attnquant.tools import cli

    name, server = served
    ignore = {"nvfp4": [], "nvfp4_mlp_only": ["--ignore", "self_attn"]}.get(name)
    if ignore is None:
        pytest.skip("exports of the NVFP4 configurations")
    export = tmp_path / "export"
    assert cli.main(["quantize", str(model_dir), "--out", str(export), "--no-progress", *ignore]) == 0
    stored = start_server(export, {"ATTNQUANT_CACHE_DIR": str(cache_dir)}, tmp_path / "serve-export.log")
    try:
        line = next(l for l in stored.log().splitlines() if "attnquant load:" in l)
        assert ("NVFP4 126/126" if not ignore else "NVFP4 54/126") in line and "checkpoint weights" in line, line
        for prompt in PROMPTS:
            ours = stored.completion(prompt, max_tokens=12)["choices"][0]["text"]
            assert ours == server.completion(prompt, max_tokens=12)["choices"][0]["text"], prompt
    finally:
        stored.stop()
