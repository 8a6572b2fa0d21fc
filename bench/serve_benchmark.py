"""The canonical decode harness: ``max serve`` + ``max benchmark`` at concurrency 1.

``python bench/serve_benchmark.py --model DIR --variant V --capture on|off
--trials N --out results.jsonl`` starts one server session for the variant,
runs N trials of ``max benchmark`` (``/v1/chat/completions``, random 128 in /
128 out, 8 prompts, temperature 0), appends one JSON line per trial and
prints a table. Capture is always pinned explicitly, on both sides.

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


def start_server(variant: str, model: Path, port: int, capture: bool, log: Path) -> subprocess.Popen:
    command, env = VARIANTS[variant]
    args = [
        *command, "serve", "--model-path", str(model), "--port", str(port),
        "--max-length", "2048", "--enable-in-flight-batching",
        "--device-graph-capture" if capture else "--no-device-graph-capture",
    ]  # fmt: skip
    process = subprocess.Popen(
        args, env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{variant} server exited:\n{log.read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{variant} server not ready")


def run_trial(model: Path, port: int, result: Path) -> dict:
    args = [
        sys.executable, "-c", MAX_CLI, "benchmark", "--model", str(model),
        "--backend", "modular-chat", "--endpoint", "/v1/chat/completions",
        "--host", "127.0.0.1", "--port", str(port), "--max-concurrency", "1",
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "128",
        "--num-prompts", "8", "--temperature", "0", "--result-filename", str(result),
    ]  # fmt: skip
    subprocess.run(args, check=True, capture_output=True)
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description="max serve + max benchmark, c=1")
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--capture", choices=("on", "off"), required=True)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--session", type=int, default=1)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    logs = args.out.parent
    log = logs / f"serve-{args.variant}-{args.capture}-s{args.session}.log"
    server = start_server(args.variant, args.model, args.port, args.capture == "on", log)
    rows = []
    try:
        for trial in range(args.trials):
            r = run_trial(args.model, args.port, logs / f"bench-{args.variant}-{trial}.json")
            row = {
                "variant": args.variant, "capture": args.capture, "session": args.session,
                "trial": trial, "output_tok_s": r.get("output_throughput"),
                "mean_tpot_ms": r.get("mean_tpot_ms"), "mean_ttft_ms": r.get("mean_ttft_ms"),
            }  # fmt: skip
            rows.append(row)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    finally:
        os.killpg(server.pid, signal.SIGINT)
        server.wait(timeout=60)
    capture_lines = [l for l in log.read_text().splitlines() if "device_graph_capture" in l]
    tok_s = statistics.median(r["output_tok_s"] for r in rows)
    tpot = statistics.median(r["mean_tpot_ms"] for r in rows)
    print(f"{args.variant:18} capture={args.capture} session={args.session} trials={len(rows)} "
          f"median tok/s={tok_s:.1f} median TPOT={tpot:.2f} ms | {capture_lines[-1:] }")


if __name__ == "__main__":
    main()
