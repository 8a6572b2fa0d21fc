"""The kernels a decode step launches, read from MAX's compiled graph: no GPU needed.

    python bench/harness/graph_launches.py --model DIR --out DIR [--env NAME=VALUE ...] [--arch sm_90a]
    python bench/harness/graph_launches.py --analyze OUT/Gemma4.mgp.mlir [--layers N]

MAX 26.7 compiles for a GPU it does not have in its virtual-device mode, and
with ``MODULAR_DEBUG=ir-output-dir=DIR`` writes each graph's IR at every
stage. The last stage (``<graph>.mgp.mlir``) is the program the runtime
executes: one ``mgp.generic.execute`` per unit of work, the asynchronous ones
on the GPU, each summarised by the fusion that made it (``Sequence(mo.cast,
Epilogue(Prologue(mo.static.reshape, mo.reduce.rms_norm), ...), ...)``).
Every op or fused group at the top of a summary is one kernel launch; a
``grt.if`` runs one of its two regions (the large-M and GEMV routes of each
projection), and the decode step takes the region holding attnquant's GEMV.

``--model`` runs ``max generate`` (through run_max.py, so attnquant's
architectures and ``ATTNQUANT_*`` settings apply) for a virtual ``--arch``
until its first request fails (nothing can run on a virtual device), then
analyses the largest graph written: the language model. That takes minutes
on two cores for a small checkpoint. The list is the same kernel sequence an
ncu profile of the step shows on the GPU (``step_profile.py``), less the
kernels a library call adds inside one op (MAX's attention, sampling):
compare launch counts between builds here, times on the device.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("Epilogue", "Prologue", "View", "Elementwise")  # fused groups: one launch each
LAUNCHING = ("mo.", "rmo.", "custom__")  # MGP's own steps (mgp., index., pop., kgen.) run on the host
_ON_GPU = '!mgp.device_context<<"gpu"'  # an execute handed a GPU stream; the rest run on the host
_EXECUTE = re.compile(r'dSummary = "([^"]*)", eIsAsync = (true|false)')

_CHILD = """
import os, sys
from max import driver
driver.set_virtual_device_api("cuda")
driver.set_virtual_device_target_arch(sys.argv[1])
driver.set_virtual_device_count(1)
sys.path.insert(0, sys.argv[2])
from attnquant.tools.max_cli import main
sys.argv = ["run_max.py", "generate", "--model-path", sys.argv[3], "--devices", "gpu", "--prompt", "hello",
            "--max-new-tokens", "2", "--max-length", "512"]
try:
    main()
finally:  # a virtual-device process can abort in teardown (attnquant.max_compat)
    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def _top_level(text: str) -> list[str]:
    """``text``'s comma-separated items outside any parentheses."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    items.append(text[start:].strip())
    return [item for item in items if item]


def _ops(item: str) -> list[str]:
    """The graph ops named in ``item``, in order, once each."""
    return list(dict.fromkeys(re.findall(r"(?:custom__)?[a-z]+\.[a-z0-9_.]+", item)))


def launches(summary: str) -> list[str]:
    """The kernel launches of one execute's summary, each named by its ops."""
    body = summary[len("Sequence(") : -1] if summary.startswith("Sequence(") else summary
    found = []
    for item in _top_level(body):
        head = item.split("(", 1)[0]
        if head in GROUPS or head.startswith(LAUNCHING):
            found.append(", ".join(op for op in _ops(item) if op.startswith(LAUNCHING)))
    return found


def _regions(lines: Sequence[str]) -> Iterator[str]:
    """The lines of ``$exec`` a decode step runs: of each ``grt.if``, the
    region that launches attnquant's GEMV (else its first)."""
    i = 0
    while i < len(lines):
        line = lines[i]
        if "grt.if" not in line:
            yield line
            i += 1
            continue
        regions, current, depth = [], [], 1
        for j in range(i + 1, len(lines)):
            depth += lines[j].count("{") - lines[j].count("}")
            if depth == 1 and lines[j].strip().startswith("} else {"):
                regions.append(current)
                current = []
            elif depth == 0:
                regions.append(current)
                i = j + 1
                break
            else:
                current.append(lines[j])
        chosen = next((r for r in regions if any("nvfp4_gemv" in x for x in r)), regions[0])
        yield from _regions(chosen)


def step_launches(mgp: str) -> list[str]:
    """Every kernel launch of a decode step of the compiled graph ``mgp`` (the text of a ``.mgp.mlir``)."""
    start = mgp.find("$exec(")
    if start < 0:
        raise ValueError("no $exec callable: not a .mgp.mlir of a compiled graph")
    lines = mgp[start:].splitlines()
    found = []
    for line in _regions(lines):
        match = _EXECUTE.search(line)
        if match and match.group(2) == "true" and _ON_GPU in line:
            found += launches(match.group(1))
    return found


def report(found: Sequence[str], layers: int | None) -> str:
    out = [f"{len(found)} kernel launches a decode step", "", "| # | ops |", "|---|---|"]
    out += [f"| {i} | {ops} |" for i, ops in enumerate(found)]
    out += ["", "| ops | launches |", "|---|---|"]
    out += [f"| {ops} | {n} |" for ops, n in Counter(found).most_common()]
    if layers:
        out.append(f"\nper layer (the step / {layers}, the head and sampling included): {len(found) / layers:.1f}")
    return "\n".join(out)


def compile_virtually(model: Path, out: Path, arch: str, env: dict[str, str]) -> Path:
    """Compiles ``model`` for a virtual ``arch`` with its IR written to ``out``; the language model's .mgp.mlir."""
    out.mkdir(parents=True, exist_ok=True)
    # A cache of its own: a graph found compiled in MAX's cache writes no IR.
    child_env = {**os.environ, "HF_HUB_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1",
                 "MODULAR_DEBUG": f"ir-output-dir={out}", "MODULAR_CACHE_DIR": str(out / "cache"), **env}  # fmt: skip
    with open(out / "generate.log", "w") as log:
        subprocess.run([sys.executable, "-c", _CHILD, arch, str(REPO), str(model)], env=child_env,
                       stdout=log, stderr=subprocess.STDOUT, check=False)  # fmt: skip
    graphs = sorted(out.glob("*.mgp.mlir"), key=lambda p: p.stat().st_size)
    if not graphs:
        raise SystemExit(f"no graph was compiled: see {out / 'generate.log'}")
    return graphs[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a checkpoint to compile")
    parser.add_argument("--out", type=Path, help="where MAX writes its IR (GBs: every stage of every graph)")
    parser.add_argument("--arch", default="sm_90a", help="the virtual GPU's target (sm_90a: H100, H200)")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for the compile")
    parser.add_argument("--analyze", type=Path, help="a .mgp.mlir written before")
    parser.add_argument("--layers", type=int, help="the model's layer count: also print launches per layer")
    args = parser.parse_args()
    if args.analyze is None and (args.model is None or args.out is None):
        parser.error("give --model and --out, or --analyze")
    env = dict(item.split("=", 1) for item in args.env)
    mgp = args.analyze or compile_virtually(args.model, args.out, args.arch, env)
    print(f"== {mgp}")
    print(report(step_launches(mgp.read_text()), args.layers))


if __name__ == "__main__":
    main()
