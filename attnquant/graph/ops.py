"""Calling attnquant's Mojo custom ops (``kernels/attnquant_ops``) from a graph."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, Dim, Graph, TensorType

from attnquant.max_compat import cuda_capability
from kernels import OPS_PATH

_GRAPHS_WITH_OPS: weakref.WeakSet[Graph] = weakref.WeakSet()
_built_packages: set[Path] = set()
"""The kernel-library paths importing ``OPS_PATH`` added (its built package)."""


PDL_MIN_CAPABILITY = 90
"""Programmatic dependent launch (``kernels/attnquant_ops/pdl.mojo``) uses
griddepcontrol, PTX for sm_90 and later."""


def pdl_refusal(device_api: str, device_arch: str) -> str | None:
    """Why attnquant's ops cannot launch with programmatic dependent launch on
    this device (``"needs sm_90+, device is ..."``), or None if they can."""
    if cuda_capability(device_api, device_arch) >= PDL_MIN_CAPABILITY:
        return None
    return f"needs sm_{PDL_MIN_CAPABILITY}+, device is {device_arch or device_api}"


def custom_extensions_path() -> Path:
    """The Mojo package with the attnquant ops; pass it as ``custom_extensions``."""
    return OPS_PATH


def import_ops(graph: Graph) -> None:
    """Makes the attnquant ops callable in ``graph``; the package is imported
    once per graph.

    Importing a Mojo *source* package re-runs ``mojo precompile`` (seconds)
    each time, and a model has one call per projection group: once per graph
    takes a 270M model's graph build from minutes to seconds on 2 cores.
    Import into the enclosing graph before tracing a subgraph that calls the
    ops: MAX 26.7 compiles custom ops only from the root graph's libraries
    (an import made inside a subgraph alone fails the compile with "'mo.custom'
    op currently not supported"), and a subgraph starts with its parent's.
    """
    if graph in _GRAPHS_WITH_OPS:
        return
    libraries = set(graph.kernel_libraries_paths)
    if not (_built_packages and _built_packages <= libraries):
        graph._import_kernels([OPS_PATH])  # as F.custom(custom_extensions=...) does
        _built_packages.update(set(graph.kernel_libraries_paths) - libraries)
    _GRAPHS_WITH_OPS.add(graph)


def custom_op_outputs(
    name: str,
    device_of: Tensor,
    operands: Sequence[Tensor],
    outputs: Sequence[tuple[Sequence[int | Dim], DType]],
    parameters: Mapping[str, int] | None = None,
) -> list[Tensor]:
    """The outputs, one per ``(shape, dtype)`` in ``outputs``, of op ``name``
    on ``device_of``'s device (``parameters``: the op's compile-time parameters)."""
    import_ops(Graph.current)
    device = DeviceRef.from_device(device_of.device)
    types = [TensorType(dtype, list(shape), device) for shape, dtype in outputs]
    return list(
        F.custom(name, device_of.device, list(operands), types, parameters=dict(parameters) if parameters else None)
    )


def custom_op(
    name: str,
    device_of: Tensor,
    operands: Sequence[Tensor],
    shape: Sequence[int | Dim],
    dtype: DType,
    parameters: Mapping[str, int] | None = None,
) -> Tensor:
    """The single output of op ``name`` on ``device_of``'s device (``parameters``:
    the op's compile-time parameters)."""
    (y,) = custom_op_outputs(name, device_of, operands, [(shape, dtype)], parameters)
    return y


def rowwise_op(
    name: str, x: Tensor, weights: Sequence[Tensor], n: int | Dim, parameters: Mapping[str, int] | None = None
) -> Tensor:
    """Op ``name`` on ``x`` [M, K] and ``weights``, giving [M, n] in ``x``'s dtype."""
    return custom_op(name, x, [x, *weights], [x.shape[0], n], x.dtype, parameters)
