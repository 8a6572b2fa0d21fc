"""In-graph reconstruction (ATTNQUANT_PRECOMPUTE_OUTSIDE=0): the path chooser,
and every path through MAX on CPU against precompute-outside.

The MAX cases build a small two-layer Gemma-shaped stack (q|k|v, o and the
gated MLP per layer, the same module names a checkpoint has) through the real
load pipeline (``loading.prepare_weights``: theta, fused run-time layout,
shared W0 aliases, path choice) and the real projection modules, compile it,
and compare its output with the same stack computed in float64 from the
precomputed W_eff (``reconstruct.precompute_outside``) with the same G and R.
All cases compile as one graph (one compile, a few minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch

from attnquant.config import AttnQuantConfig
from attnquant.graph import matmul
from attnquant.load.path import PathChoice, choose_path
from attnquant.plan import ReconstructionPath
from kernels import MAX_GENERATED_RANK

LAYERS, HIDDEN, Q, KV, INTER = 2, 32, 32, 16, 48
BASE = AttnQuantConfig(precompute_outside=False, cache=False)


# --- the chooser (no MAX) ----------------------------------------------------


@pytest.mark.parametrize(
    "api, expected", [("cuda", "gemm"), ("hip", "gemm"), ("metal", "generated"), ("cpu", "gemm")]
)
def test_auto_choice_by_accelerator(api: str, expected: str) -> None:
    for residual in (True, False):
        choice = choose_path(BASE, api, residual=residual)
        assert choice.path.value == expected
        assert choice.reason.startswith("auto:")
        assert str(choice).startswith(expected)


@pytest.mark.parametrize("gemm, expected", [(True, "gemm"), (False, "generated")])
def test_explicit_gemm_overrides_the_accelerator(gemm: bool, expected: str) -> None:
    for api in ("cuda", "metal", "cpu"):
        choice = choose_path(dataclasses.replace(BASE, gemm=gemm), api, residual=True)
        assert choice == PathChoice(ReconstructionPath(expected), f"ATTNQUANT_GEMM={int(gemm)}")


def test_precompute_outside_and_fold() -> None:
    assert choose_path(AttnQuantConfig(), "cuda", residual=True).path is ReconstructionPath.PRECOMPUTE_OUTSIDE
    fold = dataclasses.replace(BASE, precompute=True, gemm=False)
    assert choose_path(fold, "cpu", residual=True).path is ReconstructionPath.GRAPH_FOLD


def test_rank_guard_points_to_the_gemm_path() -> None:
    config = dataclasses.replace(BASE, gemm=False, rank=MAX_GENERATED_RANK + 1)
    with pytest.raises(ValueError, match=r"ATTNQUANT_RANK=65 .*ATTNQUANT_GEMM=1"):
        choose_path(config, "cuda", residual=True)
    # At passthrough every residual is empty: nothing to refuse.
    assert choose_path(config, "cuda", residual=False).path is ReconstructionPath.GENERATED
    at_limit = dataclasses.replace(config, rank=MAX_GENERATED_RANK)
    assert choose_path(at_limit, "cuda", residual=True).path is ReconstructionPath.GENERATED


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"quant": "nvfp4"}, r"ATTNQUANT_QUANT=nvfp4 .*ATTNQUANT_PRECOMPUTE_OUTSIDE=1"),
        ({"precompute_outside": True, "precompute": True}, r"ATTNQUANT_PRECOMPUTE=1 .*OUTSIDE=0"),
    ],
)
def test_unservable_combinations_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose_path(dataclasses.replace(BASE, **changes), "cpu", residual=True)


# --- every path through MAX on CPU --------------------------------------------


def checkpoint(seed: int, width: int = 1) -> dict[str, torch.Tensor]:
    """Layers that resemble each other (a shared part plus noise), so bands
    and residuals are meaningful, in bf16 as checkpoints are; ``width``
    multiplies every dimension."""
    g = torch.Generator().manual_seed(seed)
    hidden, q, kv, inter = (width * d for d in (HIDDEN, Q, KV, INTER))
    shapes = {
        "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden), "self_attn.o_proj": (hidden, q),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }  # fmt: skip
    out = {}
    for name, (n, k) in shapes.items():
        common = torch.randn(n, k, generator=g)
        for layer in range(LAYERS):
            w = (common + 0.5 * torch.randn(n, k, generator=g)) / math.sqrt(k)
            out[f"model.layers.{layer}.{name}.weight"] = w.to(torch.bfloat16)
    out["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)  # a non-projection tensor
    return out


def reference(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The toy stack in float64 on plain weights."""
    h = x.double()
    for layer in range(LAYERS):
        w = {k.split(f"layers.{layer}.", 1)[1]: v.double() for k, v in weights.items() if f"layers.{layer}." in k}
        qkv = torch.cat([h @ w[f"self_attn.{p}_proj.weight"].T for p in "qkv"], dim=-1)
        h = h + 0.5 * (qkv[:, :Q] @ w["self_attn.o_proj.weight"].T)
        gate = torch.nn.functional.gelu(h @ w["mlp.gate_proj.weight"].T, approximate="tanh")
        h = h + (gate * (h @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return h


def build_stack(plan, rows_padded: bool = False):
    """Our projection modules in a toy Gemma-shaped decoder (no attention math).

    ``rows_padded``: trace it recording, in ``PADDED``, each group whose rows
    ``attnquant.graph.matmul`` pads (its plan asks for the sm_90 padding
    behind the one-row branch, so that CI runs that GPU-only code on CPU)."""
    from max.experimental.nn import Module
    from max.experimental.nn.sequential import ModuleList
    from max.experimental.tensor import Tensor

    from attnquant.graph.projections import build_projection
    from attnquant.graph.theta import shared_blocks
    from models.common.mlp import build_mlp

    class Attention(Module):
        def __init__(self, prefix: str) -> None:
            super().__init__()
            self.qkv_proj = build_projection(plan[f"{prefix}.qkv_proj"])
            self.o_proj = build_projection(plan[f"{prefix}.o_proj"])

        def forward(self, h):
            return self.o_proj(self.qkv_proj(h)[:, :Q])

    class Layer(Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.self_attn = Attention(f"model.layers.{i}.self_attn")
            self.mlp = build_mlp(
                plan[f"model.layers.{i}.mlp.gate_up_proj"], plan[f"model.layers.{i}.mlp.down_proj"],
                "gelu_tanh",
            )  # fmt: skip

        def forward(self, h):
            h = h + 0.5 * self.self_attn(h)
            return h + self.mlp(h)

    class Decoder(Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = ModuleList([Layer(i) for i in range(LAYERS)])
            self.norm = Tensor.zeros([HIDDEN])  # so the checkpoint's norm binds

        def forward(self, h):
            for layer in self.layers:
                h = layer(h)
            return h

    class Stack(Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Decoder()

        def forward(self, x):
            if not rows_padded:
                return self.model(x)
            real = matmul.with_padded_rows
            with mock.patch.object(matmul, "with_padded_rows", lambda *args: PADDED.append(args) or real(*args)):
                return self.model(x)

    with shared_blocks():  # one per model: parts alias W0 within it only
        return Stack()


@pytest.mark.parametrize("gemm", [True, False])
def test_matmul_paths_pad_the_residual_width(gemm: bool) -> None:
    """GEMM/fold multiply by U with MAX's matmul, which cannot compile a small
    inner width on the H200: U and V get zero columns up to a multiple of
    MIN_INNER_MULTIPLE. The generated op reads the exact rank. (That the padded
    graph computes the same product: test_path_matches_precompute_outside.)"""
    from max.driver import CPU
    from max.dtype import DType

    from attnquant.load import pipeline as loading
    from attnquant.max_compat import MIN_INNER_MULTIPLE
    from attnquant.plan import part_name

    config = dataclasses.replace(BASE, gemm=gemm, blocks=1, rank=3, fused_mlp=False)
    prepared = loading.prepare_weights(
        checkpoint(seed=0), config, checkpoint_files=[], num_layers=LAYERS, dtype=DType.float32, device_api="cpu"
    )
    for group, parts in prepared.plan.items():
        for i, part in enumerate(parts):
            name = part_name(group, i, len(parts))
            u, v = prepared.state_dict[f"{name}.u"], prepared.state_dict[f"{name}.v"]
            exact = config.rank * len(part.members)
            assert part.rank == u.shape[1] == v.shape[1] == (MIN_INNER_MULTIPLE if gemm else exact)
            assert u[:, :exact].any() and not u[:, exact:].any() and not v[:, exact:].any()


@pytest.mark.parametrize(
    "mode, capture, expected", [(True, True, "branch"), (True, False, "fixed"), (False, True, "off"), (None, True, "off")]
)
def test_conversion_for_the_device_records_the_row_padding(mode: bool | None, capture: bool, expected: str) -> None:
    """ATTNQUANT_ROW_PADDING is decided once, when the weights are converted
    for the device, and recorded on every part for the graph modules (on CPU
    auto means no padding; test_matmul checks what each value does)."""
    from max.driver import CPU
    from max.dtype import DType

    from attnquant.graph import runtime
    from attnquant.load import pipeline as loading

    config = dataclasses.replace(BASE, gemm=True, blocks=1, rank=3, row_padding=mode)
    prepared = loading.prepare_weights(
        checkpoint(seed=0), config, checkpoint_files=[], num_layers=LAYERS, dtype=DType.float32, device_api="cpu"
    )
    plan = runtime.for_device(
        prepared.state_dict, prepared.plan, config, dtype=DType.float32, device=CPU(), graph_capture=capture
    )
    assert {part.row_padding for parts in plan.values() for part in parts} == {expected}


def test_fold_summary_counts_the_w_eff_max_folds_at_load() -> None:
    """MAX evaluates the fold's weight-only expression once at load and keeps
    its result (bench/checks/graph_fold_cpu.py): the load line says the fold holds
    theta plus a dense W_eff and reads the dense W_eff per token; GEMM does not."""
    import re

    from max.driver import CPU
    from max.dtype import DType

    from attnquant.load import pipeline as loading

    ckpt = checkpoint(seed=0, width=16)  # 7.5 MiB of projections: MiB figures not rounded to 0

    def summary(**changes) -> str:
        config = dataclasses.replace(BASE, blocks=1, rank=3, **changes)
        return loading.prepare_weights(
            ckpt, config, checkpoint_files=[], num_layers=LAYERS, dtype=DType.float32, device_api="cpu"
        ).report.line()

    def figures(line: str, what: str, unit: str) -> tuple[float, float]:
        found = re.search(rf"{what} ([\d.]+) {unit} -> ([\d.]+) {unit}", line)
        return float(found[1]), float(found[2])

    fold, gemm = summary(precompute=True), summary(gemm=True)
    dense, theta = figures(fold, "projection bytes", "MiB")
    assert dense > 7 and theta < dense / 1.5
    assert f"-> {theta:.1f} MiB + {dense:.1f} MiB W_eff folded by MAX at load" in fold
    per_token = figures(fold, "weights per decode token", "GiB")
    assert per_token[0] == per_token[1]
    assert "folded" not in gemm and figures(gemm, "projection bytes", "MiB") == (dense, theta)


PADDED: list[tuple] = []

CASES = {  # together: every path, fused and unfused groups, R = 0 and R > 0, shared and passthrough
    "gemm-G1-R3": dict(gemm=True, blocks=1, rank=3),
    "gemm-G1-R3-rows-padded": dict(gemm=True, blocks=1, rank=3, row_padding=True),  # see build_stack
    "fold-G1-R0-unfused": dict(precompute=True, blocks=1, rank=0, qkv_fuse=False),
    "generated-fused-mlp-G1-R3": dict(gemm=False, blocks=1, rank=3, fused_mlp=True),
    "generated-passthrough": dict(gemm=False, blocks=LAYERS, fused_mlp=False),
}


@pytest.fixture(scope="module")
def served() -> dict[str, tuple]:
    """Every case prepared by the load pipeline, all compiled as one graph
    (one compile instead of one per case), run on one input."""
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental.nn import Module
    from max.experimental.nn.sequential import ModuleList
    from max.experimental.tensor import Tensor, default_device
    from max.graph import DeviceRef, TensorType

    from attnquant.graph import runtime
    from attnquant.load import pipeline as loading

    prepared, state = {}, {}
    for i, (case, changes) in enumerate(CASES.items()):
        config = dataclasses.replace(BASE, **changes)
        ckpt = checkpoint(seed=i)
        weights = loading.prepare_weights(
            ckpt, config, checkpoint_files=[], num_layers=LAYERS, dtype=DType.float32, device_api="cpu"
        )
        # Captured decode steps: the padded case's plan asks for the one-row branch.
        plan = runtime.for_device(
            weights.state_dict, weights.plan, config, dtype=DType.float32, device=CPU(), graph_capture=True
        )
        prepared[case] = (config, ckpt, dataclasses.replace(weights, plan=plan))
        for name, tensor in prepared[case][2].state_dict.items():
            state[f"cases.{i}.{name.removesuffix('.weight') if name == 'model.norm.weight' else name}"] = tensor

    class AllCases(Module):
        def __init__(self) -> None:
            super().__init__()
            self.cases = ModuleList(
                [build_stack(p.plan, rows_padded=case.endswith("rows-padded")) for case, (_, _, p) in prepared.items()]
            )

        def forward(self, x):
            return tuple(stack(x) for stack in self.cases)

    with default_device(CPU()):
        model = AllCases()
    run = model.compile(TensorType(DType.float32, ["m", HIDDEN], DeviceRef.CPU()), weights=state)
    x = torch.randn(5, HIDDEN)
    outputs = run(Tensor.from_dlpack(x))
    return {
        case: (config, ckpt, p, x, torch.from_dlpack(y).double())
        for (case, (config, ckpt, p)), y in zip(prepared.items(), outputs, strict=True)
    }


@pytest.mark.max
@pytest.mark.parametrize("case", list(CASES))
def test_path_matches_precompute_outside(served: dict, case: str) -> None:
    from attnquant.load.precompute import precompute_outside

    config, ckpt, prepared, x, y = served[case]
    if case.endswith("rows-padded"):  # every GEMM part went through the padding, once
        assert len(PADDED) == sum(len(parts) for parts in prepared.plan.values())
    expected_path = "graph-fold" if config.precompute else ("gemm" if config.gemm else "generated")
    assert f"path={expected_path} (" in prepared.report.line()
    parts = [p for parts in prepared.plan.values() for p in parts]
    assert {p.kind for p in parts} == {"theta"}
    if config.blocks < LAYERS:
        # A band's W0 is one tensor object however many layers use it.
        owners = {p.shared_with for p in parts}
        assert len(owners) == len(parts) * config.blocks // LAYERS
    # precompute-outside's W_eff, before its storage rounding to bf16 (which
    # alone moves this output ~1e-2): s*W0 + U V^T in float64.
    ref = reference(x, w_eff_float64(ckpt, config))
    error = float((y - ref).norm() / ref.norm())
    assert error < 1e-5, f"{case}: relative error {error:.2e} vs precompute-outside"
    # And the served W_eff itself, within bf16 rounding.
    served_eff = precompute_outside(ckpt, dataclasses.replace(config, precompute_outside=True), progress=False)
    ref_bf16 = reference(x, {k: v for k, v in served_eff.state_dict.items() if "_proj" in k})
    assert float((y - ref_bf16).norm() / ref_bf16.norm()) < 5e-2


def w_eff_float64(ckpt: dict[str, torch.Tensor], config: AttnQuantConfig) -> dict[str, torch.Tensor]:
    from attnquant.formats.names import find_projections
    from attnquant.formats.theta import build_theta

    keys = find_projections(ckpt)
    theta = build_theta(
        {k: ckpt[k.weight_name] for k in keys}, blocks=config.blocks, rank=config.rank, num_layers=LAYERS
    )
    out = {}
    for key in keys:
        layer = theta.layers[(key.family, key.layer)]
        w0 = theta.shared[layer.group].double()
        out[key.weight_name] = layer.scale.double()[:, None] * w0 + layer.u.double() @ layer.v.double().T
    return out
