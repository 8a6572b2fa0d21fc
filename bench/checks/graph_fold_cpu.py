"""Does MAX fold W_eff once at load, or on every step? (CPU, float32)

    .venv/bin/python bench/checks/graph_fold_cpu.py [--size 4096] [--rank 32] [--calls 30]

Compiles three graphs computing ``y = x W_eff^T`` for one [N, K] projection
(N = K = --size), x of one row (a decode step):

- ``dense``: W_eff as a weight (what precompute-outside serves);
- ``graph-fold``: W0, s, U, V as weights and ``W = s*W0 + U V^T`` in the graph
  (``attnquant.graph.theta.FoldThetaProjection``'s expression);
- ``fold-from-inputs``: the same expression with W0, s, U, V passed as graph
  inputs, which no compiler can fold ahead of the call: the per-step cost of
  folding.

Prints, per graph, the milliseconds per call and the process's resident
memory growth after compiling, loading and one call (each graph in a fresh
process), first with the benchmark's own copy of the weights held, then with
it released. Reading it: MAX aliases a weight it is given (dense's growth
holds no second [N, K]); a ``graph-fold`` growth one [N, K] above dense's,
while its per-call time equals dense's, means MAX evaluated the weight-only
subgraph once when the model loaded and keeps the result; if releasing our
copy frees only the W_eff this script computed for the check, MAX keeps W0
too. ``fold-from-inputs`` is the per-step cost folding would have. Each graph
compiles once (minutes on 2 cores; MAX caches them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(size: int, rank: int):
    """The three modules (imported here: MAX is slow to import)."""
    from max.experimental.nn import Module
    from max.experimental.tensor import Tensor

    def fold(w0, scale, u, v):
        return w0 * scale.reshape([-1, 1]) + u @ v.T

    class Dense(Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = Tensor.zeros([size, size])

        def forward(self, x):
            return x @ self.w.T

    class GraphFold(Module):
        def __init__(self) -> None:
            super().__init__()
            self.w0, self.scale = Tensor.zeros([size, size]), Tensor.zeros([size])
            self.u, self.v = Tensor.zeros([size, rank]), Tensor.zeros([size, rank])

        def forward(self, x):
            return x @ fold(self.w0, self.scale, self.u, self.v).T

    class FoldFromInputs(Module):
        def forward(self, x, w0, scale, u, v):
            return x @ fold(w0, scale, u, v).T

    return Dense, GraphFold, FoldFromInputs


CASES = ("dense", "graph-fold", "fold-from-inputs")


def measure(name: str, size: int, rank: int, calls: int) -> tuple[float, ...]:
    """One case in this process: ms per call, resident growth (MiB) from
    compiling, loading and the first call (with our copy of the weights held,
    then released), compile+load seconds, and the relative error against
    float64."""
    import torch
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental.tensor import Tensor, default_device
    from max.graph import DeviceRef, TensorType

    g = torch.Generator().manual_seed(0)
    theta = {"w0": torch.randn(size, size, generator=g), "scale": torch.rand(size, generator=g),
             "u": torch.randn(size, rank, generator=g) / rank, "v": torch.randn(size, rank, generator=g)}  # fmt: skip
    w_eff = theta["scale"][:, None] * theta["w0"] + theta["u"] @ theta["v"].T
    x = torch.randn(1, size, generator=g)
    cpu = DeviceRef.CPU()
    types = [TensorType(DType.float32, [1, size], cpu)]
    inputs = [Tensor.from_dlpack(x)]
    weights = {"dense": {"w": w_eff}, "graph-fold": theta, "fold-from-inputs": {}}[name]
    if name == "fold-from-inputs":
        types += [TensorType(DType.float32, list(t.shape), cpu) for t in theta.values()]
        inputs += [Tensor.from_dlpack(t) for t in theta.values()]
    module_cls = dict(zip(CASES, build(size, rank), strict=True))[name]
    with default_device(CPU()):
        module = module_cls()
    expected = x.double() @ w_eff.double().T
    before, started = resident_mib(), time.perf_counter()
    run = module.compile(*types, weights=weights)
    compile_s = time.perf_counter() - started
    y = torch.from_dlpack(run(*inputs)).double()
    grown_held = resident_mib() - before  # MAX's allocations; our weights still held
    # Drop our references: a weight MAX aliases stays resident, one it no
    # longer needs (folded into a result it computed at load) is freed.
    del weights, theta, w_eff
    grown = resident_mib() - before
    error = float((y - expected).norm() / expected.norm())
    started = time.perf_counter()
    for _ in range(calls):
        run(*inputs)
    return (time.perf_counter() - started) / calls * 1e3, grown_held, grown, compile_s, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--only", choices=CASES, help="run one case here (the table runs each in a child)")
    args = parser.parse_args()
    if args.only:
        print("ROW", *measure(args.only, args.size, args.rank, args.calls))
        return

    # A fresh process per case, so that memory growth is that case's alone.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from attnquant.max_compat import child_environment

    rows = []
    for name in CASES:
        command = [sys.executable, __file__, "--only", name, *sys.argv[1:]]
        out = subprocess.run(command, env=child_environment(), capture_output=True, text=True, check=True)
        values = [float(v) for v in out.stdout.split("ROW", 1)[1].split()]
        rows.append((name, *values))
        print(f"{name}: {values[0]:.2f} ms/call", flush=True)
    mib = args.size**2 * 4 / 2**20
    print(f"\nN = K = {args.size}, R = {args.rank}, float32, one [N, K] matrix = {mib:.0f} MiB; "
          f"{args.calls} calls each, each graph in a fresh process")  # fmt: skip
    print("| graph | ms per call | resident growth MiB, ours held | ours released | compile+load s "
          "| rel. error vs float64 |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, per_call, held, released, compile_s, error in rows:
        print(f"| {name} | {per_call:.2f} | {held:.0f} | {released:.0f} | {compile_s:.0f} | {error:.1e} |")


if __name__ == "__main__":
    main()
