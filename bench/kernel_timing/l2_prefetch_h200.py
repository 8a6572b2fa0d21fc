"""Does a projection run faster when the kernels before it have already
brought its weights into L2? On the H200, with no MAX.

Between two projections a decoder layer runs MAX's own kernels (norms, RoPE,
the KV-cache write, attention: ~1 ms of a 31B step at one request), during
which HBM is nearly idle. The copy engine can use that time: a
`cp.async.bulk.prefetch.L2` costs the issuing thread one instruction and no
register. This script measures what that would buy before any op changes.

The gap is the diagnostic kernel `pfw` (nvfp4_ptx_harness.mojo): it issues
L2 prefetches of a weight's first bytes (or none), then one thread waits a
fixed time. Everything is timed with CUDA-graph replay over weight sets
rotated past L2 (kernels_h200.time_graph), so each projection starts cold
unless prefetched.

1. One projection after a gap of T us: [gap(T, prefetch P bytes of W_i),
   gv0(W_i)] against [gap(T), gv0(W_i)], for the Gemma 4 31B and Gemma 3 1B
   and 4B projection shapes at one row. Also gv0 alone, and gv0 with its
   weights already in L2 (the same set every launch: what prefetch could
   give at best).
2. A 31B decoder layer's chain at one row, q|k|v, gap, o, gap, gate|up, gap,
   down, gap (--layer-gaps, us), three layers' weights in turn: no prefetch;
   each gap prefetching the next projection's first --caps MB; or each GEMV
   doing so once its warps are done (gvn, nvfp4_gemv_sm90_next_kernel: no
   launch of its own, the prefetch starts during the GEMV's tail).

Measured on an H100 (docs/dev/kernels.md, seventh sweep): no. A weight
already in L2 saves at most 17 % of one projection's time (o), and the bulk
prefetches stream at ~0.9 TB/s and hold up the kernels that follow.

HERE (no GPU): MOJO=.venv/bin/mojo bash bench/kernel_timing/build_ptx.sh
ON THE DEVICE: python3 bench/kernel_timing/l2_prefetch_h200.py --out $OUT
(carry bench/ptx; ~1 minute). --dry-run checks the script's flow on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_h200 as kh  # noqa: E402  (this folder: the loader, weights and timing)

from kernels.sm90_layout import prepare_weights  # noqa: E402  (kernels_h200 put the root on sys.path)

PIECE = 32 * 1024  # bytes per prefetch request
GAP_GRID = (132, 1, 1)
GAP_BLOCK = (128, 1, 1)


class Weight:
    """One prepared weight and what a gap needs to prefetch its first bytes."""

    def __init__(self, n: int, k: int, gen: torch.Generator) -> None:
        packed, sb = kh.random_weights(n, k, gen)
        self.n, self.k = n, k
        self.codes, self.scales = prepare_weights(packed, sb)
        self.nbytes = self.codes.numel() + self.scales.numel()

    def prefix(self, cap: int) -> tuple[int, int]:
        """(code bytes, scale bytes) of the first `cap` bytes' share of the
        n-tiles, each a multiple of 16: the rows gv0's first blocks read."""
        f = min(1.0, cap / self.nbytes)
        return int(self.codes.numel() * f) // 16 * 16, int(self.scales.numel() * f) // 16 * 16


def gap(ks, w: Weight | None, cap: int, wait_us: float) -> None:
    """pfw: wait_us, prefetching w's first cap bytes (none: null pointers, 0 bytes, never read)."""
    cb, sb = w.prefix(cap) if (w is not None and cap > 0) else (0, 0)
    c, s = (w.codes, w.scales) if w is not None else (0, 0)
    ks.raw("pfw", GAP_GRID, GAP_BLOCK, (c, cb, s, sb, int(wait_us * 1e3), PIECE))


def us_per(fn, count: int, replays: int = 20) -> float:
    return float(np.median(kh.time_graph(fn, replays))) * 1e3 / count


def single_projection(ks, dev, gen, shapes, gaps, caps, log, record) -> None:
    gs = torch.tensor([0.0123], dtype=torch.float32, device=dev)
    for n, k in shapes:
        nbytes = n * k * kh.FP4_BYTES_PER_WEIGHT
        r = max(3, min(32, int(np.ceil(3 * kh.L2_BYTES / nbytes))))
        sets = [Weight(n, k, gen) for _ in range(r)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        ys = [torch.empty(1, n, dtype=torch.bfloat16, device=dev) for _ in range(r)]
        kw = ks.gemv("gv0", ys[0], x, sets[0].codes, sets[0].scales, gs, 1, n, k)
        cold = us_per(lambda: [ks.gemv("gv0", y, x, w.codes, w.scales, gs, 1, n, k, kw) for w, y in zip(sets, ys)], r)
        hot = us_per(lambda: [ks.gemv("gv0", y, x, sets[0].codes, sets[0].scales, gs, 1, n, k, kw) for y in ys], r)
        base = dict(n=n, k=k, name=kh.NAMES.get((n, k), "cell"), mb=nbytes / 1e6, kw=kw, cold_us=cold, hot_us=hot)
        log(f"{base['name']} [{n},{k}] {base['mb']:.1f} MB kw={kw}: gv0 cold {cold:.2f} us, L2-hot {hot:.2f} us")
        for t in gaps:
            gap_only = us_per(lambda: [gap(ks, None, 0, t) for _ in sets], r)
            without = us_per(lambda: [(gap(ks, None, 0, t), ks.gemv("gv0", y, x, w.codes, w.scales, gs, 1, n, k, kw))
                                      for w, y in zip(sets, ys)], r)
            for cap in caps:
                with_pf = us_per(lambda: [(gap(ks, w, cap, t), ks.gemv("gv0", y, x, w.codes, w.scales, gs, 1, n, k, kw))
                                          for w, y in zip(sets, ys)], r)
                row = dict(base, part="single", gap_us=t, cap_mb=cap / 1e6, gap_only_us=gap_only,
                           without_us=without, with_us=with_pf, saved_us=without - with_pf)
                record(row)
                log(f"  gap {t:5.1f} us, prefetch {min(cap, nbytes) / 1e6:5.1f} MB: gap+gv0 {without:7.2f} -> "
                    f"{with_pf:7.2f} us (saved {without - with_pf:+6.2f}; gap alone {gap_only:.2f})")
        # The prefetch must not change the result (it only moves bytes into L2).
        y0 = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        ks.gemv("gv0", y0, x, sets[1].codes, sets[1].scales, gs, 1, n, k, kw)
        gap(ks, sets[1], max(caps), 0)
        ks.gemv("gv0", ys[1], x, sets[1].codes, sets[1].scales, gs, 1, n, k, kw)
        kh.sync()
        assert torch.equal(y0, ys[1]), f"[{n},{k}]: output changed after an L2 prefetch"
        del sets
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def tail_gemv(ks, y, x, w: Weight, gs, nxt: Weight, cap: int, sms: int) -> None:
    """gvn: gv0 whose last wave's warps, once their k slices are done, prefetch
    the next weight's first `cap` bytes into L2 (no launch of its own)."""
    nt, kg = w.codes.shape[0] // 16, w.codes.shape[1] // 32
    kw = kh.reg_kw(nt, kg)
    first_block = max(0, nt - sms * (32 // kw))  # gv0: 32 warps an SM at 64 registers
    cb, sb = nxt.prefix(cap)
    ks.raw("gvn", (nt, 1, 1), (kw * 32, 1, 1),
           (y, x, w.codes, w.scales, gs, 1, w.n, w.k, nt, kg, kw, nxt.codes, cb, nxt.scales, sb, first_block))


def layer_chain(ks, dev, gen, shapes, gaps, caps, log, record, sms: int, layers: int = 3) -> None:
    """shapes: a layer's projections in the order it runs them."""
    gs = torch.tensor([0.0123], dtype=torch.float32, device=dev)
    stack = [[Weight(n, k, gen) for n, k in shapes] for _ in range(layers)]
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen) for _, k in shapes}
    ys = {n: torch.empty(1, n, dtype=torch.bfloat16, device=dev) for n, _ in shapes}

    def chain(policy: str, cap: int) -> None:
        """policy none: gv0 and plain gaps; gap: each gap prefetches the next
        projection's first cap bytes; tail: gvn does, at the end of the one before."""
        for li, layer in enumerate(stack):
            for pi, w in enumerate(layer):
                nxt = layer[pi + 1] if pi + 1 < len(layer) else stack[(li + 1) % layers][0]
                if policy == "tail":
                    tail_gemv(ks, ys[w.n], xs[w.k], w, gs, nxt, cap, sms)
                else:
                    ks.gemv("gv0", ys[w.n], xs[w.k], w.codes, w.scales, gs, 1, w.n, w.k)
                if policy == "gap" or gaps[pi] > 0:
                    gap(ks, nxt, cap if policy == "gap" else 0, gaps[pi])

    gaps_only = us_per(lambda: [gap(ks, None, 0, t) for _ in stack for t in gaps if t > 0], layers)
    for policy, cap in [("none", 0)] + [(p, c) for p in ("gap", "tail") for c in caps]:
        t = us_per(lambda: chain(policy, cap), layers)
        record(dict(part="chain", policy=policy, gaps_us=list(gaps), cap_mb=cap / 1e6, layer_us=t,
                    gaps_only_us=gaps_only))
        log(f"31B layer chain, gaps {gaps} us, prefetch {policy} {cap / 1e6:.0f} MB: {t:.2f} us per layer "
            f"({t - gaps_only:.2f} us beyond the gaps alone, {gaps_only:.2f})")
    # The tail prefetch must not change a result.
    w, nxt = stack[0][1], stack[0][2]
    y0, y1 = (torch.empty(1, w.n, dtype=torch.bfloat16, device=dev) for _ in range(2))
    ks.gemv("gv0", y0, xs[w.k], w.codes, w.scales, gs, 1, w.n, w.k)
    if kh.DRY:
        ks.gemv("gv0", y1, xs[w.k], w.codes, w.scales, gs, 1, w.n, w.k)
    else:
        tail_gemv(ks, y1, xs[w.k], w, gs, nxt, max(caps), sms)
    kh.sync()
    assert torch.equal(y0, y1), "gvn's output differs from gv0's"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--gaps", default="0,5,10,20", help="part 1: gap lengths, us")
    ap.add_argument("--caps", default="24,40", help="MB prefetched per gap (0, no prefetch, is always timed in part 2)")
    ap.add_argument("--layer-gaps", default="15,6,0,6",
                    help="part 2: us after q|k|v, o, gate|up, down (MAX's kernels between them)")
    ap.add_argument("--shapes", default="31b,1b,4b")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    kh.DRY = args.dry_run
    dev = torch.device("cpu" if kh.DRY else "cuda")
    gaps = [float(v) for v in args.gaps.split(",")]
    caps = [int(float(v) * 1e6) for v in args.caps.split(",")]
    layer_gaps = [float(v) for v in args.layer_gaps.split(",")]
    if len(layer_gaps) != 4:
        raise SystemExit(f"--layer-gaps: {args.layer_gaps!r} needs four values (after q|k|v, o, gate|up, down)")
    shapes = {"31b": kh.SHAPES_31B, "1b": kh.SHAPES_1B, "4b": kh.SHAPES_4B}
    chosen = [s for key in args.shapes.split(",") for s in shapes[key]]
    layer = kh.SHAPES_31B  # q|k|v, o, gate|up, down, in the order a layer runs them
    if kh.DRY:
        chosen, layer = [(48, 320)], [(48, 320), (32, 64), (64, 320), (32, 128)]
    args.out.mkdir(parents=True, exist_ok=True)
    out = (args.out / "l2_prefetch_h200.jsonl").open("w")

    log = functools.partial(print, flush=True)

    def record(row: dict) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()

    ks = kh.FakeKernels() if kh.DRY else kh.Kernels()
    if "pfw" not in ks.funcs and not kh.DRY:
        raise SystemExit("bench/ptx/pfw.* missing: run bench/kernel_timing/build_ptx.sh first")
    sms = 132
    if not kh.DRY:
        p = torch.cuda.get_device_properties(0)
        sms = p.multi_processor_count
        log(f"device: {p.name}, {p.multi_processor_count} SMs, L2 {p.L2_cache_size >> 20} MB")
        copy_tbs, read_tbs = kh.bandwidth()
        log(f"copy bandwidth {copy_tbs:.2f} TB/s, read-only {read_tbs:.2f} TB/s")
    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    t0 = time.time()
    single_projection(ks, dev, gen, chosen, gaps, caps, log, record)
    log(f"part 1: {time.time() - t0:.0f} s")
    layer_chain(ks, dev, gen, layer, layer_gaps, caps, log, record, sms)
    log(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
