"""Calling attnquant's Mojo custom ops (``kernels/attnquant_ops``) from a graph."""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, Dim, Graph, TensorType

from kernels import OPS_PATH

_GRAPHS_WITH_OPS: weakref.WeakSet[Graph] = weakref.WeakSet()


def custom_extensions_path() -> Path:
    """The Mojo package with the attnquant ops; pass it as ``custom_extensions``."""
    return OPS_PATH


def _ops_for_current_graph() -> Path | None:
    """The ops package the first time the graph being built asks, then None.

    Importing a Mojo *source* package into a graph re-runs ``mojo precompile``
    (seconds) on every import, and a model has one call per projection group:
    loading it once per graph takes a 270M model's graph build from minutes to
    seconds on 2 cores.
    """
    graph = Graph.current
    if graph in _GRAPHS_WITH_OPS:
        return None
    _GRAPHS_WITH_OPS.add(graph)
    return custom_extensions_path()


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
    out = TensorType(dtype, list(shape), DeviceRef.from_device(device_of.device))
    (y,) = F.custom(
        name, device_of.device, list(operands), [out], parameters=dict(parameters) if parameters else None,
        custom_extensions=_ops_for_current_graph(),
    )  # fmt: skip
    return y


def rowwise_op(
    name: str, x: Tensor, weights: Sequence[Tensor], n: int | Dim, parameters: Mapping[str, int] | None = None
) -> Tensor:
    """Op ``name`` on ``x`` [M, K] and ``weights``, giving [M, n] in ``x``'s dtype."""
    return custom_op(name, x, [x, *weights], [x.shape[0], n], x.dtype, parameters)
