"""Kernel-level bench of the sm90 NVFP4 GEMV variants, without MAX.

Loads the PTX that bench/kernel_timing/build_ptx.sh compiled here (Mojo -> PTX for sm_90)
with CuPy on the GPU machine, checks every variant against a float64
reference, and times it with CUDA-graph replay over weight sets rotated past
the 60 MB L2, next to torch's bf16 matmul (cuBLAS) and device copy bandwidth.

Run (on the H200, from the repo root):  python3 bench/kernel_timing/nvfp4_ptx_bench.py --out $OUT
It needs torch + cupy only (kernels.sm90_layout is pure torch).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import warnings

import numpy as np
import torch

warnings.filterwarnings("ignore", category=DeprecationWarning)  # cupy ExternalStream

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kernels.sm90_layout import prepare_weights  # noqa: E402

# name -> (MT, TN, NW, KW_MAX, U, ACC) of nvfp4_gemv_sm90_kernel, as instantiated
# in bench/kernel_timing/nvfp4_ptx_harness.mojo (only the first four matter for the launch).
VARIANTS = {
    "gv0": (1, 1, 1, 16, 4, 1),
    "g1": (1, 1, 1, 16, 4, 2),
    "g2": (1, 1, 1, 16, 2, 1),
    "g3": (1, 1, 1, 16, 8, 1),
    "g4": (2, 1, 1, 16, 4, 2),
    "g5": (1, 2, 1, 16, 4, 1),
    "g6": (2, 2, 2, 8, 2, 1),
}
# cp.async ring variants (nvfp4_gemv_sm90_async_kernel): name -> (MT, TN, STAGES, ACC)
ASYNC = {
    "a2": (1, 1, 4, 4),
    "a5": (2, 2, 4, 2),
    "a6": (1, 2, 4, 2),
    "a9": (2, 2, 6, 2),
}
SMALL_M = ["gv0", "g1", "g2", "g3", "g5", "a2", "a6"]
LARGE_M = ["g4", "g6", "a5", "a9"]

SHAPES = [  # [N, K]
    (16384, 5376), (5376, 8192), (43008, 5376), (5376, 21504),
    (1536, 1152), (1152, 1024), (13824, 1152), (1152, 6912),
]  # fmt: skip
L2_BYTES = 60 * 2**20
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def pick_kw(blocks: int, k_groups: int, target_warps: int) -> int:
    """Same rule as _pick_kw in nvfp4_matmul.mojo."""
    kw = 4
    while kw < 16 and blocks * kw < target_warps:
        kw *= 2
    return max(min(kw, k_groups), 1)


def random_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (all 16 values) and varied valid E4M3 scales, on gen's device."""
    dev = gen.device
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    # E4M3 bits 0x28..0x5f (0.016 .. 240), and every 97th block a subnormal scale.
    scale_bits = torch.randint(0x28, 0x60, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev)
    sub = scale_bits.view(-1)[::97]
    sub.copy_(torch.randint(1, 8, sub.shape, dtype=torch.uint8, generator=gen, device=dev))
    return packed, scale_bits


def dequant_ref(packed: torch.Tensor, scale_bits: torch.Tensor, gs: float) -> torch.Tensor:
    """float64 [N, K] on packed's device, straight from the ModelOpt format."""
    n, kh = packed.shape
    dev = packed.device
    codes = torch.stack((packed & 15, packed >> 4), -1).view(n, 2 * kh).long()
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().to(dev)
    s = table[scale_bits.long()]
    return E2M1.to(dev)[codes] * s.repeat_interleave(16, 1) * gs


class Kernels:
    def __init__(self, ptx_dir: Path) -> None:
        import cupy as cp

        self.cp = cp
        self.funcs = {}
        for f in sorted(ptx_dir.glob("*.ptx")):
            entry = re.search(r"\.entry\s+([A-Za-z0-9_$]+)", f.read_text()).group(1)
            try:
                fn = cp.RawModule(path=str(f)).get_function(entry)
                # cp.async variants take up to ~80 KB of dynamic shared memory.
                fn.max_dynamic_shared_size_bytes = 160 * 1024
                self.funcs[f.stem] = fn
            except Exception as e:  # a variant that does not assemble is reported, not fatal
                print(f"cannot load {f.name}: {e}", flush=True)

    def launch(self, name, grid, block, args) -> None:
        cp = self.cp
        conv = [cp.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else np.int64(a) for a in args]
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.funcs[name](grid, block, tuple(conv))


def gemv_launch(ks: Kernels, variant: str, y, x, codes, scales, gs, m, n, k, kw=None, sms=132):
    if variant in ASYNC:
        return async_launch(ks, variant, y, x, codes, scales, gs, m, n, k, kw, sms)
    mt, tn, nw, kw_max = VARIANTS[variant][:4]
    nt, kg = codes.shape[0] // 16, codes.shape[1] // 32
    blocks = -(-nt // (nw * tn))
    kw = kw or pick_kw(blocks * nw, kg, 2560)
    kw = min(kw, kw_max)
    ks.launch(variant, (blocks, -(-m // (8 * mt)), 1), (nw * kw * 32, 1, 1), (y, x, codes, scales, gs, m, n, k, nt, kg, kw))
    return kw


def async_launch(ks: Kernels, variant: str, y, x, codes, scales, gs, m, n, k, kw=None, sms=132):
    mt, tn, stages, _acc = ASYNC[variant]
    nt, kg = codes.shape[0] // 16, codes.shape[1] // 32
    blocks = -(-nt // tn)
    kw = min(kw or pick_kw(blocks, kg, 1280), 16)
    smem = kw * stages * tn * 512 + kw * tn * mt * 512
    fn = ks.funcs[variant]
    cp = ks.cp
    args = (y, x, codes, scales, gs, m, n, k, nt, kg, kw)
    conv = [cp.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else np.int64(a) for a in args]
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        fn((blocks, -(-m // (8 * mt)), 1), (kw * 32, 1, 1), tuple(conv), shared_mem=smem)
    return kw


def time_graph(fn, replays: int = 20) -> float:
    """Median ms of one replay of a CUDA graph that calls fn() once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def copy_bandwidth() -> tuple[float, float]:
    """(device copy TB/s counting read + write, read-only TB/s via a sum)."""
    src = torch.randn(2**30 // 4 * 2, dtype=torch.float32, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    # An SM copy kernel (a graph-captured copy_ becomes a DMA memcpy node, ~2.7 TB/s).
    copy_ms = time_graph(lambda: torch.mul(src, 1.0, out=dst), 20)
    out = torch.empty(1, dtype=torch.float32, device="cuda")
    read_ms = time_graph(lambda: torch.sum(src.view(1, -1), dim=1, out=out), 20)
    nbytes = src.numel() * 4
    return 2 * nbytes / copy_ms / 1e9, nbytes / read_ms / 1e9


def ptxas_report(ptx_dir: Path) -> dict[str, str]:
    out = {}
    for f in sorted(ptx_dir.glob("*.ptx")):
        try:
            r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(f), "-o", "/dev/null"], capture_output=True, text=True, timeout=120)
            out[f.stem] = " ".join(line.split("info    : ")[-1] for line in r.stderr.splitlines() if "Used" in line or "spill" in line)
        except (OSError, subprocess.SubprocessError) as e:
            out[f.stem] = f"ptxas unavailable: {e}"
    return out


def profile_one(spec: str) -> None:
    var, n, k, m, kw = spec.split(":")
    n, k, m, kw = int(n), int(k), int(m), int(kw)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    packed, sb = random_weights(n, k, gen)
    codes, scales = prepare_weights(packed, sb)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    gs = torch.tensor([0.01], dtype=torch.float32, device=dev)
    ks = Kernels(ROOT / "bench" / "ptx")
    for _ in range(2):
        gemv_launch(ks, var, y, x, codes, scales, gs, m, n, k, kw)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", help="VARIANT:N:K:M:KW - launch it twice (for ncu -s 1 -c 1) and exit")
    args = ap.parse_args()
    if args.profile:
        return profile_one(args.profile)
    args.out.mkdir(parents=True, exist_ok=True)
    ptx_dir = ROOT / "bench" / "ptx"
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"device: {props.name}, {sms} SMs, torch {torch.__version__}", flush=True)
    for name, rep in ptxas_report(ptx_dir).items():
        print(f"ptxas {name}: {rep}", flush=True)
    ks = Kernels(ptx_dir)
    bw, read_bw = copy_bandwidth()
    print(f"copy bandwidth: {bw:.2f} TB/s (read+write), read-only (sum): {read_bw:.2f} TB/s", flush=True)

    ms = [int(v) for v in args.ms.split(",")]
    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    rows = []
    for (n, k) in SHAPES[:2] if args.quick else SHAPES:
        fp4_bytes = n * k * 0.5625
        r4 = max(2, min(64, math.ceil(3 * L2_BYTES / fp4_bytes)))
        r16 = max(2, min(64, math.ceil(3 * L2_BYTES / (2 * n * k))))
        sets = []
        for _ in range(r4):
            packed, sb = random_weights(n, k, gen)
            codes, scales = prepare_weights(packed, sb)
            sets.append((packed, sb, codes, scales))
        gs_val = 0.0123
        gs = torch.tensor([gs_val], dtype=torch.float32, device=dev)
        w_ref = dequant_ref(sets[0][0], sets[0][1], gs_val)  # float64 [n, k]
        w16 = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(r16)]

        # dequant kernel check (prepared layout -> bf16 W)
        wq = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device=dev)
        nt, kg = sets[0][2].shape[0] // 16, sets[0][2].shape[1] // 32
        ks.launch("dq", (-(-nt * kg // 8), 1, 1), (256, 1, 1), (wq, sets[0][2], sets[0][3], gs, n, k, kg, nt * kg))
        torch.cuda.synchronize()
        dq_err = ((wq.double() - w_ref).norm() / w_ref.norm()).item()
        dq_ms = time_graph(lambda: ks.launch("dq", (-(-nt * kg // 8), 1, 1), (256, 1, 1), (wq, sets[0][2], sets[0][3], gs, n, k, kg, nt * kg)))
        print(f"[{n},{k}] dequant: rel err {dq_err:.2e}, {dq_ms*1e3:.1f} us", flush=True)

        for m in ms:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ref = x.double() @ w_ref.T
            ys16 = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(r16)]
            bf16_ms = time_graph(lambda: [torch.matmul(x, w.T, out=y) for w, y in zip(w16, ys16)]) / r16
            variants = [v for v in (SMALL_M if m <= 8 else LARGE_M) if v in ks.funcs]
            best = None
            for var in variants:
                kws = [None] if args.quick else [None, 1, 2, 4, 8, 16]
                seen = set()
                for kw_try in kws:
                    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
                    used_kw = gemv_launch(ks, var, y, x, sets[0][2], sets[0][3], gs, m, n, k, kw_try, sms)
                    if used_kw in seen:
                        continue
                    seen.add(used_kw)
                    torch.cuda.synchronize()
                    err = ((y.double() - ref).norm() / ref.norm()).item()
                    finite = bool(torch.isfinite(y).all())
                    ys = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(r4)]
                    t = time_graph(lambda: [gemv_launch(ks, var, yy, x, s[2], s[3], gs, m, n, k, used_kw, sms) for s, yy in zip(sets, ys)]) / r4
                    tbs = fp4_bytes / (t * 1e-3) / 1e12
                    row = dict(n=n, k=k, m=m, variant=var, kw=used_kw, us=t * 1e3, tbs=tbs, pct_copy=100 * tbs / bw,
                               bf16_us=bf16_ms * 1e3, speedup=bf16_ms / t, err=err, all_written=finite, r4=r4, r16=r16)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if finite and err < 1e-2 and (best is None or t < best["us"] / 1e3):
                        best = dict(row, us=t * 1e3)
            if best:
                print(f"BEST [{n},{k}] M={m}: {best['variant']} kw={best['kw']} {best['us']:.1f} us "
                      f"{best['tbs']:.2f} TB/s ({best['pct_copy']:.0f}% copy) bf16 {best['bf16_us']:.1f} us -> {best['speedup']:.2f}x err {best['err']:.1e}", flush=True)
        del sets, w16, w_ref
        torch.cuda.empty_cache()
    print("\nsummary (best variant per shape and M):")
    print("| [N, K] | M | variant | kw | fp4 us | TB/s | % copy | bf16 us | speedup | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (n, k) in SHAPES:
        for m in ms:
            cand = [r for r in rows if r["n"] == n and r["k"] == k and r["m"] == m and r["all_written"] and r["err"] < 1e-2]
            if cand:
                b = min(cand, key=lambda r: r["us"])
                print(f"| {n}x{k} | {m} | {b['variant']} | {b['kw']} | {b['us']:.1f} | {b['tbs']:.2f} | {b['pct_copy']:.0f} | {b['bf16_us']:.1f} | {b['speedup']:.2f} | {b['err']:.1e} |")
    (args.out / "ptx_bench.json").write_text(json.dumps(dict(device=props.name, copy_tbs=bw, read_tbs=read_bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
