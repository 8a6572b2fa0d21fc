"""Where a decode step's GPU time goes: every kernel of ``max generate``, timed by ncu.

    python bench/harness/step_profile.py --model DIR --out DIR [--env NAME=VALUE ...] [--tokens 24] [--layers N]
    python bench/harness/step_profile.py --capture --model DIR --out DIR [--env NAME=VALUE ...] [--tokens 64]
    python bench/harness/step_profile.py --analyze OUT/kernels.csv.gz [--layers N]
    python bench/harness/step_profile.py --analyze profile-kernels.csv.gz --cell nvfp4-inlined [--layers N]

It serves nothing: it runs ``max generate`` (through run_max.py, so
attnquant's architectures and ``ATTNQUANT_*`` settings apply; capture off, so
each kernel launch is its own) once to load and compile (``--stage compile``),
then again under Nsight Compute (``--stage profile``), which times every kernel
alone (``gpu__time_duration``, clocks and caches left as they are), writes
ncu's table of the kernels in launch order to OUT/kernels.csv.gz, then
analyses it (``--analyze`` analyses a table written before).

The analysis finds the decode step in that list: the shortest run of kernels
that repeats, unchanged, over the last steps (the name with its digits
blanked, so a kernel that changes a template number as the context grows
still matches). It prints one step kernel by kernel (median over the steps
found) and the step's time by kind of kernel. Kernel times add up to less
than a step on the GPU: what a launch costs between kernels (in a captured
graph ~1 µs each) is not in them; the kernel count says how many there are.

``--capture`` times the step as it is served instead: ``max generate`` with
device graph capture on, and ncu profiling each captured graph as one workload
(``--graph-profiling graph``). A decode step is then one graph (and whatever
the step launches outside it): its time is the step's on the GPU, the launch
gaps inside the graph included and the host's time between steps left out.
A served TPOT at a small geometry moves by about a millisecond from trial to
trial with the host's work; this figure leaves the host out, so two builds'
steps can be compared by their GPU time alone (the lease's ``PROFILE_CAPTURE``).

Needs a GPU with ``ncu`` on PATH (the device machine has both); ``--analyze``
runs anywhere.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from batch_invariance import prompt_texts  # this directory
from serve_benchmark import measuring  # this directory

REPO = Path(__file__).resolve().parents[2]
METRIC = "gpu__time_duration.sum"
NCU = ["ncu", "--target-processes", "all", "--clock-control", "none", "--cache-control", "none",
       "--metrics", METRIC, "--csv", "--page", "raw", "--print-units", "base"]  # fmt: skip
(WORD_PROMPT,) = prompt_texts(1, words=True, long=False)  # a random checkpoint's word tokenizer reads these
UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9, "nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}

GRAPH = "captured graph (--capture)"
KINDS: tuple[tuple[str, str], ...] = (  # first match wins; matched against the lower-cased name
    (GRAPH, r"graph"),  # where ncu names a whole-graph workload so; no step kernel is
    ("ours (attnquant's Mojo ops)", r"^mojo_pkg_"),  # MAX names a custom op's kernels by package hash
    ("attention", r"mha|flash|attention"),
    ("matmul (MAX)", r"matmul|gemm|gemv|cublas|wgmma"),
    ("row-wise (norms)", r"rowwise|norm"),
    ("softmax", r"softmax"),
    ("sampling", r"topk|top_k|argmax|sampl"),
    ("copy / gather", r"copy|gather|concat|scatter|memcpy|memset|transpose"),
)
OTHER = "elementwise / other"


@dataclass(frozen=True)
class Kernel:
    name: str
    grid: str
    block: str
    ns: float

    @property
    def kind(self) -> str:
        low = self.name.lower()
        return next((kind for kind, pattern in KINDS if re.search(pattern, low)), OTHER)

    @property
    def shape(self) -> str:
        """The name with its numbers blanked: a step's kernels match across steps."""
        return re.sub(r"\d+", "#", self.name)


def read_kernels(text: str) -> list[Kernel]:
    """The kernels of ncu's ``--csv --page raw`` output, in launch order (of the
    process that ran the most, where ncu printed a table for several)."""
    tables: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith('"ID"'):
            tables.append([line])
        elif line.startswith('"') and tables:
            tables[-1].append(line)
    if not tables:
        raise SystemExit('no ncu table in the input (no line starts with "ID"): did ncu profile anything?')
    return max((_table_kernels(table) for table in tables), key=len)


def _table_kernels(lines: list[str]) -> list[Kernel]:
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    units = next((row for row in rows if not row["ID"].strip().isdigit()), {})
    scale = UNIT_NS[units.get(METRIC) or "nsecond"]
    return [
        Kernel(row["Kernel Name"], row.get("Grid Size", ""), row.get("Block Size", ""),
               float(row[METRIC].replace(",", "")) * scale)
        for row in rows if row["ID"].strip().isdigit()
    ]  # fmt: skip


def decode_period(kernels: Sequence[Kernel], repeats: int = 3, longest: int = 5000, shortest: int = 2) -> int:
    """The shortest P (at least ``shortest``) whose last ``repeats`` runs of P
    kernels have the same shapes. A captured step may be one workload (its
    graph), an uncaptured one never is: a lone repeating kernel is not a step."""
    shapes = [k.shape for k in kernels]
    for period in range(shortest, min(longest, len(shapes) // repeats) + 1):
        tail = shapes[len(shapes) - repeats * period :]
        if all(tail[i] == tail[i % period] for i in range(len(tail))):
            return period
    raise SystemExit(f"no step repeats {repeats} times in the last {len(shapes)} kernels: generate more tokens")


def steps(kernels: Sequence[Kernel], period: int) -> list[list[Kernel]]:
    """Every whole step at the tail that has the decode step's shapes."""
    shapes = [k.shape for k in kernels[-period:]]
    found = []
    end = len(kernels)
    while end - period >= 0 and [k.shape for k in kernels[end - period : end]] == shapes:
        found.append(list(kernels[end - period : end]))
        end -= period
    return found[::-1]


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 1] + "…"


def spread(found: Sequence[Sequence[Kernel]], what: str = "the step") -> str:
    """The time of ``what`` (the workloads of each list in ``found``) over its
    occurrences: what a difference between two builds must exceed."""
    totals = sorted(sum(k.ns for k in step) / 1e3 for step in found)
    low, high = totals[len(totals) // 10], totals[-1 - len(totals) // 10]
    return (f"{what} over its {len(totals)} occurrences: median {statistics.median(totals):.1f} µs, "
            f"10th-90th percentile {low:.1f}-{high:.1f} µs")


def graph_spread(found: Sequence[Sequence[Kernel]]) -> list[str]:
    """The captured graphs' own time, where a step holds any. ncu's graph mode
    times a kernel launched outside a graph with a large overhead of its own (a
    one-block kernel reads ~0.1 ms there, ~2 µs uncaptured), so the graphs'
    time is the figure that compares two builds' steps on the GPU."""
    graphs = [[k for k in step if k.kind == GRAPH] for step in found]
    return [spread(graphs, "the captured graph(s) of the step")] if graphs[0] else []


def report(kernels: Sequence[Kernel], layers: int | None, captured: bool = False) -> str:
    period = decode_period(kernels, shortest=1 if captured else 2)
    found = steps(kernels, period)
    median = [statistics.median(step[i].ns for step in found) for i in range(period)]
    last = found[-1]  # names, grids and kinds: the same in every step found
    what = "workloads (a captured graph is one)" if captured else "kernels"
    out = [f"{len(kernels)} {what} profiled; the decode step is {period} {what}, found {len(found)} times "
           "at the tail (medians below)", spread(found), *(graph_spread(found) if captured else []), "",
           "| # | kernel | grid | block | kind | µs |", "|---|---|---|---|---|---|"]  # fmt: skip
    for i, (kernel, ns) in enumerate(zip(last, median)):
        out.append(f"| {i} | {short(kernel.name)} | {kernel.grid} | {kernel.block} | {kernel.kind} | {ns / 1e3:.2f} |")
    total = sum(median)
    by_kind: dict[str, list[float]] = {}
    for kernel, ns in zip(last, median):
        by_kind.setdefault(kernel.kind, []).append(ns)
    out += ["", "| kind | kernels | µs | share |", "|---|---|---|---|"]
    for kind, times in sorted(by_kind.items(), key=lambda item: -sum(item[1])):
        out.append(f"| {kind} | {len(times)} | {sum(times) / 1e3:.1f} | {100 * sum(times) / total:.0f} % |")
    out.append(f"| all | {period} | {total / 1e3:.1f} | |")
    if layers:
        count = "" if captured else f"{period / layers:.1f} kernels, "  # a graph hides its kernels
        out.append(f"\nper layer (the step / {layers}, the head and sampling included): "
                   f"{count}{total / 1e3 / layers:.1f} µs")  # fmt: skip
    return "\n".join(out)


def load_text(path: Path, cell: str | None = None) -> str:
    """A saved table's text; with ``cell``, only the part the lease's ``collect``
    put under ``== .../profile-CELL/`` (its file holds every cell's table)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        text = f.read()
    if cell is None:
        return text
    parts = re.split(r"^== .*/profile-([\w.-]+)/$", text, flags=re.MULTILINE)
    cells = dict(zip(parts[1::2], parts[2::2]))
    if cell not in cells:
        raise SystemExit(f"no cell {cell!r} in {path}: it holds {sorted(cells) or 'no marked cells'}")
    return cells[cell]


def generate_command(args: argparse.Namespace, tokens: int) -> list[str]:
    capture = "--device-graph-capture" if args.capture else "--no-device-graph-capture"
    return [sys.executable, str(REPO / "run_max.py"), "generate", "--model-path", str(args.model),
            "--prompt", args.prompt, "--max-new-tokens", str(tokens), "--ignore-eos", "--top-k", "1",
            capture, "--max-length", "512", "--max-batch-size", "1",
            "--device-memory-utilization", str(args.memory_fraction)]  # fmt: skip


def compile_once(args: argparse.Namespace, env: dict[str, str]) -> int:
    """Loads, compiles and runs once without ncu and without the GPU lock
    (minutes on the host's CPUs), so the profiled run finds its weights and
    graph cached and holds the GPU for seconds."""
    warm = subprocess.run(generate_command(args, 2), env=env, capture_output=True, text=True)
    (args.out / "compile.txt").write_text(warm.stdout + warm.stderr)
    if warm.returncode != 0:
        print(f"max generate (without ncu) exited {warm.returncode}:\n{(warm.stdout + warm.stderr)[-3000:]}")
    else:
        print(f"compiled and ran once without ncu: {args.out / 'compile.txt'}", flush=True)
    return warm.returncode


def profile_once(args: argparse.Namespace, env: dict[str, str]) -> int:
    """The generate under ncu, holding the GPU lock; writes and prints the analysis."""
    log = args.out / "ncu.csv"
    graphs = ["--graph-profiling", "graph"] if args.capture else []
    command = [*NCU, *graphs, "--log-file", str(log), *generate_command(args, args.tokens)]
    print(" ".join(command), flush=True)
    with measuring(args.gpu_lock):
        result = subprocess.run(command, env=env)
    if result.returncode != 0:
        print(f"ncu / max generate exited {result.returncode}", flush=True)
    text = log.read_text() if log.exists() else ""
    with gzip.open(args.out / "kernels.csv.gz", "wt") as f:
        f.write(text)
    step = report(read_kernels(text), args.layers, captured=args.capture)
    (args.out / "step.txt").write_text(step + "\n")
    print(step)
    return result.returncode


def profile(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1",
           **dict(item.split("=", 1) for item in args.env)}  # fmt: skip
    if args.stage in ("compile", "both") and (code := compile_once(args, env)) != 0:
        return code
    return 0 if args.stage == "compile" else profile_once(args, env)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the checkpoint max generate runs")
    parser.add_argument("--out", type=Path, help="where ncu's table and the analysis go")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings for the run (ATTNQUANT_*)")
    parser.add_argument("--tokens", type=int,
                        help="new tokens, each past the first a decode step (24; 64 with --capture)")
    parser.add_argument("--prompt", default=WORD_PROMPT)
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="MAX's --device-memory-utilization")
    parser.add_argument("--stage", choices=("compile", "profile", "both"), default="both",
                        help="compile: load, compile and run once without ncu; profile: the run under ncu alone")
    parser.add_argument("--gpu-lock", type=Path, help="lock file held while ncu runs (serve_benchmark.py's)")
    parser.add_argument("--analyze", type=Path, help="only analyse a kernels.csv(.gz) written before")
    parser.add_argument("--cell", help="with --analyze on a lease's profile-kernels.csv.gz: that cell's table")
    parser.add_argument("--layers", type=int, help="the model's layer count: also print per-layer figures")
    parser.add_argument("--capture", action="store_true",
                        help="graph capture on, each captured graph timed whole (with --analyze: such a table)")
    args = parser.parse_args(argv)
    if args.tokens is None:
        args.tokens = 64 if args.capture else 24  # a captured step is one workload: more steps, same ncu time
    if args.analyze:
        print(report(read_kernels(load_text(args.analyze, args.cell)), args.layers, captured=args.capture))
        return 0
    if args.model is None or args.out is None:
        parser.error("--model and --out (or --analyze)")
    return profile(args)


if __name__ == "__main__":
    raise SystemExit(main())
