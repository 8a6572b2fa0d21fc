"""NVFP4 weight-only GEMV through MAX on the H200: build, check, time, table.

One call does everything:

1. correctness through MAX on the GPU: ``attnquant.graph.nvfp4.nvfp4_linear``
   (the public entry, both weight layouts, so both Mojo GPU backends and the
   run-time ``F.cond`` to dequantize + matmul for M > 16) on a padded shape
   (N=24, K=80) for M in {1, 3, 8, 9, 16, 17, 64}, against float64;
2. timing: one MAX graph per weight-set count R holding R independent ops
   (``attnquant.nvfp4_gemv_sm90``, or a bf16 ``x @ W.T`` for the baseline),
   symbolic M/N/K, weights rotated past the 60 MB L2, captured as a device
   graph and replayed; every timed output is also checked against float64;
3. torch bf16 (cuBLAS, CUDA graph) as a cross-check of the MAX baseline, and
   device copy bandwidth as the ceiling.

Run on the H200 (after staging MAX, see ../shared/device/README.md):
    python3 bench/kernel_timing/nvfp4_gemv_h200.py --out $OUT
Here, without a GPU, ``--compile-only`` compiles every graph for sm_90a in
MAX's virtual-device mode (catches graph and kernel errors before a lease).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from attnquant.graph.ops import custom_extensions_path  # noqa: E402
from kernels.sm90_layout import prepare_weights  # noqa: E402

SHAPES_BIG = [(16384, 5376), (5376, 8192), (43008, 5376), (5376, 21504)]
SHAPES_GEMMA3_1B = [(1536, 1152), (1152, 1024), (13824, 1152), (1152, 6912)]
MS = [1, 4, 16]
L2_BYTES = 60 * 2**20
R_BIG, R_SMALL = 6, 64  # weight sets per timing graph (>= 2x L2 in FP4 bytes)
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def log(msg: str) -> None:
    print(msg, flush=True)


def random_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (all 16 values) and varied valid E4M3 scales incl. subnormals."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale_bits = torch.randint(0x28, 0x58, (n, k // 16), dtype=torch.uint8, generator=gen)
    sub = scale_bits.view(-1)[::97]
    sub.copy_(torch.randint(1, 8, sub.shape, dtype=torch.uint8, generator=gen))
    return packed, scale_bits


def reference_weight(packed: torch.Tensor, scale_bits: torch.Tensor, gs: float) -> torch.Tensor:
    n, half_k = packed.shape
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, 2 * half_k).long()
    return E2M1[codes] * E4M3[scale_bits.long()].repeat_interleave(16, dim=1) * gs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out.double() - ref).norm() / ref.norm())


class Max:
    """MAX session, devices and buffer helpers."""

    def __init__(self, compile_only: bool) -> None:
        from max import driver

        if compile_only:
            driver.set_virtual_device_api("cuda")
            driver.set_virtual_device_target_arch("sm_90a")
            driver.set_virtual_device_count(1)
        from max.engine import InferenceSession

        self.driver = driver
        self.gpu = driver.Accelerator()
        self.cpu = driver.CPU()
        self.session = InferenceSession(devices=[self.cpu, self.gpu])
        self.compile_only = compile_only

    def buf(self, t: torch.Tensor):
        return self.driver.Buffer.from_dlpack(t.contiguous()).to(self.gpu)

    def host(self, b) -> torch.Tensor:
        return torch.from_dlpack(b.to(self.cpu)).clone()

    def sync(self) -> None:
        self.gpu.synchronize()


# ---------------------------------------------------------------------------
# 1. Correctness of the public entry through MAX on the GPU
# ---------------------------------------------------------------------------


def check_public_entry(mx: Max, gen: torch.Generator) -> list[dict]:
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout
    from max.experimental.tensor import Tensor

    from attnquant.graph import nvfp4 as K

    n, k = 24, 80
    dev = mx.gpu

    def forward(x, codes, scales, packed, scale_bits, gs):
        y_sm90 = K.nvfp4_linear(x, codes, scales, gs, layout=K.WeightLayout.SM90, out_features=n)
        y_generic = K.nvfp4_linear(x, packed, scale_bits, gs, layout=K.WeightLayout.MODELOPT)
        return y_sm90, y_generic

    n16, k64 = 32, 128
    types = [
        TensorLayout(DType.bfloat16, ["m", k], dev),
        TensorLayout(DType.uint8, [n16, k64 // 2], dev),
        TensorLayout(DType.uint8, [n16, k64 // 16], dev),
        TensorLayout(DType.uint8, [n, k // 2], dev),
        TensorLayout(DType.uint8, [n, k // 16], dev),
        TensorLayout(DType.float32, [1], dev),
    ]
    t0 = time.time()
    run = compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=mx.session)(*types)
    log(f"public-entry graph compiled in {time.time() - t0:.1f} s")
    if mx.compile_only:
        return []
    rows = []
    for m in (1, 3, 8, 9, 16, 17, 64):
        packed, scale_bits = random_weights(n, k, gen)
        codes, scales = prepare_weights(packed, scale_bits)
        gs = 0.0137
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        ref = x.double() @ reference_weight(packed, scale_bits, gs).T
        args = [Tensor.from_dlpack(mx.buf(t)) for t in (x, codes, scales, packed, scale_bits, torch.tensor([gs]))]
        y_sm90, y_generic = (mx.host(o.driver_tensor if hasattr(o, "driver_tensor") else o) for o in run(*args))
        row = dict(m=m, sm90_err=rel_err(y_sm90, ref), generic_err=rel_err(y_generic, ref))
        rows.append(row)
        log(f"public entry [24,80] M={m}: mojo-sm90 rel err {row['sm90_err']:.2e}, mojo-gpu {row['generic_err']:.2e}")
    return rows


# ---------------------------------------------------------------------------
# 2. Timing graphs: R ops on R weight sets, symbolic shapes
# ---------------------------------------------------------------------------


def build_graph(mx: Max, kind: str, r: int, variant: int = -1):
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    from attnquant.graph import nvfp4 as K

    dev = DeviceRef.GPU(0)
    x_t = TensorType(DType.bfloat16, ["m", "k"], dev)
    if kind == "fp4":
        w_types = []
        for _ in range(r):
            w_types += [TensorType(DType.uint8, ["n", "kh"], dev), TensorType(DType.uint8, ["n", "ks"], dev)]
        inputs = [x_t, *w_types, TensorType(DType.float32, [1], dev)]
    else:
        inputs = [x_t, *[TensorType(DType.bfloat16, ["n", "k"], dev) for _ in range(r)]]
    with Graph(f"{kind}_r{r}", input_types=inputs, custom_extensions=[custom_extensions_path()]) as g:
        x = g.inputs[0]
        outs = []
        if kind == "fp4":
            gs = g.inputs[-1]
            for i in range(r):
                codes, scales = g.inputs[1 + 2 * i], g.inputs[2 + 2 * i]
                (y,) = ops.custom(
                    "attnquant.nvfp4_gemv_sm90",
                    dev,
                    [x, codes, scales, gs],
                    [TensorType(DType.bfloat16, ["m", "n"], dev)],
                    parameters={"variant": variant},
                )
                outs.append(y)
        else:
            for i in range(r):
                outs.append(ops.matmul(x, ops.transpose(g.inputs[1 + i], 0, 1)))
        g.output(*outs)
    t0 = time.time()
    model = mx.session.load(g)
    log(f"graph {kind} R={r} variant={variant} compiled in {time.time() - t0:.1f} s")
    return model


def time_model(mx: Max, model, inputs: list, key: int, reps: int) -> tuple[float, list, str]:
    """Median-free mean ms per replay over `reps` replays of a captured device
    graph (eager execute if capture is refused). Returns (ms, outputs, mode)."""
    outs = model.execute(*inputs)  # warm-up: loads kernels, allocates
    mx.sync()
    try:
        outs = model.capture(key, *inputs)
        model.replay(key, *inputs)
        mx.sync()
        step, mode = (lambda: model.replay(key, *inputs)), "graph-replay"
    except Exception as e:  # capture is best-effort in MAX
        log(f"capture failed ({type(e).__name__}: {str(e)[:120]}); timing eager execute")
        step, mode = (lambda: model.execute(*inputs)), "eager"
    for _ in range(3):
        step()
    mx.sync()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            step()
        mx.sync()
        times.append((time.perf_counter() - t0) * 1e3 / reps)
    return float(np.median(times)), outs, mode


def torch_bf16_ms(n: int, k: int, m: int, r: int) -> float:
    dev = torch.device("cuda")
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(r)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    ys = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(r)]

    def fn() -> None:
        for w, y in zip(ws, ys):
            torch.matmul(x, w.T, out=y)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times)) / r


def copy_bandwidth_tbs() -> float:
    src = torch.randn(2**29, dtype=torch.float32, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        torch.mul(src, 1.0, out=dst)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.mul(src, 1.0, out=dst)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return 2 * src.numel() * 4 / float(np.median(times)) / 1e9


def run_timing(mx: Max, gen: torch.Generator, shapes: list, r: int, reps: int) -> list[dict]:
    from attnquant.graph import nvfp4 as K

    fp4_model = build_graph(mx, "fp4", r)
    bf16_model = build_graph(mx, "bf16", r)
    if mx.compile_only:
        return []
    rows = []
    key = 1000 * r
    for n, k in shapes:
        sets, bufs = [], []
        for _ in range(r):
            packed, scale_bits = random_weights(n, k, gen)
            codes, scales = prepare_weights(packed, scale_bits)
            sets.append((packed, scale_bits))
            bufs += [mx.buf(codes), mx.buf(scales)]
        gs = 0.0123
        gs_buf = mx.buf(torch.tensor([gs], dtype=torch.float32))
        w_ref = reference_weight(*sets[0], gs)  # float64, CPU
        w16 = [mx.buf((torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)) for _ in range(r)]
        for m in MS:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            xb = mx.buf(x)
            key += 1
            fp4_ms, outs, mode = time_model(mx, fp4_model, [xb, *bufs, gs_buf], key, reps)
            err = rel_err(mx.host(outs[0]), x.double() @ w_ref.T)
            key += 1
            bf16_ms, _, mode16 = time_model(mx, bf16_model, [xb, *w16], key, reps)
            us4, us16 = fp4_ms * 1e3 / r, bf16_ms * 1e3 / r
            row = dict(n=n, k=k, m=m, r=r, fp4_us=us4, bf16_max_us=us16, err=err, mode=mode, mode_bf16=mode16,
                       fp4_tbs=n * k * 0.5625 / (us4 * 1e-6) / 1e12, speedup_max=us16 / us4)
            rows.append(row)
            log(json.dumps(row))
        del bufs, w16, sets
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--compile-only", action="store_true", help="virtual sm_90a device; compile every graph, run nothing")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    gen = torch.Generator().manual_seed(int(time.time()))
    t_start = time.time()

    mx = Max(args.compile_only)
    entry_rows = check_public_entry(mx, gen)
    rows = run_timing(mx, gen, SHAPES_BIG, R_BIG, args.reps)
    rows += run_timing(mx, gen, SHAPES_GEMMA3_1B, R_SMALL, max(4, args.reps // 4))
    if args.compile_only:
        log(f"compile-only: every graph compiled ({time.time() - t_start:.0f} s)")
        return

    copy_tbs, torch_note = float("nan"), ""
    try:
        copy_tbs = copy_bandwidth_tbs()
        for row in rows:
            r16 = max(2, min(64, math.ceil(3 * L2_BYTES / (2 * row["n"] * row["k"]))))
            row["bf16_torch_us"] = torch_bf16_ms(row["n"], row["k"], row["m"], r16) * 1e3
    except Exception as e:  # torch next to MAX in one process: report, do not fail the run
        torch_note = f"torch cross-check failed: {type(e).__name__}: {e}"
        log(torch_note)

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    result = dict(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), device=props.name if props else "?",
        copy_tbs=copy_tbs, public_entry=entry_rows, rows=rows, torch_note=torch_note,
        max_version=__import__("max").__version__ if hasattr(__import__("max"), "__version__") else "26.7",
    )  # fmt: skip
    (args.out / "nvfp4_gemv_h200.json").write_text(json.dumps(result, indent=1))

    log(f"\n{result['device']}, copy bandwidth {copy_tbs:.2f} TB/s (read+write), {result['date']}")
    log("| [N, K] | M | NVFP4 µs | TB/s (0.5625 B/elt) | % copy | bf16 MAX µs | bf16 torch µs | vs MAX | vs torch | rel err |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r.get("bf16_torch_us", float("nan"))
        log(f"| {r['n']}x{r['k']} | {r['m']} | {r['fp4_us']:.1f} | {r['fp4_tbs']:.2f} | {100 * r['fp4_tbs'] / copy_tbs:.0f} "
            f"| {r['bf16_max_us']:.1f} | {t:.1f} | {r['speedup_max']:.2f}x | {t / r['fp4_us']:.2f}x | {r['err']:.1e} |")
    log(f"timing mode: {sorted({r['mode'] for r in rows})}; total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
