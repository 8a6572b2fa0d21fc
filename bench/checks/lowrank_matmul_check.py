"""Do MAX's matmuls compute the GEMM and fold paths' low-rank products right on this device?

    python bench/checks/lowrank_matmul_check.py [--device gpu|cpu] [--m 1 4 8 64] [--ranks 32 64 96 128]

On the H200 (2026-12-01, docs/dev/lab-log.md) the GEMM formulation and the
graph fold gave other greedy texts than torch's bf16 emulation of every
path, while ``generated_linear`` (our own kernel, no small matmul) gave
torch's. What GEMM and fold share, and the generated op does not, are MAX
matmuls whose inner width is the padded rank: ``(x V) U^T`` and ``U V^T``
with K = 32, 64 or 96 (``attnquant.max_compat.MIN_INNER_MULTIPLE``). This
compiles one graph holding, for each Gemma 3 1B projection group and padded
rank Rp in {32, 64, 96, 128}, the served modules of both paths
(``attnquant.graph.theta``: GEMM ``s*(x W0^T) + (x V) U^T``; fold
``x (s*W0 + U V^T)^T``, its W built from weights only, as MAX folds it at
load), with a symbolic token count as in the served model. Each output
is compared with float64 on the same bf16 (GPU) or float32 (CPU) inputs.
Relative errors near the dtype's rounding (bf16: ~3e-3) pass; a case above
``--bound`` is printed FAIL. One compile (about 25 minutes on 2 CPU cores;
on CPU every case is within 2e-6: ``bench/results/2026-12-01-cpu-lowrank-matmul-check.txt``).
On the H200 (2026-12-02, ``bench/results/2026-12-02-h200-run11.txt``) every
case at Rp = 32, 64 and 96 is within 2.5e-3; 4 of 32 at Rp = 128 failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from graph_cases import GROUPS, building, compile_cases, relative_error, target  # noqa: E402

PADDED_RANKS = (32, 64, 96, 128)


PATHS = ("gemm", "fold")


def build_case(n: int, k: int, rp: int, name: str):
    """The served modules (``attnquant.graph.theta``) for one theta part,
    each with its own W0 (they get the same weights)."""
    from max.experimental.nn import Module

    from attnquant.load.fuse import PartPlan
    from attnquant.graph.theta import FoldThetaProjection, GemmThetaProjection, shared_blocks

    class Case(Module):
        def __init__(self) -> None:
            super().__init__()
            with shared_blocks():
                part = PartPlan("theta", (name,), (n,), k, rank=rp)
                self.gemm = GemmThetaProjection(dataclasses.replace(part, shared_with=f"{name}.gemm"))
                self.fold = FoldThetaProjection(dataclasses.replace(part, shared_with=f"{name}.fold"))

        def forward(self, x):
            return self.gemm(x), self.fold(x)

    return Case()


def random_theta(n: int, k: int, rp: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Weights at a checkpoint's scale: W0 ~ N(0, 1/k), s ~ 1, U V^T about a tenth of s*W0."""
    return {
        "w0": torch.randn(n, k, generator=g) / math.sqrt(k),
        "scale": 1 + 0.1 * torch.randn(n, generator=g),
        "u": torch.randn(n, rp, generator=g) * 0.1 / math.sqrt(rp),
        "v": torch.randn(k, rp, generator=g) / math.sqrt(k),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 4, 8, 64], help="token counts to run")
    parser.add_argument("--ranks", type=int, nargs="+", default=list(PADDED_RANKS), help="padded ranks to build")
    parser.add_argument("--bound", type=float, default=2e-2, help="relative error counted as wrong")
    args = parser.parse_args()

    where = target(args.device == "gpu")
    cases = [(group, n, k, rp) for group, (n, k) in GROUPS.items() for rp in args.ranks]
    g = torch.Generator().manual_seed(0)
    thetas = [{name: t.to(where.torch_dtype) for name, t in random_theta(n, k, rp, g).items()} for _, n, k, rp in cases]
    with building(where):
        modules = [build_case(n, k, rp, f"{group}.{rp}") for group, n, k, rp in cases]
    # Both paths of a case get the same theta.
    weights = [{f"{path}.{name}": t for path in PATHS for name, t in theta.items()} for theta in thetas]
    run = compile_cases(modules, [k for _, _, k, _ in cases], weights, where)

    failures = 0
    print(f"device {args.device}, {where.dtype}; relative error vs float64, bound {args.bound:.0e}")
    print("| group [N, K] | Rp | M | GEMM | fold |\n|---|---|---|---|---|")
    for m in args.m:
        xs = [torch.randn(m, k, generator=g).to(where.torch_dtype) for _, _, k, _ in cases]
        outputs = run(xs)
        for i, ((group, n, k, rp), theta, x) in enumerate(zip(cases, thetas, xs, strict=True)):
            t = {name: v.double() for name, v in theta.items()}
            w_eff = t["scale"][:, None] * t["w0"] + t["u"] @ t["v"].T
            expected = x.double() @ w_eff.T
            cells = []
            for got in outputs[2 * i : 2 * i + 2]:
                error = relative_error(got, expected)
                failures += error > args.bound
                cells.append(f"{error:.1e}" + (" FAIL" if error > args.bound else ""))
            print(f"| {group} [{n}, {k}] | {rp} | {m} | {cells[0]} | {cells[1]} |", flush=True)
    print(f"{failures} case(s) above {args.bound:.0e}")


if __name__ == "__main__":
    main()
