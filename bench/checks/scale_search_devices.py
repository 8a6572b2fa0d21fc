"""NVFP4 scale selection on the GPU against the CPU: the same bits, and how fast.

    python3 bench/checks/scale_search_devices.py [--device cuda] [--size 8192]

For every scale search (rtn, mse, weighted) and input dtype, random weights
with outliers (heavy tails, one huge element per block, zero blocks) are
quantized on the CPU and on ``--device`` with the same importance vector;
the packed codes, block scales and global scale must be equal bit for bit
(the quantized-weight cache is shared between CPU and GPU preparation).
Then one ``--size`` x ``--size`` bf16 tensor is timed on ``--device``
(median of 5): seconds per 10^9 weights. Prints a table; exits 1 on any
difference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from attnquant.formats import nvfp4  # noqa: E402
from attnquant.formats.nvfp4 import ScalePolicy  # noqa: E402

KINDS = ("gaussian", "heavy", "outlier", "zero-blocks", "large")
"""``large``: 2048 x 4096 Gaussian, big enough for the encoders' lookup tables."""


def weights(kind: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    n, k = (2048, 4096) if kind == "large" else (512, 1024)
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=generator) * 0.02
    if kind == "heavy":
        w = w * torch.rand(n, k, generator=generator).pow(-2)
    elif kind == "outlier":
        w.view(n, k // 16, 16)[:, :, 3] *= 300
    elif kind == "zero-blocks":
        w.view(n, k // 16, 16)[:, ::3] = 0
    return w.clamp(-60000, 60000).to(dtype)


def same_bits(a: nvfp4.NVFP4Weight, b: nvfp4.NVFP4Weight) -> bool:
    return (
        torch.equal(a.packed.cpu(), b.packed.cpu())
        and torch.equal(a.block_scale_bits().cpu(), b.block_scale_bits().cpu())
        and torch.equal(a.global_scale.cpu(), b.global_scale.cpu())
    )


def quantize(w: torch.Tensor, policy: ScalePolicy, importance: torch.Tensor) -> nvfp4.NVFP4Weight:
    extra = {"importance": importance.to(w.device)} if policy is ScalePolicy.WEIGHTED else {}
    return nvfp4.quantize(w, scale_policy=policy, **extra)


def seconds(fn, device: torch.device, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()
    device = torch.device(args.device)
    differences = 0
    print(f"CPU vs {device}: same bits? (512 x 1024 each; large 2048 x 4096)")
    print("| search | dtype | " + " | ".join(KINDS) + " |\n|---|---|" + "---|" * len(KINDS))
    for policy in ScalePolicy:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cells = []
            for seed, kind in enumerate(KINDS):
                w = weights(kind, dtype, seed)
                importance = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(seed)).pow(3)
                same = same_bits(quantize(w, policy, importance), quantize(w.to(device), policy, importance))
                differences += not same
                cells.append("same" if same else "DIFFERENT")
            print(f"| {policy.value} | {str(dtype).removeprefix('torch.')} | " + " | ".join(cells) + " |", flush=True)
    big = (torch.randn(args.size, args.size) * 0.02).bfloat16().to(device)
    importance = torch.rand(args.size).pow(3).to(device)
    print(f"\n{args.size} x {args.size} bf16 on {device} (median of 5)")
    print("| search | seconds | s per 1e9 weights | x rtn |\n|---|---|---|---|")
    rtn = None
    for policy in ScalePolicy:
        quantize(big, policy, importance)  # warm-up
        s = seconds(lambda: quantize(big, policy, importance), device)
        rtn = rtn or s
        print(f"| {policy.value} | {s:.3f} | {s / big.numel() * 1e9:.2f} | {s / rtn:.1f} |", flush=True)
    print(f"{differences} difference(s)")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
