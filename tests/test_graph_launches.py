"""Kernel launches read from MAX's compiled graph (bench/harness/graph_launches.py),
and the launch counts our layers are built for, compiled for a virtual sm_90a."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_modules import bench_module
from tests.virtual_gpu import compile_for_virtual_gpu

# Summaries as MAX 26.7 writes them for Gemma 4's q/k/v norms (host steps cut short).
CAST_NORM_ROPE = (
    "Sequence(mgp.tensor.extract.buffer, mo.cast, mgp.tensor.extract.buffer, index.constant, "
    "Epilogue(Prologue(mo.static.reshape, mo.reduce.rms_norm, operandIndices=[0]), "
    "View(mo.static.broadcast_to, Elementwise(mo.mul, mo.cast)), operandIndices=[0]), "
    "mgp.tensor.extract.tensor_spec, pop.cast_from_builtin, custom__mo.rope_split_store.ragged.paged)"
)
GPU = '!mgp.device_context<<"gpu", 0>>'


def _execute(summary: str, device: str = GPU, is_async: bool = True) -> str:
    return (f'    %1 = "mgp.generic.execute"(%arg1) <{{aRuntimeSlot = 0 : ui64, dSummary = "{summary}", '
            f'eIsAsync = {str(is_async).lower()}, fConstantResource = []}}> : (!mgp.context, {device}) -> !mef.chain')  # fmt: skip


def test_each_top_level_op_or_fused_group_is_one_launch() -> None:
    launches = bench_module("graph_launches").launches
    assert launches(CAST_NORM_ROPE) == [
        "mo.cast",
        "mo.static.reshape, mo.reduce.rms_norm, mo.static.broadcast_to, mo.mul, mo.cast",
        "custom__mo.rope_split_store.ragged.paged",
    ]
    assert launches("Elementwise(mo.greater, mo.not)") == ["mo.greater, mo.not"]
    assert launches("Sequence(custom__attnquant.nvfp4_gemv_sm90, index.casts, mgp.tensor.create)") == [
        "custom__attnquant.nvfp4_gemv_sm90"
    ]
    assert launches("mgp.buffer.alloc") == []


def test_a_step_takes_the_gemv_route_of_each_branch_and_only_gpu_work() -> None:
    step_launches = bench_module("graph_launches").step_launches
    mgp = "\n".join([
        "  mef.callable @G$init() {",
        _execute("mo.reduce.rms_norm"),  # at load, not in the step
        "  }",
        "  mef.callable @G$exec(%arg0: !mef.chain) {",
        _execute("Sequence(mo.reduce.rms_norm)"),
        _execute("Elementwise(mo.greater, mo.not)", device='!mgp.device_context<<"cpu", 0>>'),
        _execute("Sequence(index.constant)", is_async=False),
        "    %61:3 = grt.if %60 (%57 as %arg24: !mef.chain) {",
        _execute("custom__attnquant.nvfp4_dequant_sm90"),
        _execute("Sequence(mo.matmul)"),
        "    } else {",
        _execute("Sequence(custom__attnquant.nvfp4_gemv_sm90, index.casts)"),
        "    }",
        _execute(CAST_NORM_ROPE),
        "  }",
    ])  # fmt: skip
    assert step_launches(mgp) == [
        "mo.reduce.rms_norm",
        "custom__attnquant.nvfp4_gemv_sm90",
        "mo.cast",
        "mo.static.reshape, mo.reduce.rms_norm, mo.static.broadcast_to, mo.mul, mo.cast",
        "custom__mo.rope_split_store.ragged.paged",
    ]
    with pytest.raises(ValueError, match=r"no \$exec"):
        step_launches("module {}")


_NORMED_HEADS = """
from models.common.attention import normed_heads

def forward(qkv, scales):  # 31B's sliding layers: 32 q, 16 k and 16 v heads of 256
    return normed_heads(qkv, scales, 1e-6)

compilation.compile(forward, session=session)(
    TensorLayout(DType.bfloat16, ["m", 64 * 256], gpu), TensorLayout(DType.float32, [64, 256], gpu))
print("COMPILED")
"""


@pytest.mark.max
def test_per_head_norms_are_one_launch_on_sm90(tmp_path: Path) -> None:
    """The q/k(/v) norms of a Gemma layer, as both attentions build them
    (``normed_heads``), in bfloat16 for a virtual sm_90a: one kernel (the
    norm, with its per-head multiply and cast fused), no cast in front."""
    # A cache of its own: a graph found compiled in MAX's cache writes no IR.
    r = compile_for_virtual_gpu("sm_90a", _NORMED_HEADS, env={
        "MODULAR_DEBUG": f"ir-output-dir={tmp_path}", "MODULAR_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    assert r.returncode == 0 and "COMPILED" in r.stdout, (r.stdout + r.stderr)[-4000:]
    (mgp,) = tmp_path.glob("*.mgp.mlir")
    found = bench_module("graph_launches").step_launches(mgp.read_text())
    assert len(found) == 1 and "mo.reduce.rms_norm" in found[0], found


_ADD_AND_NORM = """
from attnquant.graph.residual_norm import NormKernel, NormSpec, add_and_norm

def forward(x, residual, w1, w2, s):  # Gemma 4's layer end at the 31B width
    return add_and_norm(x, residual, NormSpec(w1, 1e-6, 0.0), NormSpec(w2, 1e-6, 0.0), kernel={kernel}, scale=s)

bf16 = lambda *shape: TensorLayout(DType.bfloat16, list(shape), gpu)
compilation.compile(forward, session=session)(bf16("m", 5376), bf16("m", 5376), bf16(5376), bf16(5376), bf16(1))
print("COMPILED")
"""


@pytest.mark.max
@pytest.mark.parametrize("kernel", ["False", "True", "NormKernel(True, pdl=True)"])
def test_add_and_norm_is_one_launch_on_sm90(tmp_path: Path, kernel: str) -> None:
    """A layer's "norm, add (the residual scaled), norm", for a virtual
    sm_90a: one kernel, MAX's fused norm or attnquant's residual_rms_norm
    (also with programmatic dependent launch)."""
    r = compile_for_virtual_gpu("sm_90a", _ADD_AND_NORM.replace("{kernel}", kernel), env={
        "MODULAR_DEBUG": f"ir-output-dir={tmp_path}", "MODULAR_CACHE_DIR": str(tmp_path / "cache")})  # fmt: skip
    assert r.returncode == 0 and "COMPILED" in r.stdout, (r.stdout + r.stderr)[-4000:]
    (mgp,) = tmp_path.glob("*.mgp.mlir")
    found = bench_module("graph_launches").step_launches(mgp.read_text())
    expected = "custom__attnquant.residual_rms_norm" if kernel != "False" else "rms_norm_fused_residual_add"
    assert len(found) == 1 and expected in found[0], found
