"""Does MAX compute our dense projections, and Gemma's MLP and post-MLP norm around them, as torch does on this device?

    python bench/checks/max_gpu_patterns_check.py [--device gpu|cpu] [--m 1 2 3 8 9 12 64] [--unpadded]

On the H200 in bfloat16 (2026-12-02, docs/dev/lab-log.md), our model's
logits with every projection a plain MAX matmul (precompute-outside) were up
to 5.2 away from the ``generated_linear`` path's (our own kernel) and 4.5
from GEMM's, while the low-rank products alone were right. MAX has two open GPU bugs in this
neighbourhood (modular/modular#6883: bf16 ``ops.matmul`` wrong for M > 8 on
H100, first seen as ``rms_norm`` after an FFN; #7165: split-K reduces its
partial sums in bf16). This compiles one graph of the patterns our Gemma 3
model runs, built from the served modules (``attnquant.graph.projections``,
``models.common.mlp``, MAX's ``Gemma3RMSNorm``), with a symbolic token count:

- ``square``: ``x W^T`` at [1536, 1536], #6883's shape;
- ``raw.qkv``: the q|k|v group as one bare MAX matmul (no row padding);
- ``dense.<group>``: each 1B projection group as precompute-outside serves it;
- ``down_norm``: the post-feedforward norm applied to ``down``'s output;
- ``mlp``: ``down(gelu_tanh(gate) * up)`` with gate|up one matmul, then split;
- ``mlp_norm``: the same followed by the post-feedforward norm (#6883's pattern);
- ``layer_mlp``: a decoder layer's MLP half, ``x + post(mlp(pre(x)))``, a
  longer chain (#6883's reporter saw errors grow along chains).

Each output is compared with float64 on the host (same rounded inputs and
weights, no intermediate rounding), and so is torch's computation of the
same expression on the same device and dtype: torch's error is the
yardstick. A MAX error above ``--ratio`` times torch's (and above 1e-5) is
printed FAIL. One compile (minutes on 2 CPU cores; on CPU in float32 both
errors are ~1e-7).

On the H200 (2026-12-02, ``bench/results/2026-12-02-h200-run12.txt``): before
``attnquant.graph.matmul`` padded rows on sm_90, every case but ``square`` failed
at M = 2 to 63, 65 and 96 and passed at 1, 64 and 128, each by the amount a
neighbouring case's ``64 - M % 64`` zero rows written past its own output
would give; with the padding every case passed at 24 M from 1 to 2048 but
``mlp_norm`` at M = 192 (3.8x torch's error), and so did ``raw.qkv``, the
bare matmul: on that reading its overrun lands where nothing is checked.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from graph_cases import GROUPS, HIDDEN, INTERMEDIATE, building, compile_cases, relative_error, target  # noqa: E402

EPS = 1e-6
Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Case:
    module: Any  # the served module, built under graph_cases.building
    in_width: int
    torch_expression: Callable[[Weights, torch.Tensor], torch.Tensor]
    """The same math in torch, given the module's parameters by name."""


def gemma_norm(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm as transformers computes it: float32 (or wider), scale by 1 + w, then cast."""
    wide = y.to(torch.promote_types(y.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + EPS)
    return (normed * (1.0 + weight.to(wide.dtype))).to(y.dtype)


def gated_mlp(w: Weights, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """``ProjectedMLP``'s math: gate|up in one matmul, split, gelu_tanh(gate) * up, down."""
    gate, up = (x @ w[f"{prefix}gate_up_proj.weight"].T).split(INTERMEDIATE, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ w[f"{prefix}down_proj.weight"].T


def build_cases(row_padding: str) -> dict[str, Case]:
    """The patterns, from the served modules with ``row_padding`` (a
    ``RowPadding`` value, as the load records it in the plan); each takes x [m, in_width]."""
    from max.experimental.nn import Module
    from max.experimental.tensor import Tensor
    from max.pipelines.architectures.gemma3_modulev3.layers.rms_norm import Gemma3RMSNorm

    from attnquant.graph.projections import build_projection
    from attnquant.load.fuse import PartPlan
    from models.common.mlp import ProjectedMLP

    def dense(name: str, n: int, k: int) -> Module:
        return build_projection((PartPlan("dense", (name,), (n,), k, row_padding=row_padding),))

    def mlp() -> Module:
        gate_up, down = (
            PartPlan("dense", (g,), GROUPS[g][:1], GROUPS[g][1], row_padding=row_padding) for g in ("gate_up", "down")
        )
        return ProjectedMLP((gate_up,), (down,), "gelu_tanh")

    class Normed(Module):
        def __init__(self, inner: Module) -> None:
            super().__init__()
            self.inner = inner
            self.norm = Gemma3RMSNorm(HIDDEN, eps=EPS)

        def forward(self, x):
            return self.norm(self.inner(x))

    class LayerMLP(Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre_norm = Gemma3RMSNorm(HIDDEN, eps=EPS)
            self.mlp = mlp()
            self.post_norm = Gemma3RMSNorm(HIDDEN, eps=EPS)

        def forward(self, x):
            return x + self.post_norm(self.mlp(self.pre_norm(x)))

    def linear(w: Weights, x: torch.Tensor) -> torch.Tensor:
        return x @ w["weight"].T

    class Raw(Module):
        """``x W^T`` as one bare MAX matmul, as MAX's own Gemma 3 runs it
        (attnquant.graph.matmul pads the rows on sm_90; this does not)."""

        def __init__(self, n: int, k: int) -> None:
            super().__init__()
            self.weight = Tensor.zeros([n, k])

        def forward(self, x):
            return x @ self.weight.T

    cases = {"square": Case(dense("square", 1536, 1536), 1536, linear)}
    cases["raw.qkv"] = Case(Raw(*GROUPS["qkv"]), GROUPS["qkv"][1], linear)
    cases.update({f"dense.{g}": Case(dense(g, n, k), k, linear) for g, (n, k) in GROUPS.items()})
    cases["down_norm"] = Case(
        Normed(dense("down", *GROUPS["down"])), INTERMEDIATE,
        lambda w, x: gemma_norm(x @ w["inner.weight"].T, w["norm.weight"]),
    )  # fmt: skip
    cases["mlp"] = Case(mlp(), HIDDEN, gated_mlp)
    cases["mlp_norm"] = Case(
        Normed(mlp()), HIDDEN, lambda w, x: gemma_norm(gated_mlp(w, x, "inner."), w["norm.weight"])
    )
    cases["layer_mlp"] = Case(
        LayerMLP(), HIDDEN,
        lambda w, x: x + gemma_norm(gated_mlp(w, gemma_norm(x, w["pre_norm.weight"]), "mlp."), w["post_norm.weight"]),
    )  # fmt: skip
    return cases


def random_weights(module: Any, g: torch.Generator) -> Weights:
    """One tensor per parameter of ``module``, at the random checkpoint's
    scale: N(0, 0.02) projections, N(0, 0.1) norm weights."""
    return {
        name: torch.randn([int(d) for d in t.shape], generator=g) * (0.1 if name.endswith("norm.weight") else 0.02)
        for name, t in module.parameters
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 3, 8, 9, 12, 64], help="token counts to run")
    parser.add_argument("--ratio", type=float, default=3.0, help="MAX error over torch's counted as wrong")
    parser.add_argument("--unpadded", action="store_true",
                        help="serve without attnquant.graph.matmul's sm_90 row padding (MAX's matmul as MAX runs it)")
    args = parser.parse_args()
    from attnquant.max_compat import RowPadding

    # What a load picks on sm_90 in bf16 without capture (FIXED), or none.
    padding = RowPadding.OFF if args.unpadded or args.device == "cpu" else RowPadding.FIXED

    where = target(args.device == "gpu")
    with building(where):
        cases = build_cases(padding.value)
    g = torch.Generator().manual_seed(0)
    weights = {name: {k: t.to(where.torch_dtype) for k, t in random_weights(case.module, g).items()}
               for name, case in cases.items()}  # fmt: skip
    run = compile_cases([c.module for c in cases.values()], [c.in_width for c in cases.values()],
                        list(weights.values()), where)  # fmt: skip

    failures = 0
    print(f"device {args.device}, {where.dtype}; relative error (norm) vs float64; FAIL: MAX above {args.ratio}x torch's")
    print("| case | M | MAX | torch (same device, dtype) | MAX / torch |\n|---|---|---|---|---|")
    for m in args.m:
        xs = [torch.randn(m, case.in_width, generator=g).to(where.torch_dtype) for case in cases.values()]
        for (name, case), x, got in zip(cases.items(), xs, run(xs), strict=True):
            w = weights[name]
            expected = case.torch_expression({k: t.double() for k, t in w.items()}, x.double())
            on_device = {k: t.to(where.torch_device) for k, t in w.items()}
            torch_error = relative_error(case.torch_expression(on_device, x.to(where.torch_device)).cpu(), expected)
            max_error = relative_error(got, expected)
            bad = max_error > max(args.ratio * torch_error, 1e-5)
            failures += bad
            print(f"| {name} | {m} | {max_error:.1e}{' FAIL' if bad else ''} | {torch_error:.1e} | "
                  f"{max_error / max(torch_error, 1e-12):.1f} |", flush=True)  # fmt: skip
    print(f"{failures} case(s) above {args.ratio}x torch's error")


if __name__ == "__main__":
    main()
