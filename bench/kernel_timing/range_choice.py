"""Which GEMV kernel each shape should run, per range of token rows, from
kernel sweeps' timed rows (bench/kernel_timing/kernels_h200.py --ranges).

The op runs one kernel for M <= 8 and one for 8 < M <= 16
(``attnquant.graph.nvfp4.sm90.SM90Tuned``), so a candidate replaces the
original kernel of a range only if it was timed at every M of that range in
every sweep and was faster at each by more than the noise (two timings of one
configuration differ by up to 4 %). Pure Python: tested on CPU
(tests/test_kernel_sweep.py). From stored sweeps:

    python bench/kernel_timing/range_choice.py SWEEP.jsonl[.gz] [SWEEP.jsonl[.gz] ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

RANGES = {"narrow": (1, 2, 4, 8), "wide": (9, 12, 16)}
ORIGINAL = {"narrow": "gv0", "wide": "a5"}  # what the op's variant -1 runs there, kw picked
NOISE = 0.96  # a candidate must take at most this fraction of the original's time at every M
MAX_REL_ERR = 1e-2

Timings = dict[tuple[int, int, str, int, int], tuple[float, int]]  # (n, k, variant, kw_arg, m) -> (us, kw used)


def _timings(rows: list[dict]) -> Timings:
    out: Timings = {}
    for r in rows:
        if r.get("err", 0.0) < MAX_REL_ERR:
            key = (r["n"], r["k"], r["variant"], r["kw_arg"], r["m"])
            if key not in out or r["us"] < out[key][0]:
                out[key] = (r["us"], r.get("kw", r["kw_arg"]))
    return out


def range_choices(sweeps: list[list[dict]], op_variants: dict[str, int]) -> list[dict]:
    """One dict per (shape, range) with the original kernel timed at every M
    in every sweep: n, k, range, ms, original_us and best_us (the first
    sweep's, per M), best ((name, kw_arg) or None), worst (the best's largest
    time ratio to the original over the range and the sweeps), adopt (worst
    <= NOISE) and entry ((op variant, kw the harness launched) or None).
    op_variants: the harness names one entry can name, with their op variant
    (kernels_h200.tunable_variants())."""
    tables = [_timings(rows) for rows in sweeps]
    shapes = sorted({(n, k) for n, k, *_ in tables[0]})
    out = []
    for n, k in shapes:
        for name, ms in RANGES.items():
            original = [[t.get((n, k, ORIGINAL[name], 0, m)) for m in ms] for t in tables]
            if any(o is None for per_sweep in original for o in per_sweep):
                continue
            best, worst = None, float("inf")
            for cand in sorted({(v, kw) for nn, kk, v, kw, _ in tables[0] if (nn, kk) == (n, k)}):
                if cand[0] not in op_variants or cand == (ORIGINAL[name], 0):
                    continue
                timed = [[t.get((n, k, *cand, m)) for m in ms] for t in tables]
                if any(c is None for per_sweep in timed for c in per_sweep):
                    continue
                ratio = max(c[0] / o[0] for cs, os_ in zip(timed, original) for c, o in zip(cs, os_))  # type: ignore[index]
                if ratio < worst:
                    best, worst = cand, ratio
            first = tables[0]
            adopt = best is not None and worst <= NOISE
            out.append(dict(
                n=n, k=k, range=name, ms=ms, original_us=[first[(n, k, ORIGINAL[name], 0, m)][0] for m in ms],
                best=best, best_us=[first[(n, k, *best, m)][0] for m in ms] if best else None,
                worst=worst if best else None, adopt=adopt,
                entry=(op_variants[best[0]], first[(n, k, *best, ms[0])][1]) if adopt and best else None,
            ))  # fmt: skip
    return out


def tuned_entries(choices: list[dict], checked: frozenset[int] | None = None) -> dict[tuple[int, int], dict[str, tuple[int, int]]]:
    """(N, K) -> {"narrow": (variant, kw), "wide": ...} for the adopted choices
    whose op variant is in ``checked`` (None: any): the content of ``SM90_TUNED``."""
    table: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
    for c in choices:
        if c["entry"] and (checked is None or c["entry"][0] in checked):
            table.setdefault((c["n"], c["k"]), {})[c["range"]] = c["entry"]
    return table


def report(choices: list[dict], names: dict[tuple[int, int], str], sweeps: int,
           checked: frozenset[int] | None = None) -> list[str]:
    """What a sweep or the CLI prints: the rule, the table, the entries the
    timings justify among ``checked`` op variants (None: any), and the
    faster candidates of the others."""
    lines = [f"{sweeps} sweep(s); adopted: at most {NOISE:.2f}x the original's time at every M of the range in each"]
    lines += choices_table(choices, names)
    lines.append(f"SM90_TUNED entries these timings justify: {tuned_entries(choices, checked)}")
    unchecked = sorted({c["entry"] for c in choices if c["entry"] and checked is not None and c["entry"][0] not in checked})
    if unchecked:
        lines.append(f"Also faster, with op variants not yet run through the op on a GPU (SM90_GPU_CHECKED): {unchecked}")
    return lines


def read_sweep(path: str | Path) -> list[dict]:
    """A sweep's timed rows from its .jsonl or .jsonl.gz."""
    path = Path(path)
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def choices_table(choices: list[dict], names: dict[tuple[int, int], str]) -> list[str]:
    """Markdown lines: per shape and range, the original kernel's times, the
    best candidate's, its worst ratio and whether it is adopted."""

    def times(ts: list[float] | None) -> str:
        return " / ".join(f"{t:.2f}" for t in ts) if ts else "-"

    lines = ["| shape | rows | original us | best (kw) | its us | worst ratio | adopted |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in choices:
        best = f"{c['best'][0]} ({c['best'][1] or 'picked'})" if c["best"] else "-"
        worst = f"{c['worst']:.2f}" if c["worst"] else "-"
        shape = f"{names.get((c['n'], c['k']), '')} {c['n']}x{c['k']}".strip()
        lines.append(f"| {shape} | M {c['ms'][0]}-{c['ms'][-1]} | {times(c['original_us'])} | {best} "
                     f"| {times(c['best_us'])} | {worst} | {'yes' if c['adopt'] else 'no'} |")  # fmt: skip
    return lines


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("sweeps", nargs="+", help="kernels_h200.py --ranges output: kernels.jsonl or .jsonl.gz")
    args = ap.parse_args(argv)
    from kernels_h200 import NAMES, tunable_variants  # this folder; imports torch

    from attnquant.graph.nvfp4.sm90 import SM90_GPU_CHECKED

    sweeps = [read_sweep(p) for p in args.sweeps]
    print("\n".join(report(range_choices(sweeps, tunable_variants()), NAMES, len(sweeps), SM90_GPU_CHECKED)))


if __name__ == "__main__":
    main(sys.argv[1:])
