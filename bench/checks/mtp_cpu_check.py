"""Does ours as the MTP target generate what ours generates alone? On CPU.

``python bench/checks/mtp_cpu_check.py TARGET ASSISTANT MTP_TWIN [--prompt P ...] [--concurrency N --prompts K] [--oracle]``

Serves, one after the other on this host (both NVFP4 unless ``ATTNQUANT_QUANT``
is set): ours without a drafter, then ours with the Gemma 4 assistant
drafting 3 tokens (MAX's MTP path, through ``bench/checks/mtp_cpu``'s four CPU
patches); asks each for the same greedy completions (token ids included),
one request at a time, and with ``--concurrency N`` (N > 1) again N at a time
(each server's ``--max-batch-size`` N), and prints one row per prompt. In
float32 a batch's summation order barely moves the logits, so the batched
rows test MTP's per-sequence bookkeeping (verify pass, bonus token, KV cache)
where bf16 rounding cannot hide a fault.

A random assistant's drafts are never accepted, so alone it tests only steps
that reject them. With ``--oracle`` the drafts are ours-without-a-drafter's
next tokens instead, the first 3, 1, 0 or 2 right in turn
(``bench/harness/oracle_drafter.py``): each step accepts as many as match, and
the line under the table counts the verified rows by verdict (right, fault,
departure from the reference, not judged after one). Exit status 0 when every
prompt's ids agree everywhere (and, with ``--oracle``, no verified row was a
fault and every count of accepted drafts occurred). The three directories are
what ``make_random_gemma4.py`` and ``make_random_gemma4_assistant.py
--mtp-target`` write (the assistant is copied to float32 first: MAX's CPU path
needs it so on disk). Each server compiles on first use: minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from batch_invariance import first_difference, prompt_texts  # noqa: E402
from serve_benchmark import MAX_CLI, REPO, Greedy, greedy_completion, stop, wait_ready  # noqa: E402
import oracle_drafter as oracle  # noqa: E402

HERE = Path(__file__).resolve().parent
SERVE = ["--devices", "cpu", "--quantization-encoding", "float32", "--max-length", "512"]
TOKENS = 24
# A step of this geometry took ~6 s on 2 cores alone and ~14 s for 8
# requests: a batched request waits for all 8 prefills and 24 such steps.
REQUEST_TIMEOUT_S = 1800


def float32_copy(assistant: Path, out: Path) -> Path:
    """The assistant with its tensors, and its config's dtype, float32."""
    shutil.copytree(assistant, out, ignore=shutil.ignore_patterns("*.safetensors"))
    for file in assistant.glob("*.safetensors"):
        tensors = {name: t.to(torch.float32).contiguous() for name, t in load_file(file).items()}
        save_file(tensors, out / file.name, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=1))
    return out


def completions(
    command: list[str], env: dict[str, str], model: Path, prompts: list[str], log: Path, concurrency: int
) -> tuple[list[Greedy], list[Greedy] | None]:
    """Greedy completions one at a time, then (concurrency > 1) all at once."""
    port = 8190
    server = subprocess.Popen(
        [*command, "--max-batch-size", str(concurrency), "--port", str(port)], env={**os.environ, **env},
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(server, port, log, timeout_s=1800)

        def complete(prompt: str) -> Greedy:
            return greedy_completion(port, model, prompt, TOKENS, REQUEST_TIMEOUT_S)

        alone = [complete(prompt) for prompt in prompts]
        if concurrency == 1:
            return alone, None
        with ThreadPoolExecutor(concurrency) as pool:
            return alone, list(pool.map(complete, prompts))
    finally:
        stop(server)


def departure(a: list[int], b: list[int]) -> str:
    """'=' when the ids are equal, else the first position where they differ."""
    position = first_difference(a, b)
    return "=" if position is None else str(position)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path)
    parser.add_argument("assistant", type=Path)
    parser.add_argument("mtp_twin", type=Path)
    parser.add_argument("--prompt", action="append", help="(repeatable) default: two of batch_invariance.py's word prompts")
    parser.add_argument("--prompts", type=int, default=2, help="how many word prompts (without --prompt)")
    parser.add_argument("--concurrency", type=int, default=1, help="also send every prompt at once, N at a time")
    parser.add_argument("--oracle", action="store_true", help="draft ours-without-a-drafter's next tokens (bench/harness/oracle_drafter.py)")
    parser.add_argument("--logs", type=Path, default=Path(tempfile.mkdtemp(prefix="mtp-cpu-")))
    args = parser.parse_args()
    # Words the random checkpoint's tokenizer knows: others are <unk>, a zero
    # embedding row, and every completion would be <pad> whatever the path computes.
    prompts = args.prompt or prompt_texts(args.prompts, words=True)
    # Both servers quantize the same way: NVFP4 unless ATTNQUANT_QUANT says otherwise.
    quant = os.environ.get("ATTNQUANT_QUANT", "nvfp4")
    env = {"HF_HUB_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1", "ATTNQUANT_QUANT": quant}
    # Ours alone first: with --oracle its completions are what the drafter proposes.
    alone, alone_batched = completions(
        [sys.executable, str(REPO / "run_max.py"), "serve", "--model-path", str(args.target), *SERVE],
        env, args.target, prompts, args.logs / "alone.log", args.concurrency,
    )  # fmt: skip
    mtp_env = {**env, "PYTHONPATH": str(HERE / "mtp_cpu" / "site")}
    drafts = args.logs / "oracle-drafts.json"
    if args.oracle:
        oracle.write_drafts(drafts, args.target, prompts, [done.token_ids for done in alone])
        mtp_env[oracle.ENV_DRAFTS] = str(drafts)
    assistant = float32_copy(args.assistant, args.logs / "assistant-f32")
    drafted, drafted_batched = completions(
        [sys.executable, "-c", MAX_CLI, "serve", "--custom-architectures", str(HERE / "mtp_cpu"), "--model-path", str(args.mtp_twin),
         "--draft-model-path", str(assistant), "--speculative-method", "mtp", "--num-speculative-tokens", "3",
         "--tool-parser", "none", *SERVE],
        mtp_env, args.mtp_twin, prompts, args.logs / "mtp.log", args.concurrency,
    )  # fmt: skip
    print(f"ATTNQUANT_QUANT={quant}; {TOKENS} greedy tokens; server logs: {args.logs}")
    status = print_table(prompts, drafted, alone, drafted_batched, alone_batched)
    if not args.oracle:
        return status
    summary, right = oracle.summarize(oracle.read_verified(drafts))
    print(summary)
    return status or (0 if right else 1)


def print_table(
    prompts: list[str], drafted: list[Greedy], alone: list[Greedy],
    drafted_batched: list[Greedy] | None, alone_batched: list[Greedy] | None,
) -> int:  # fmt: skip
    """One row per prompt; the exit status (0: every comparison equal)."""
    ids = {"mtp": drafted, "ours": alone, "mtp batched": drafted_batched, "ours batched": alone_batched}
    pairs = [("mtp", "ours")]
    if drafted_batched is not None and alone_batched is not None:
        pairs += [("mtp batched", "mtp"), ("ours batched", "ours"), ("mtp batched", "ours batched")]
    head = " | ".join(f"{a} = {b}" for a, b in pairs)
    print(f"| prompt | {head} | MTP target (first 8 ids) | ours (first 8 ids) | MTP text |")
    print("|---" * (len(pairs) + 4) + "|")
    equal = True
    for i, prompt in enumerate(prompts):
        cells = [departure(ids[a][i].token_ids, ids[b][i].token_ids) for a, b in pairs]
        equal &= all(c == "=" for c in cells)
        row = " | ".join(cells)
        print(f"| {prompt} | {row} | {drafted[i].token_ids[:8]} | {alone[i].token_ids[:8]} | {drafted[i].text[:40]!r} |")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
