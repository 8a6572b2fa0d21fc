"""attnquant's residual_rms_norm kernel through MAX on an NVIDIA GPU, against MAX's ops and float64.

For each Gemma width (270M, 1B, 4B, 27B/31B, and Gemma 4's scaled layer end
at E2B's and 31B's widths) builds ``add_and_norm`` (``attnquant.graph.residual_norm``)
twice, as the kernel and as MAX's ops, all widths in one graph each with a
symbolic row count, and at M = 1, 3, 16 and 129 compares

- each against float64 with the kernel's roundings (the first norm's output,
  ``residual * scale`` and their sum rounded to bfloat16, as the graph's ops
  round them one by one): relative error;
- the kernel against MAX's ops: how many bfloat16 values differ, and by how
  many steps at most. Unscaled (Gemma 3's form) the two round alike and must
  agree to the bit; scaled, MAX's GPU fusion does not round ``residual * scale``
  before the sum, so values that nearly cancel differ (reported, not a failure).

Then times both in a chain of 64 calls at one row and the 31B width (each
call's normed output the next one's input; launch gaps included, no capture:
this is mostly the host's cost of a launch, which a captured decode step does not pay).

On the GPU, after staging MAX (../shared/device/README.md):
    python3 bench/checks/residual_norm_gpu.py
Here, without a GPU: ``--compile-only`` compiles both graphs for a virtual sm_90a.
Exits non-zero if a relative error exceeds 1e-2 or, unscaled, the two differ at all.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

CASES = ((640, 1.0, False), (1152, 1.0, False), (2560, 1.0, False), (5376, 1.0, False), (1536, 0.0, True), (5376, 0.0, True))
"""(hidden, weight offset, residual scaled): Gemma 3's norms add 1 to their
weights; Gemma 4's layer end scales the residual by the layer scalar."""
MS = (1, 3, 16, 129)
EPS = 1e-6
TOLERANCE = 1e-2
CHAIN = 64


def reference(x, residual, w1, w2, scale, offset):  # noqa: ANN001, ANN201
    """(r, normed) in float64, rounded to bfloat16 where the kernel rounds."""

    def norm(v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = v.double()
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS) * (offset + w.double())

    scaled = residual if scale is None else (residual.double() * scale.double()).to(torch.bfloat16)
    r = (scaled.double() + norm(x, w1).to(torch.bfloat16).double()).to(torch.bfloat16)
    return r, norm(r, w2)


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 values apart a and b are, elementwise (same sign assumed near zero)."""
    ia = a.contiguous().view(torch.int16).int()
    ib = b.contiguous().view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile-only", action="store_true", help="compile for a virtual sm_90a, run nothing")
    args = parser.parse_args()

    from max import driver

    from attnquant.max_compat import gpu_check_session

    session, gpu, cpu = gpu_check_session("sm_90a" if args.compile_only else None)
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout
    from max.experimental.tensor import Tensor

    from attnquant.graph.ops import custom_extensions_path
    from attnquant.graph.residual_norm import NormSpec, add_and_norm
    from attnquant.max_compat import exit_after_virtual_compile


    def layouts(hidden: int) -> list:
        bf16 = lambda *shape: TensorLayout(DType.bfloat16, list(shape), gpu)  # noqa: E731
        return [bf16("m", hidden), bf16("m", hidden), bf16(hidden), bf16(hidden), bf16(1)]

    def build(kernel: bool):  # noqa: ANN202
        def forward(*inputs):  # noqa: ANN002, ANN202
            outs = []
            for i, (_, offset, scaled) in enumerate(CASES):
                x, residual, w1, w2, s = inputs[5 * i : 5 * i + 5]
                first, second = NormSpec(w1, EPS, offset), NormSpec(w2, EPS, offset)
                outs += add_and_norm(x, residual, first, second, kernel=kernel, scale=s if scaled else None)
            return tuple(outs)

        types = [t for hidden, _, _ in CASES for t in layouts(hidden)]
        t0 = time.time()
        run = compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
        print(f"{'kernel' if kernel else 'MAX ops'}: {len(CASES)} widths compiled in {time.time() - t0:.1f} s", flush=True)
        return run

    def build_chain(kernel: bool):  # noqa: ANN202
        hidden, offset, _ = CASES[-1]

        def forward(x, residual, w1, w2, s):  # noqa: ANN001, ANN202
            first, second = NormSpec(w1, EPS, offset), NormSpec(w2, EPS, offset)
            for _ in range(CHAIN):
                residual, x = add_and_norm(x, residual, first, second, kernel=kernel, scale=s)
            return residual, x

        return compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*layouts(hidden))

    runs = {kernel: build(kernel) for kernel in (True, False)}
    chains = {kernel: build_chain(kernel) for kernel in (True, False)}
    if args.compile_only:
        exit_after_virtual_compile()

    def buf(t: torch.Tensor) -> Tensor:
        return Tensor.from_dlpack(driver.Buffer.from_dlpack(t.contiguous()).to(gpu))

    def host(y) -> torch.Tensor:  # noqa: ANN001
        return torch.from_dlpack(y.driver_tensor.to(cpu) if hasattr(y, "driver_tensor") else y.to(cpu))

    gen = torch.Generator().manual_seed(0)
    worst_err, worst_steps, failed = 0.0, 0, False
    for m in MS:
        data, inputs = [], []
        for hidden, offset, _ in CASES:
            x = (torch.randn(m, hidden, generator=gen) * 3).to(torch.bfloat16)
            residual = (torch.randn(m, hidden, generator=gen) * 20).to(torch.bfloat16)
            w1 = (torch.randn(hidden, generator=gen) * 0.3 + (1 - offset)).to(torch.bfloat16)
            w2 = (torch.randn(hidden, generator=gen) * 0.3 + (1 - offset)).to(torch.bfloat16)
            s = torch.tensor([0.71], dtype=torch.bfloat16)
            data.append((x, residual, w1, w2, s))
            inputs += [buf(v) for v in (x, residual, w1, w2, s)]
        outs = {kernel: [host(y) for y in run(*inputs)] for kernel, run in runs.items()}
        for i, ((hidden, offset, scaled), (x, residual, w1, w2, s)) in enumerate(zip(CASES, data)):
            ref_r, ref_n = reference(x, residual, w1, w2, s if scaled else None, offset)
            line = [f"[{m}, {hidden}] offset {offset:g}{' scaled' if scaled else ''}:"]
            for kernel in (True, False):
                r, normed = outs[kernel][2 * i], outs[kernel][2 * i + 1]
                err = max(float((r.double() - ref_r.double()).norm() / ref_r.double().norm()),
                          float((normed.double() - ref_n).norm() / ref_n.norm()))  # fmt: skip
                worst_err = max(worst_err, err)
                line.append(f"{'kernel' if kernel else 'MAX'} rel err {err:.2e}")
            steps = torch.cat([bf16_steps(outs[True][2 * i + j], outs[False][2 * i + j]).flatten() for j in (0, 1)])
            differ = int((steps > 0).sum())
            if not scaled:
                worst_steps = max(worst_steps, int(steps.max()))
            line.append(f"kernel vs MAX: {differ}/{steps.numel()} values differ, at most {int(steps.max())} steps")
            print("  ".join(line), flush=True)
    failed = worst_err > TOLERANCE or worst_steps > 0

    hidden = CASES[-1][0]
    x = (torch.randn(1, hidden, generator=gen)).to(torch.bfloat16)
    weights = [(torch.randn(hidden, generator=gen) * 0.3 + 1).to(torch.bfloat16) for _ in range(2)]
    inputs = [buf(v) for v in (x, x.clone(), *weights, torch.tensor([1.0], dtype=torch.bfloat16))]
    for kernel, chain in chains.items():
        for _ in range(5):
            chain(*inputs)
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            host(chain(*inputs)[0])
            times.append(time.perf_counter() - t0)
        per = sorted(times)[len(times) // 2] / CHAIN * 1e6
        print(f"chain of {CHAIN} at [1, {hidden}], {'kernel' if kernel else 'MAX ops'}: {per:.2f} us a call (median of 30)")
    print(f"RESULT {'FAIL' if failed else 'OK'}: worst rel err {worst_err:.2e}, unscaled kernel vs MAX at most {worst_steps} bfloat16 steps")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
