"""The canonical decode harness: ``max serve`` + ``max benchmark`` at concurrency 1.

``python bench/serve_benchmark.py --model DIR --cells VARIANT:on|off ...
--trials N --out results.jsonl`` starts one server per cell (all compile at
once), then, one server at a time, runs N trials of ``max benchmark``
(``/v1/chat/completions``, random 128 in / 128 out, 8 prompts, temperature
0), appends one JSON line per trial and prints a table. Capture is pinned
explicitly on every cell. It also compares each cell's greedy 48-token text.

Variants:
  builtin-bf16      MAX's own Gemma3ForCausalLM (graph API), bf16
  attnquant-bf16    ours, passthrough weights, bf16
  attnquant-nvfp4   ours, every projection NVFP4
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_CLI = "import sys; from max._entrypoints.pipelines import main; sys.argv[0] = 'max'; sys.exit(main())"
VARIANTS = {
    "builtin-bf16": ([sys.executable, "-c", MAX_CLI], {}),
    "attnquant-bf16": ([sys.executable, str(REPO / "run_max.py")], {"ATTNQUANT_QUANT": "none"}),
    "attnquant-nvfp4": ([sys.executable, str(REPO / "run_max.py")], {"ATTNQUANT_QUANT": "nvfp4"}),
}


def launch(
    variant: str, model: Path, port: int, capture: bool, log: Path, memory_fraction: float
) -> subprocess.Popen:
    command, env = VARIANTS[variant]
    args = [
        *command, "serve", "--model-path", str(model), "--port", str(port),
        "--max-length", "2048", "--max-batch-size", "8", "--enable-in-flight-batching",
        "--device-memory-utilization", str(memory_fraction),
        "--device-graph-capture" if capture else "--no-device-graph-capture",
    ]  # fmt: skip
    return subprocess.Popen(
        args, env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def wait_ready(process: subprocess.Popen, port: int, log: Path, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server on {port} exited:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"server on {port} not ready in {timeout_s}s")


def run_trial(model: Path, port: int, result: Path) -> dict:
    args = [
        sys.executable, "-c", MAX_CLI, "benchmark", "--model", str(model),
        "--backend", "modular-chat", "--endpoint", "/v1/chat/completions",
        "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", "1",
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
        "--num-prompts", "8", "--temperature", "0", "--result-filename", str(result),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"max benchmark failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(result.read_text())


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def greedy_text(port: int, model: Path, prompt: str, tokens: int) -> str:
    body = {"model": str(model), "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
        {"content-type": "application/json"},
    )  # fmt: skip
    return json.loads(urllib.request.urlopen(request, timeout=300).read())["choices"][0]["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description="max serve + max benchmark, c=1")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument(
        "--cells", nargs="+", required=True,
        help="VARIANT:on|off (capture) for each server, e.g. builtin-bf16:off attnquant-nvfp4:on",
    )  # fmt: skip
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--memory-fraction", type=float, default=0.18)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logs = args.out.parent
    cells = [tuple(c.split(":")) for c in args.cells]
    # All servers compile at once (many host cores), then are measured one at a time.
    servers: dict[tuple[str, str], tuple[subprocess.Popen, int]] = {}
    try:
        for i, (variant, capture) in enumerate(cells):
            port = 8100 + i
            log = logs / f"serve-{variant}-{capture}.log"
            servers[(variant, capture)] = (
                launch(variant, args.model, port, capture == "on", log, args.memory_fraction),
                port,
            )
        for (variant, capture), (server, port) in servers.items():
            wait_ready(server, port, logs / f"serve-{variant}-{capture}.log")
            print(f"ready: {variant} capture={capture}", flush=True)
        texts = {cell: greedy_text(port, args.model, "w7 w8 w9", 48) for cell, (_, port) in servers.items()}
        rows = []
        for (variant, capture), (_, port) in servers.items():
            for trial in range(args.trials):
                r = run_trial(args.model, port, logs / f"bench-{variant}-{capture}-{trial}.json")
                row = {
                    "variant": variant, "capture": capture, "trial": trial,
                    "output_tok_s": r.get("output_throughput"), "mean_tpot_ms": r.get("mean_tpot_ms"),
                    "mean_ttft_ms": r.get("mean_ttft_ms"),
                }  # fmt: skip
                rows.append(row)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            print(summary(rows, variant, capture), flush=True)
    finally:
        for server, _ in servers.values():
            _stop(server)
    print("\n| variant | capture | trials | median tok/s | median TPOT ms |\n|---|---|---|---|---|")
    for variant, capture in servers:
        print(summary(rows, variant, capture, markdown=True))
    same = {f"{v}:{c}": t == texts[cells[0]] for (v, c), t in texts.items()}
    print(f"greedy 48-token text identical to {cells[0]}: {same}")
    (logs / "greedy_texts.json").write_text(json.dumps({f"{v}:{c}": t for (v, c), t in texts.items()}))


def summary(rows: list[dict], variant: str, capture: str, markdown: bool = False) -> str:
    cell = [r for r in rows if r["variant"] == variant and r["capture"] == capture]
    tok_s = statistics.median(r["output_tok_s"] for r in cell)
    tpot = statistics.median(r["mean_tpot_ms"] for r in cell)
    if markdown:
        return f"| {variant} | {capture} | {len(cell)} | {tok_s:.1f} | {tpot:.2f} |"
    return f"{variant} capture={capture}: median {tok_s:.1f} tok/s, TPOT {tpot:.2f} ms over {len(cell)} trials"


if __name__ == "__main__":
    main()
