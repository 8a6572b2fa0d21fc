"""Decoder layers of one structure compiled once: MAX subgraphs shared by name.

MAX's compiler processes every op of a graph, so 26 identical layers cost 26
layers of compile. ``max.experimental.nn.as_subgraph`` traces one layer into
a subgraph and calls it from each layer given the same name, every call
binding its own layer's weights by their name prefix. It matters most on
sm_90, where our row padding's one-row branch and the NVFP4 GEMV's M dispatch
put an ``F.cond`` around each projection, which MAX compiles slowly
(docs/dev/max-workarounds.md).

They are shared on every device by default: on the H200 a decode step with
shared subgraphs measured as fast as one with every layer inlined, side by
side, while the compile took half the time (docs/performance.md).
``ATTNQUANT_LAYER_SUBGRAPHS=cpu`` inlines every layer on a GPU.

Layers share a subgraph only when they build the same ops: the same attention
kind and the same projection plan but for names. What differs between them
inside the body enters as an argument (the KV-cache layer index, the rotary
table), never as a Python constant, or every layer would run the first one's.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

from max.driver import Device
from max.experimental.nn import Module, as_subgraph
from max.experimental.realization_context import in_graph_context
from max.graph import Graph

from attnquant.config import LOGGER_NAME, AttnQuantConfig
from attnquant.graph.ops import import_ops
from attnquant.plan import PartPlan

logger = logging.getLogger(LOGGER_NAME)

_SUBGRAPH_INPUTS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "attnquant_subgraph_inputs", default=None
)


def subgraph_inputs() -> dict[str, Any] | None:
    """Inside a shared layer subgraph's body: the per-layer values it was
    called with (the layer's ``layer_values()``, now the subgraph's
    arguments); elsewhere None."""
    return _SUBGRAPH_INPUTS.get()


LAYER_GROUPS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""A Gemma decoder layer's projection groups, in the plan's names relative to the layer."""


def part_structure(part: PartPlan) -> PartPlan | None:
    """What of ``part`` decides the ops its layer builds (its names taken out),
    or None for a part that reads a tensor outside its layer (a theta part's
    ``w0`` is shared by a band of layers), which a subgraph cannot bind."""
    if part.kind == "theta":
        return None
    return dataclasses.replace(part, members=(), shared_with="")


@dataclasses.dataclass(frozen=True)
class SubgraphChoice:
    """Whether a model's decoder layers share subgraphs, and why (the load log says it)."""

    enabled: bool
    reason: str


def choose_layer_subgraphs(use_subgraphs: bool, where: str, device: Device) -> SubgraphChoice:
    """Shared subgraphs when MAX's ``--use-subgraphs`` (on by default) asks for
    them and ``ATTNQUANT_LAYER_SUBGRAPHS`` (``where``: ``always`` or ``cpu``)
    allows them on ``device``; inlined layers otherwise."""
    if not use_subgraphs:
        return SubgraphChoice(False, "--no-use-subgraphs")
    if where == "cpu" and not device.is_host:
        return SubgraphChoice(False, "on a GPU with ATTNQUANT_LAYER_SUBGRAPHS=cpu")
    return SubgraphChoice(True, f"ATTNQUANT_LAYER_SUBGRAPHS={where}")


def layer_subgraphs_of(pipeline_model: Any, settings: AttnQuantConfig) -> SubgraphChoice:
    """:func:`choose_layer_subgraphs` for a MAX pipeline model (its
    ``--use-subgraphs`` and its one device) and this load's settings."""
    use_subgraphs = pipeline_model.pipeline_config.model.use_subgraphs
    return choose_layer_subgraphs(use_subgraphs, settings.layer_subgraphs, pipeline_model.devices[0])


class LayerSubgraphs:
    """Assigns one model's decoder layers to subgraphs, one per structure
    (``choice``: :func:`choose_layer_subgraphs`; off, every layer is inlined)."""

    def __init__(self, model: str, choice: SubgraphChoice) -> None:
        self.model = model
        self.choice = choice
        self.names: dict[Hashable, str] = {}
        self.layers: Counter[str] = Counter()

    def share(self, layer: SharableLayer, kind: str, groups: list[tuple[PartPlan, ...]]) -> None:
        """Makes ``layer`` (attention ``kind``, these projection groups, and
        an ``mlp`` child) call its structure's subgraph."""
        parts = tuple(part_structure(p) for group in groups for p in group)
        if not self.choice.enabled or any(p is None for p in parts):
            self.layers["inlined"] += 1
            return
        name = self.names.setdefault((kind, parts), f"{self.model}_{kind}_layer_{len(self.names)}")
        self.layers[name] += 1
        layer.subgraph_name = name

    def log(self) -> None:
        total = sum(self.layers.values())
        if not self.choice.enabled:
            logger.info("attnquant %s: %d decoder layers inlined (%s)", self.model, total, self.choice.reason)
            return
        layers = ", ".join(f"{name} x{count}" for name, count in self.layers.items())
        why = " (layers with theta parts read tensors of other layers)" if "inlined" in self.layers else ""
        logger.info(
            "attnquant %s: %d decoder layers compiled as %d shared subgraph(s): %s%s",
            self.model, total, len(self.names), layers, why,
        )  # fmt: skip


def weight_prefix(layer: Module[..., Any]) -> str:
    """Where ``layer``'s weights are named (``"language_model.layers.3."``),
    read off its MLP's first weight (the layer's own: a child like the rotary
    table may be shared between layers and named after the first)."""
    path, weight = next(iter(layer.mlp.parameters))
    name, suffix = weight.external_name, f"mlp.{path}"
    if name is None or not name.endswith(suffix):
        raise ValueError(f"the layer's weight {path!r} is named {name!r}, not '<prefix>{suffix}'")
    return name[: -len(suffix)]


class SharableLayer(Module[..., Any]):
    """A decoder layer :class:`LayerSubgraphs` can share: its call runs
    :func:`call_forward`, and ``layer_values()`` gives what differs between
    the layers of one subgraph, as graph values of the enclosing graph (their
    attention's cache index and rotary table, ``common.attention.layer_values``,
    and whatever else the layer adds)."""

    subgraph_name: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_forward(self, *args, **kwargs)

    def layer_values(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must say its per-layer values")


def call_forward(layer: SharableLayer, *args: Any, **kwargs: Any) -> Any:
    """``layer``'s forward, through its shared subgraph when it has one."""
    forward = type(layer).forward
    if layer.subgraph_name is None or not in_graph_context():  # inlined, or eager: nothing to share
        return forward(layer, *args, **kwargs)
    # Projections may call our custom ops, which MAX compiles only from
    # the root graph's kernel libraries (a subgraph starts with those).
    import_ops(Graph.current)
    body = functools.partial(_body, forward, layer)
    call = as_subgraph(body, name=layer.subgraph_name, prefix=weight_prefix(layer))
    return call(*args, **kwargs, layer_inputs=layer.layer_values())


def _body(forward: Callable[..., Any], layer: Any, *args: Any, layer_inputs: dict[str, Any], **kwargs: Any) -> Any:
    """The traced body: ``layer``'s forward, reading its per-layer values from the arguments."""
    token = _SUBGRAPH_INPUTS.set(layer_inputs)
    try:
        return forward(layer, *args, **kwargs)
    finally:
        _SUBGRAPH_INPUTS.reset(token)
