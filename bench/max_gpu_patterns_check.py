"""Does MAX compute our dense projections, and Gemma's MLP and post-MLP norm around them, as torch does on this device?

    python bench/max_gpu_patterns_check.py [--device gpu|cpu] [--m 1 2 3 8 9 12 64]

Run 11 (docs/throughput.md) found, on the H200 in bfloat16, our model's
logits with every projection a plain MAX matmul (precompute-outside) up to
5.2 away from the ``generated_linear`` path's (our own kernel) and 4.5 from
GEMM's, while the low-rank products alone were right. MAX has two open GPU bugs in this
neighbourhood (modular/modular#6883: bf16 ``ops.matmul`` wrong for M > 8 on
H100, first seen as ``rms_norm`` after an FFN; #7165: split-K reduces its
partial sums in bf16). This compiles one graph of the patterns our Gemma 3
model runs, built from the served modules (``attnquant.linear``,
``models.common.mlp``, MAX's ``Gemma3RMSNorm``), with a symbolic token count:

- ``square``: ``x W^T`` at [1536, 1536], #6883's shape;
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
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, INTERMEDIATE = 1152, 6912  # Gemma 3 1B
# [N, K] of each projection group as attnquant serves it (q|k|v and gate|up fused).
GROUPS = {"qkv": (1536, HIDDEN), "o": (HIDDEN, 1024), "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
EPS = 1e-6


def dense_part(name: str, n: int, k: int):
    from attnquant.runtime_layout import PartPlan

    return (PartPlan("dense", (name,), (n,), k),)


def build_cases() -> dict[str, object]:
    """name -> served module; each takes x [m, K] and returns [m, N]."""
    from max.experimental.nn import Module
    from max.pipelines.architectures.gemma3_modulev3.layers.rms_norm import Gemma3RMSNorm

    from attnquant.linear import build_projection
    from models.common.mlp import ProjectedMLP

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

    def mlp() -> Module:
        return ProjectedMLP(dense_part("gate_up", *GROUPS["gate_up"]), dense_part("down", *GROUPS["down"]), "gelu_tanh")

    cases = {"square": build_projection(dense_part("square", 1536, 1536))}
    cases.update({f"dense.{g}": build_projection(dense_part(g, n, k)) for g, (n, k) in GROUPS.items()})
    cases["down_norm"] = Normed(build_projection(dense_part("down", *GROUPS["down"])))
    cases["mlp"] = mlp()
    cases["mlp_norm"] = Normed(mlp())
    cases["layer_mlp"] = LayerMLP()
    return cases


def in_dim(name: str) -> int:
    widths = {"square": 1536, "down_norm": INTERMEDIATE, "mlp": HIDDEN, "mlp_norm": HIDDEN, "layer_mlp": HIDDEN}
    return widths.get(name) or GROUPS[name.split(".")[1]][1]


def gemma_norm(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm as transformers computes it: float32 (or wider), scale by 1 + w, then cast."""
    wide = y.to(torch.promote_types(y.dtype, torch.float32))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + EPS)
    return (normed * (1.0 + weight.to(wide.dtype))).to(y.dtype)


def expression(name: str, w: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The case's math in torch, in whatever dtype and device ``w`` and x are."""
    gelu = torch.nn.functional.gelu

    def mlp(x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ w["gate_up"].T).split(INTERMEDIATE, dim=-1)
        return (gelu(gate, approximate="tanh") * up) @ w["down"].T

    if name == "mlp":
        return mlp
    if name == "mlp_norm":
        return lambda x: gemma_norm(mlp(x), w["norm"])
    if name == "layer_mlp":
        return lambda x: x + gemma_norm(mlp(gemma_norm(x, w["pre_norm"])), w["post_norm"])
    if name == "down_norm":
        return lambda x: gemma_norm(x @ w["down"].T, w["norm"])
    return lambda x: x @ w["weight"].T


def random_weights(name: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The random checkpoint's scale: N(0, 0.02) projections, small norm weights."""
    shapes = {"square": {"weight": (1536, 1536)}, "mlp": {"gate_up": GROUPS["gate_up"], "down": GROUPS["down"]}}
    shapes["mlp_norm"] = {**shapes["mlp"], "norm": (HIDDEN,)}
    shapes["down_norm"] = {"down": GROUPS["down"], "norm": (HIDDEN,)}
    shapes["layer_mlp"] = {**shapes["mlp"], "pre_norm": (HIDDEN,), "post_norm": (HIDDEN,)}
    spec = shapes.get(name) or {"weight": GROUPS[name.split(".")[1]]}
    return {key: torch.randn(shape, generator=g) * (0.1 if key.endswith("norm") else 0.02) for key, shape in spec.items()}


def module_weights(name: str, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The case's tensors under the served module's parameter names."""
    prefix = {"mlp_norm": "inner.", "layer_mlp": "mlp."}.get(name, "")
    names = {"weight": "weight", "gate_up": f"{prefix}gate_up_proj.weight", "down": f"{prefix}down_proj.weight",
             "norm": "norm.weight", "pre_norm": "pre_norm.weight", "post_norm": "post_norm.weight"}  # fmt: skip
    if name == "down_norm":
        names["down"] = "inner.weight"
    return {names[key]: t for key, t in w.items()}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).norm() / expected.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 3, 8, 9, 12, 64], help="token counts to run")
    parser.add_argument("--ratio", type=float, default=3.0, help="MAX error over torch's counted as wrong")
    args = parser.parse_args()

    from max.driver import CPU, Accelerator
    from max.dtype import DType
    from max.experimental.nn import Module
    from max.experimental.nn.sequential import ModuleList
    from max.experimental.tensor import Tensor, default_device, default_dtype
    from max.graph import DeviceRef, TensorType

    gpu = args.device == "gpu"
    device, ref, dtype, tdtype = (
        (Accelerator(), DeviceRef.GPU(), DType.bfloat16, torch.bfloat16)
        if gpu else (CPU(), DeviceRef.CPU(), DType.float32, torch.float32)
    )  # fmt: skip
    torch_device = "cuda" if gpu else "cpu"
    with default_device(device), default_dtype(dtype):
        cases = build_cases()
    names = list(cases)
    g = torch.Generator().manual_seed(0)
    weights = {name: {k: t.to(tdtype) for k, t in random_weights(name, g).items()} for name in names}

    class AllCases(Module):
        def __init__(self) -> None:
            super().__init__()
            self.cases = ModuleList([cases[name] for name in names])

        def forward(self, *xs):
            return tuple(case(x) for case, x in zip(self.cases, xs, strict=True))

    with default_device(device), default_dtype(dtype):
        module = AllCases()
    flat = {f"cases.{i}.{key}": t for i, name in enumerate(names) for key, t in module_weights(name, weights[name]).items()}
    run = module.compile(*[TensorType(dtype, ["m", in_dim(name)], ref) for name in names], weights=flat)

    failures = 0
    print(f"device {args.device}, {dtype}; relative error (norm) vs float64; FAIL: MAX above {args.ratio}x torch's")
    print("| case | M | MAX | torch (same device, dtype) | MAX / torch |\n|---|---|---|---|---|")
    for m in args.m:
        xs = [torch.randn(m, in_dim(name), generator=g).to(tdtype) for name in names]
        outputs = run(*[Tensor.from_dlpack(x).to(device) for x in xs])
        for name, x, y in zip(names, xs, outputs, strict=True):
            w = weights[name]
            expected = expression(name, {k: t.double() for k, t in w.items()})(x.double())
            on_device = {k: t.to(torch_device) for k, t in w.items()}
            torch_error = relative_error(expression(name, on_device)(x.to(torch_device)).cpu(), expected)
            max_error = relative_error(torch.from_dlpack(y.to(CPU())), expected)
            bad = max_error > max(args.ratio * torch_error, 1e-5)
            failures += bad
            print(f"| {name} | {m} | {max_error:.1e}{' FAIL' if bad else ''} | {torch_error:.1e} | "
                  f"{max_error / max(torch_error, 1e-12):.1f} |", flush=True)  # fmt: skip
    print(f"{failures} case(s) above {args.ratio}x torch's error")


if __name__ == "__main__":
    main()
