"""One MAX graph of many small cases, for the checks that compare MAX's output with float64.

Shared by ``lowrank_matmul_check.py`` and ``max_gpu_patterns_check.py``: the
device and dtypes each check runs in, the Gemma 3 1B projection shapes, the
error measure, and compiling a list of modules as one graph with a symbolic
token count (one compile, every case).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# [N, K] of each Gemma 3 1B projection group as attnquant serves it (q|k|v and
# gate|up fused; ATTNQUANT_QKV_FUSE=1).
HIDDEN, INTERMEDIATE = 1152, 6912
GROUPS = {"qkv": (1536, HIDDEN), "o": (HIDDEN, 1024), "gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}


@dataclass(frozen=True)
class Target:
    """Where a check runs: bf16 on the accelerator, or float32 on the CPU."""

    device: Any  # max.driver.Device
    ref: Any  # max.graph.DeviceRef
    dtype: Any  # max.dtype.DType
    torch_dtype: torch.dtype
    torch_device: str


def target(gpu: bool) -> Target:
    from max.driver import CPU, Accelerator
    from max.dtype import DType
    from max.graph import DeviceRef

    if gpu:
        return Target(Accelerator(), DeviceRef.GPU(), DType.bfloat16, torch.bfloat16, "cuda")
    return Target(CPU(), DeviceRef.CPU(), DType.float32, torch.float32, "cpu")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected||, in float64."""
    return float((got.double() - expected).norm() / expected.norm())


@contextmanager
def building(where: Target) -> Iterator[None]:
    """Modules made inside get their parameters on ``where``'s device and dtype."""
    from max.experimental.tensor import default_device, default_dtype

    with default_device(where.device), default_dtype(where.dtype):
        yield


def compile_cases(
    modules: Sequence[Any],
    in_widths: Sequence[int],
    weights: Sequence[dict[str, torch.Tensor]],
    where: Target,
) -> Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]:
    """Compiles ``modules`` (made under ``building(where)``; case i takes
    ``[m, in_widths[i]]`` and gets ``weights[i]``, keyed by its own parameter
    names) as one graph. Returns a function from the cases' inputs to every
    output, flattened (a case returning a tuple contributes each), as
    float64 host tensors."""
    from max.driver import CPU
    from max.experimental.nn import Module
    from max.experimental.nn.sequential import ModuleList
    from max.experimental.tensor import Tensor
    from max.graph import TensorType

    class AllCases(Module):
        def __init__(self) -> None:
            super().__init__()
            self.cases = ModuleList(modules)

        def forward(self, *xs):
            outputs = [case(x) for case, x in zip(self.cases, xs, strict=True)]
            return tuple(y for out in outputs for y in (out if isinstance(out, tuple) else (out,)))

    with building(where):
        module = AllCases()
    flat = {f"cases.{i}.{name}": t for i, case in enumerate(weights) for name, t in case.items()}
    run = module.compile(*[TensorType(where.dtype, ["m", k], where.ref) for k in in_widths], weights=flat)

    def execute(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        outputs = run(*[Tensor.from_dlpack(x).to(where.device) for x in xs])
        return [torch.from_dlpack(y.to(CPU())).double() for y in outputs]

    return execute
