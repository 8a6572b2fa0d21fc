"""Which GEMV kernel each shape should run, per range of token rows, from a
kernel sweep's timed rows (bench/kernel_timing/kernels_h200.py --ranges).

The op runs one kernel for M <= 8 and one for 8 < M <= 16
(``attnquant.graph.nvfp4.sm90.SM90Tuned``), so a candidate replaces the
original kernel of a range only if it was timed at every M of that range and
was faster at each by more than the noise (two timings of one configuration
differ by up to 4 %). Pure Python: tested on CPU (tests/test_kernel_sweep.py).
"""

from __future__ import annotations

RANGES = {"narrow": (1, 2, 4, 8), "wide": (9, 12, 16)}
ORIGINAL = {"narrow": "gv0", "wide": "a5"}  # what the op's variant -1 runs there, kw picked
NOISE = 0.96  # a candidate must take at most this fraction of the original's time at every M
MAX_REL_ERR = 1e-2


def range_choices(rows: list[dict], op_variants: dict[str, int]) -> list[dict]:
    """One dict per (shape, range) that has the original kernel's timings:
    n, k, range, ms, original_us (per M), best (name, kw_arg) or None,
    best_us, worst (the best's largest time ratio to the original over the
    range), adopt (worst <= NOISE) and entry ((op variant, kw) or None).
    op_variants: the harness names the op can run, with their op variant
    (kernels the op cannot launch, diagnostics and PDL are left out)."""
    timed: dict[tuple[int, int, str, int], float] = {}
    for r in rows:
        if r.get("err", 0.0) < MAX_REL_ERR:
            key = (r["n"], r["k"], r["variant"], r["kw_arg"], r["m"])
            timed[key] = min(timed.get(key, float("inf")), r["us"])  # type: ignore[index]
    shapes = sorted({(n, k) for n, k, *_ in timed})
    out = []
    for n, k in shapes:
        for name, ms in RANGES.items():
            original = [timed.get((n, k, ORIGINAL[name], 0, m)) for m in ms]  # type: ignore[arg-type]
            if any(t is None for t in original):
                continue
            best, best_us, worst = None, None, float("inf")
            for cand in sorted({(v, kw) for nn, kk, v, kw, _ in timed if (nn, kk) == (n, k)}):
                if cand[0] not in op_variants or cand == (ORIGINAL[name], 0):
                    continue
                us = [timed.get((n, k, cand[0], cand[1], m)) for m in ms]  # type: ignore[arg-type]
                if any(t is None for t in us):
                    continue
                ratio = max(t / o for t, o in zip(us, original))  # type: ignore[operator]
                if ratio < worst:
                    best, best_us, worst = cand, us, ratio
            adopt = best is not None and worst <= NOISE
            out.append(dict(
                n=n, k=k, range=name, ms=ms, original_us=original, best=best, best_us=best_us,
                worst=worst if best else None, adopt=adopt,
                entry=(op_variants[best[0]], best[1]) if adopt and best else None,
            ))  # fmt: skip
    return out


def tuned_entries(choices: list[dict]) -> dict[tuple[int, int], dict[str, tuple[int, int]]]:
    """(N, K) -> {"narrow": (variant, kw), "wide": ...} for the adopted choices:
    the content of ``SM90_TUNED``."""
    table: dict[tuple[int, int], dict[str, tuple[int, int]]] = {}
    for c in choices:
        if c["entry"]:
            table.setdefault((c["n"], c["k"]), {})[c["range"]] = c["entry"]
    return table


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
