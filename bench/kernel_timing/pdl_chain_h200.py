"""A 31B decoder layer's chain of attnquant's kernels, with and without
programmatic dependent launch (PDL), on an H100/H200 with no MAX.

In a Gemma 4 31B sliding layer at decode, five of our kernels run back to
back: o, the post-attention residual norm, gate|up (gated), down, the
layer-ending residual norm, and then the next layer's q|k|v. Each is a few to
fifty microseconds, and each launch costs about two of them before its first
load. With PDL every one of them lets the next start at once
(griddepcontrol.launch_dependents) and waits for the previous one's output
(griddepcontrol.wait) only where it needs it: the next kernel's launch and
block start overlap the previous kernel's last wave. This script measures
what that saves per layer before the op turns it on.

--geometry 1b and 4b time Gemma 3's layer shapes the same way (gate|up gated, as
ATTNQUANT_GATED_GEMV=1 runs it; the norm in its scaled form with the scale 1, which
costs what Gemma 3's unscaled form does), where each launch is a larger share.

The chain, per layer, at M rows: q|k|v; a gap kernel standing in for MAX's
kernels between q|k|v and o (the q/k/v norm, RoPE with the cache store,
attention: --gap us, launched plainly, so o cannot start early); o; norm;
gate|up gated; down; norm. Real data dependencies throughout (each kernel
reads the previous one's output; the norms chain the residual), enough layers
of weights in turn to pass L2 three times (at least --layers), timed by CUDA-graph replay
(kernels_h200.time_graph), the two modes alternating --rounds times:

  plain: gv0, zv0 (gated) and rn0, launched without the attribute (the op's default);
  pdl:   gd0, zd0 and rd0, launched with programmatic stream serialization (ATTNQUANT_PDL=1);
  early: ge0, ze0 and rd0: the GEMVs issue their first batch of weight loads before
         waiting (66 registers against 57: fewer warps an SM; not the op's form).
  late:  gl0, zl0 and rl0: each lets the next kernel start only after its own stores, as
         MAX's kernels do, not at its start (not the op's form either): safe beside a next
         kernel that reads before it waits, at the cost of most of the overlap.
  readonly: gdx, zdx and rdx, a control: pdl's kernels with what the previous kernel wrote
         loaded through the read-only path (ld.global.nc), as before pdl.mojo's rule. ptxas
         may move such a load above griddepcontrol.wait, and in rdx it does (x and the
         residual), so the norm can read its input before the GEMV has written it. Its
         chain differing from plain is reported, not counted as a failure.

Correctness first: each mode's GEMV against float64 (as kernels_h200.py checks
gv0) and bit for bit against gv0, its gated GEMV against zv0, its norm against rn0
and rn0 against a float64 reference with the graph's roundings, and the whole
chain's outputs bit for bit between the modes (a missing wait would read a buffer the
previous layer left), after the plain chain has given the same bits twice; then each mode's
chain captured as one CUDA graph (kernels back to back, where PDL overlaps them) and replayed
--replays times, every replay's buffers against the eager plain chain's. Any failure
(a control's apart): RESULT FAIL and exit 1.

HERE (no GPU): MOJO=.venv/bin/mojo bash bench/kernel_timing/build_ptx.sh
ON THE DEVICE: python3 bench/kernel_timing/pdl_chain_h200.py --out $OUT (carry bench/ptx;
~1 minute). --dry-run checks the script's flow on the CPU.
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

MODES = {
    "plain": ("gv0", "zv0", "rn0"),
    "pdl": ("gd0", "zd0", "rd0"),
    "early": ("ge0", "ze0", "rd0"),
    "late": ("gl0", "zl0", "rl0"),
    "readonly": ("gdx", "zdx", "rdx"),
}
CONTROLS = ("readonly",)
"""Modes whose chain may differ from plain: a difference is reported, not a failure."""
GEMVS, GATED_GEMVS, NORMS = (tuple(dict.fromkeys(kernels[i] for kernels in MODES.values())) for i in range(3))
PDL_NORMS = NORMS[1:]
NEEDED = ("pfw", *{name for kernels in MODES.values() for name in kernels})
GEOMETRIES = {"31b": kh.SHAPES_31B, "1b": kh.SHAPES_1B, "4b": kh.SHAPES_4B}
"""Each geometry's q|k|v, o, gate|up and down [N, K]; o's N is the hidden size."""
EPS = 1e-6
GAP_GRID, GAP_BLOCK = (132, 1, 1), (128, 1, 1)


class Proj:
    """One prepared NVFP4 weight (random codes and scales) and its global scale."""

    def __init__(self, n: int, k: int, gen: torch.Generator) -> None:
        self.packed, self.sb = kh.random_weights(n, k, gen)
        self.codes, self.scales = prepare_weights(self.packed, self.sb)
        self.n, self.k = n, k
        self.gs_val = 0.0123
        self.gs = torch.tensor([self.gs_val], dtype=torch.float32, device=gen.device)


class Layer:
    def __init__(self, shapes, gen: torch.Generator, scale: float) -> None:
        dev = gen.device
        self.qkv, self.o, self.gu, self.down = (Proj(n, k, gen) for n, k in shapes)
        self.hidden = self.o.n
        self.g = [torch.randn(self.hidden, dtype=torch.bfloat16, device=dev, generator=gen) * 0.1 for _ in range(4)]
        self.scale = torch.tensor([scale], dtype=torch.bfloat16, device=dev)

    @property
    def nbytes(self) -> int:
        return sum(p.codes.numel() + p.scales.numel() for p in (self.qkv, self.o, self.gu, self.down))


class State:
    """The chain's activations: every buffer a kernel reads or writes."""

    def __init__(self, m: int, shapes, gen: torch.Generator) -> None:
        dev = gen.device
        (nq, _), (hidden, ko), (ngu, _), _ = shapes

        def z(cols: int) -> torch.Tensor:
            return torch.zeros(m, cols, dtype=torch.bfloat16, device=dev)

        self.attn = torch.randn(m, ko, dtype=torch.bfloat16, device=dev, generator=gen)
        self.h0 = torch.randn(m, hidden, dtype=torch.bfloat16, device=dev, generator=gen)
        self.r0 = torch.randn(m, hidden, dtype=torch.bfloat16, device=dev, generator=gen)
        self.qkv, self.o, self.gu, self.down = z(nq), z(hidden), z(ngu // 2), z(hidden)
        self.n1, self.r1, self.n2, self.r2 = z(hidden), z(hidden), z(hidden), z(hidden)

    def reset(self) -> None:
        self.n2.copy_(self.h0)
        self.r2.copy_(self.r0)
        for t in (self.qkv, self.o, self.gu, self.down, self.n1, self.r1):
            t.zero_()

    def outputs(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).clone() for k in ("qkv", "o", "gu", "down", "n1", "r1", "n2", "r2")}


def norm(ks, name: str, normed, res_out, x, residual, g1, g2, scale) -> None:
    """rn0/rd0: one block a row, 8 values a thread (residual_norm.mojo)."""
    m, cols = x.shape
    args = [normed.data_ptr(), res_out.data_ptr(), x.data_ptr(), residual.data_ptr(), g1.data_ptr(),
            g2.data_ptr(), scale.data_ptr(), np.int64(cols), np.float32(EPS), np.float32(EPS),
            np.float32(0.0), np.float32(0.0)]  # fmt: skip
    if kh.DRY:
        n, r = norm_reference(x, residual, g1, g2, scale)
        normed.copy_(n.to(normed.dtype))
        res_out.copy_(r.to(res_out.dtype))
        return
    fn = ks.funcs[name]
    func_ptr = int(getattr(getattr(fn, "kernel", fn), "ptr"))
    attrs = kh.launch_attrs(name in PDL_NORMS, 1)
    threads = -(-cols // (8 * 32)) * 32  # 8 values a thread, whole warps
    kh.launch_ex(func_ptr, torch.cuda.current_stream().cuda_stream, (m, 1, 1), (threads, 1, 1), 0, args, attrs)


def norm_reference(x, residual, g1, g2, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 with the graph's bf16 roundings (the first norm's output, residual * s, the sum)."""
    bf = torch.bfloat16
    xd = x.double()
    n1 = (xd * torch.rsqrt((xd * xd).mean(-1, keepdim=True) + EPS) * g1.double()).to(bf)
    r = ((residual.double() * scale.double()).to(bf).double() + n1.double()).to(bf)
    rd = r.double()
    return rd * torch.rsqrt((rd * rd).mean(-1, keepdim=True) + EPS) * g2.double(), r.double()


def gap(ks, wait_us: float) -> None:
    if wait_us > 0:
        ks.raw("pfw", GAP_GRID, GAP_BLOCK, (0, 0, 0, 0, int(wait_us * 1e3), 32 * 1024))


def run_layer(ks, mode: str, layer: Layer, st: State, m: int, wait_us: float) -> None:
    gv, zv, rn = MODES[mode]
    ks.gemv(gv, st.qkv, st.n2, layer.qkv.codes, layer.qkv.scales, layer.qkv.gs, m, layer.qkv.n, layer.qkv.k)
    gap(ks, wait_us)
    ks.gemv(gv, st.o, st.attn, layer.o.codes, layer.o.scales, layer.o.gs, m, layer.o.n, layer.o.k)
    norm(ks, rn, st.n1, st.r1, st.o, st.r2, layer.g[0], layer.g[1], layer.scale)
    ks.gemv(zv, st.gu, st.n1, layer.gu.codes, layer.gu.scales, layer.gu.gs, m, layer.gu.n // 2, layer.gu.k)
    ks.gemv(gv, st.down, st.gu, layer.down.codes, layer.down.scales, layer.down.gs, m, layer.down.n, layer.down.k)
    norm(ks, rn, st.n2, st.r2, st.down, st.r1, layer.g[2], layer.g[3], layer.scale)


def replayed_outputs(ks, mode: str, layers: list[Layer], st: State, m: int, replays: int) -> list[dict[str, torch.Tensor]]:
    """The chain's buffers after each of `replays` replays of one CUDA graph of (reset, every
    layer, no gap kernel): launched back to back, so under PDL each kernel may start while
    the one before it still runs, as in a captured decode step. Launched one by one from
    Python, as the eager check does, the host's launch cost keeps them mostly apart."""

    def chain() -> None:
        st.reset()
        for layer in layers:
            run_layer(ks, mode, layer, st, m, 0.0)

    if kh.DRY:
        chain()
        return [st.outputs()] * replays
    graph = kh.capture_graph(chain)
    outs = []
    for _ in range(replays):
        graph.replay()
        kh.sync()
        outs.append(st.outputs())
    return outs


def checks(ks, layers: list[Layer], st: State, m: int, gen: torch.Generator, log, replays: int) -> list[str]:
    """Every way the PDL kernels could be wrong that this card can show; the failures."""
    bad: list[str] = []
    dev = gen.device
    for p in (layers[0].qkv, layers[0].o, layers[0].down):
        x = torch.randn(m, p.k, dtype=torch.bfloat16, device=dev, generator=gen)
        ys = {}
        for name in GEMVS:
            ys[name] = torch.full((m, p.n), float("nan"), dtype=torch.bfloat16, device=dev)
            ks.gemv(name, ys[name], x, p.codes, p.scales, p.gs, m, p.n, p.k)
        kh.sync()
        ref = x.double() @ kh.dequant_ref(p.packed, p.sb, p.gs_val).T
        for name in GEMVS[1:]:
            err = kh.rel_err(ys[name], ref)
            same = torch.equal(ys["gv0"], ys[name])
            log(f"{name} [{p.n},{p.k}] M={m}: rel err {err:.2e} against float64, equal to gv0: {same}")
            if not (err < 1e-2 and same):
                bad.append(f"{name} [{p.n},{p.k}]")
    p = layers[0].gu
    x = torch.randn(m, p.k, dtype=torch.bfloat16, device=dev, generator=gen)
    ys = {name: torch.full((m, p.n // 2), float("nan"), dtype=torch.bfloat16, device=dev) for name in GATED_GEMVS}
    for name, y in ys.items():
        ks.gemv(name, y, x, p.codes, p.scales, p.gs, m, p.n // 2, p.k)
    kh.sync()
    for name in GATED_GEMVS[1:]:
        same = torch.equal(ys["zv0"], ys[name]) and bool(torch.isfinite(ys[name]).all())
        log(f"{name} [{p.n},{p.k}] M={m}: equal to zv0: {same}")
        if not same:
            bad.append(name)
    lay = layers[0]
    x = torch.randn(m, lay.hidden, dtype=torch.bfloat16, device=dev, generator=gen)
    res = torch.randn(m, lay.hidden, dtype=torch.bfloat16, device=dev, generator=gen)
    outs = {}
    for name in NORMS:
        outs[name] = [torch.full((m, lay.hidden), float("nan"), dtype=torch.bfloat16, device=dev) for _ in range(2)]
        norm(ks, name, *outs[name], x, res, lay.g[0], lay.g[1], lay.scale)
    kh.sync()
    ref_n, ref_r = norm_reference(x, res, lay.g[0], lay.g[1], lay.scale)
    err = max(kh.rel_err(outs["rn0"][0], ref_n), kh.rel_err(outs["rn0"][1], ref_r))
    same = all(torch.equal(a, b) for name in PDL_NORMS for a, b in zip(outs["rn0"], outs[name]))
    log(f"rn0 [{m},{lay.hidden}]: rel err {err:.2e} against float64 with the graph's roundings; "
        f"{' and '.join(PDL_NORMS)} equal to rn0: {same}")
    if not (err < 4e-3 and same):
        bad.append("rn0/" + "/".join(PDL_NORMS))
    results = {}
    runs = {"plain": "plain", "plain again": "plain", **{mode: mode for mode in list(MODES)[1:]}}
    for run, mode in runs.items():  # plain twice: is the baseline itself repeatable?
        st.reset()
        for layer in layers:
            run_layer(ks, mode, layer, st, m, 5.0)
        kh.sync()
        results[run] = st.outputs()
    for run in list(results)[1:]:
        differ = [k for k in results["plain"] if not torch.equal(results["plain"][k], results[run][k])]
        finite = all(bool(torch.isfinite(t).all()) for t in results[run].values())
        worst = max((chain_diff(results["plain"][k], results[run][k]) for k in differ), default=0.0)
        control = run in CONTROLS
        log(f"chain of {len(layers)} layers, M={m}: {run} equal to plain in every buffer: {not differ} "
            f"{'(differ: ' + ', '.join(differ) + f'; largest difference {worst:.2e} of the largest value)' if differ else ''}"
            f"; finite: {finite}{' (a control: not a failure)' if control else ''}")
        if (differ or not finite) and not control:
            bad.append(f"chain ({run})")
    for mode in MODES:
        outs = replayed_outputs(ks, mode, layers, st, m, replays)
        equal = sum(all(torch.equal(results["plain"][k], out[k]) for k in out) for out in outs)
        control = mode in CONTROLS
        log(f"chain of {len(layers)} layers, M={m}, one CUDA graph replayed {replays} times: {mode} equal to "
            f"the eager plain chain in {equal} of {replays}{' (a control: not a failure)' if control else ''}")
        if equal < replays and not control:
            bad.append(f"replayed chain ({mode})")
    return bad


def chain_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |a|: a rounding apart (~1e-2 after a few bf16 layers) or garbage (~1)."""
    return float((a.double() - b.double()).abs().max() / a.double().abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="M (token rows) to time")
    ap.add_argument("--gaps", type=float, nargs="+", default=[12.0, 0.0],
                    help="us of the stand-in for MAX's kernels between q|k|v and o (0: none)")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="31b",
                    help="31b: Gemma 4's sliding layer (the norm scaled); 1b, 4b: Gemma 3's (scale 1)")
    ap.add_argument("--layers", type=int, default=3, help="at least this many layers of weights in turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=50, help="CUDA-graph replays of each mode's chain checked")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    kh.DRY = args.dry_run
    dev = torch.device("cpu" if kh.DRY else "cuda")
    shapes = GEOMETRIES[args.geometry]
    if kh.DRY:
        shapes = [(64, 128), (128, 64), (256, 128), (128, 128)]
        args.layers, args.rounds, args.replays = 2, 1, 2
    args.out.mkdir(parents=True, exist_ok=True)
    out = (args.out / "pdl_chain_h200.jsonl").open("w")
    log = functools.partial(print, flush=True)

    ks = kh.FakeKernels() if kh.DRY else kh.Kernels()
    missing = [n for n in NEEDED if n not in ks.funcs and not kh.DRY]
    if missing:
        raise SystemExit(f"bench/ptx/ lacks {missing}: run bench/kernel_timing/build_ptx.sh first")
    if not kh.DRY:
        p = torch.cuda.get_device_properties(0)
        log(f"device: {p.name}, {p.multi_processor_count} SMs")
        copy_tbs, _ = kh.bandwidth()
        log(f"copy bandwidth {copy_tbs:.2f} TB/s")
    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    scale = 0.75 if args.geometry == "31b" else 1.0
    layers = [Layer(shapes, gen, scale)]
    layer_bytes = layers[0].nbytes
    count = args.layers if kh.DRY else max(args.layers, -(-3 * kh.L2_BYTES // layer_bytes))
    layers += [Layer(shapes, gen, scale) for _ in range(count - 1)]
    log(f"{args.geometry} layer: {layer_bytes / 1e6:.1f} MB of weights, {count} layers in turn")
    bad: list[str] = []
    for m in args.rows:
        st = State(m, shapes, gen)
        bad += checks(ks, layers, st, m, gen, log, args.replays)
        for wait_us in args.gaps:
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    fn = lambda: [run_layer(ks, mode, layer, st, m, wait_us) for layer in layers]  # noqa: E731
                    times[mode].append(float(np.median(kh.time_graph(fn))) * 1e3 / len(layers))
            median = {mode: float(np.median(t)) for mode, t in times.items()}
            row = dict(geometry=args.geometry, m=m, gap_us=wait_us, layers=len(layers), layer_mb=layer_bytes / 1e6,
                       **{f"{mode}_us": t for mode, t in times.items()})
            out.write(json.dumps(row) + "\n")
            log(f"M={m} gap {wait_us:4.1f} us, a layer ({layer_bytes / 1e6:.0f} MB): "
                + ", ".join(f"{mode} {median[mode]:7.2f} us" + ("" if mode == "plain" else
                            f" (saved {median['plain'] - median[mode]:+.2f})") for mode in MODES)
                + "; rounds " + "; ".join(f"{mode} {' / '.join('%.2f' % t for t in times[mode])}" for mode in MODES))
    log(f"RESULT {'FAIL: ' + ', '.join(bad) if bad else 'OK'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
