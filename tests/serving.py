"""A real ``max serve`` (through run_max.py) on loopback, for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 1500  # a cold compile on 2 busy cores takes minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    model: str  # MAX serves a model under its --model-path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def completion(self, prompt: str, max_tokens: int, logprobs: int = 0) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        if logprobs:
            body["logprobs"] = logprobs
        return self._post("/v1/completions", body)

    def chat(self, message: str, max_tokens: int) -> dict:
        body = {
            "messages": [{"role": "user", "content": message}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        return self._post("/v1/chat/completions", body)

    def _post(self, path: str, body: dict) -> dict:
        body = {"model": self.model, **body}
        response = requests.post(self.url + path, json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def start_server(
    model_path: Path, env: Mapping[str, str], log_path: Path, *extra_args: str
) -> Server:
    """Starts ``run_max.py serve`` and waits until it answers ``/health``."""
    port = free_port()
    args = [
        sys.executable, str(REPO / "run_max.py"), "serve",
        "--model-path", str(model_path), "--port", str(port),
        "--max-batch-size", "4", "--max-length", "512",
        *extra_args,
    ]  # fmt: skip
    log = log_path.open("wb")
    process = subprocess.Popen(
        args,
        env={**os.environ, **env},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # so stop() can signal the worker processes too
    )
    server = Server(process, port, log_path, str(model_path))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"max serve exited {process.returncode}:\n{server.log()[-4000:]}")
        try:
            if requests.get(server.url + "/health", timeout=2).status_code == 200:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(2)
    server.stop()
    raise TimeoutError(f"max serve not ready in {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")


def token_logprobs(model: Any, ids: Any, prompt_len: int) -> Any:
    """float64 log p(token) of each generated token of ``ids`` [1, T] under a transformers ``model``."""
    import torch

    with torch.no_grad():
        logits = model(ids).logits[0, prompt_len - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(1, ids[0, prompt_len:, None])[:, 0]


def assert_greedy_matches_reference(
    server: Server, reference: Any, tokenizer: Any, prompts: Sequence[str], *,
    new_tokens: int, atol: float, plain: Any = None, label: str = "",
) -> None:
    """Each prompt's completion from ``server`` is the float32 transformers
    ``reference``'s greedy text, its token log probabilities within ``atol``;
    with ``plain`` (the unquantized model), that tolerance is shown to be far
    below what quantization moves."""
    import torch

    for prompt in prompts:
        choice = server.completion(prompt, max_tokens=new_tokens, logprobs=1)["choices"][0]
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            greedy = reference.generate(prompt_ids, max_new_tokens=new_tokens, do_sample=False)
        new = greedy[0, prompt_ids.shape[1] :]
        ref_text = tokenizer.decode(new, skip_special_tokens=True)
        # Same weights, both float32: the greedy paths agree token for token.
        assert choice["text"] == ref_text, f"{label}: MAX {choice['text']!r} != reference {ref_text!r}"
        assert len(new) == new_tokens and ref_text.strip(), ref_text  # runs to length, real text
        ref_logprobs = token_logprobs(reference, greedy, prompt_ids.shape[1])
        got = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64)
        assert torch.allclose(got, ref_logprobs[: len(got)], atol=atol), (got, ref_logprobs)
        if plain is not None:
            # Serving the unquantized weights would fail the check above.
            moved = (token_logprobs(plain, greedy, prompt_ids.shape[1]) - ref_logprobs).abs().max()
            assert moved > 10 * atol, moved
