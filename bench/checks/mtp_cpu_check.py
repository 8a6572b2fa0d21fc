"""Does ours as the MTP target generate what ours generates alone? On CPU.

``python bench/checks/mtp_cpu_check.py TARGET ASSISTANT MTP_TWIN [--prompt P ...]``

Serves, one after the other on this host (both NVFP4 unless ``ATTNQUANT_QUANT``
is set): ours with the Gemma 4 assistant drafting 3 tokens (MAX's MTP path,
through ``bench/checks/mtp_cpu``'s four CPU patches), then ours without a drafter;
asks each for the same greedy completions (token ids included) and prints
one row per prompt. Exit status
0 when every prompt's ids agree. The three directories are what
``make_random_gemma4.py`` and ``make_random_gemma4_assistant.py --mtp-target``
write (the assistant is copied to float32 first: MAX's CPU path needs it so
on disk). Each server compiles on first use: minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from batch_invariance import prompt_texts  # noqa: E402
from serve_benchmark import MAX_CLI, REPO, Greedy, greedy_completion, stop, wait_ready  # noqa: E402

HERE = Path(__file__).resolve().parent
SERVE = ["--devices", "cpu", "--quantization-encoding", "float32", "--max-length", "512", "--max-batch-size", "1"]


def float32_copy(assistant: Path, out: Path) -> Path:
    """The assistant with its tensors, and its config's dtype, float32."""
    shutil.copytree(assistant, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in assistant.glob("*.safetensors"):
        tensors = {name: t.to(torch.float32).contiguous() for name, t in load_file(file).items()}
        save_file(tensors, out / file.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=1))
    return out


def completions(command: list[str], env: dict[str, str], model: Path, prompts: list[str], log: Path) -> list[Greedy]:
    port = 8190
    server = subprocess.Popen(
        [*command, "--port", str(port)], env={**os.environ, **env}, stdout=log.open("wb"),
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(server, port, log, timeout_s=1800)
        return [greedy_completion(port, model, prompt, 24) for prompt in prompts]
    finally:
        stop(server)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("assistant", type=Path)
    parser.add_argument("mtp_twin", type=Path)
    parser.add_argument("--prompt", action="append", help="(repeatable) default: two of batch_invariance.py's word prompts")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.mkdtemp(prefix="mtp-cpu-")))
    args = parser.parse_args()
    # Words the random checkpoint's tokenizer knows: others are <unk>, a zero
    # embedding row, and every completion would be <pad> whatever the path computes.
    prompts = args.prompt or prompt_texts(2, words=True)
    # Both servers quantize the same way: NVFP4 unless ATTNQUANT_QUANT says otherwise.
    quant = os.environ.get("ATTNQUANT_QUANT", "nvfp4")
    env = {"HF_HUB_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1", "ATTNQUANT_QUANT": quant}
    assistant = float32_copy(args.assistant, args.logs / "assistant-f32")
    drafted = completions(
        [sys.executable, "-c", MAX_CLI, "serve", "--custom-architectures", str(HERE / "mtp_cpu"), "--model-path", str(args.mtp_twin),
         "--draft-model-path", str(assistant), "--speculative-method", "mtp", "--num-speculative-tokens", "3",
         "--tool-parser", "none", *SERVE],
        {**env, "PYTHONPATH": str(HERE / "mtp_cpu" / "site")}, args.mtp_twin, prompts, args.logs / "mtp.log",
    )  # fmt: skip
    alone = completions(
        [sys.executable, str(REPO / "run_max.py"), "serve", "--model-path", str(args.target), *SERVE],
        env, args.target, prompts, args.logs / "alone.log",
    )  # fmt: skip
    print(f"ATTNQUANT_QUANT={quant}; server logs: {args.logs}\n| prompt | same ids | MTP target (first 8 ids) | alone (first 8 ids) | MTP text |")
    print("|---|---|---|---|---|")
    for prompt, a, b in zip(prompts, drafted, alone):
        print(f"| {prompt} | {a.token_ids == b.token_ids} | {a.token_ids[:8]} | {b.token_ids[:8]} | {a.text[:40]!r} |")
    return 0 if all(a.token_ids == b.token_ids for a, b in zip(drafted, alone)) else 1


if __name__ == "__main__":
    sys.exit(main())
