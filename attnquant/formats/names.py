"""The Gemma projection vocabulary, defined once: names in a checkpoint and
the groups the run-time layout fuses.

A projection weight is named ``<prefix>.layers.<i>.<block>.<proj>.weight``:

* ``prefix``: where the text decoder sits; only the components ``model`` and
  ``language_model`` qualify (``model``, ``model.language_model``,
  ``language_model.model`` ...), so vision-tower projections, which have the
  same ``self_attn.q_proj`` names, are never picked up;
* ``block``: ``self_attn`` or ``mlp``;
* ``proj``: ``q_proj k_proj v_proj o_proj`` or ``gate_proj up_proj down_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FusedGroup:
    """Projections of one block that run as one matmul (output rows stacked)."""

    block: str
    name: str
    members: tuple[str, ...]


GATE_UP_MEMBERS = ("gate_proj", "up_proj")
"""The gated MLP's pair, in output order: ``act(gate(x)) * up(x)``."""

FUSED_GROUPS: tuple[FusedGroup, ...] = (
    FusedGroup("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    FusedGroup("self_attn", "o_proj", ("o_proj",)),
    FusedGroup("mlp", "gate_up_proj", GATE_UP_MEMBERS),
    FusedGroup("mlp", "down_proj", ("down_proj",)),
)
"""Every projection belongs to exactly one group, in output order."""

PROJECTIONS_BY_BLOCK: dict[str, tuple[str, ...]] = {}
for _group in FUSED_GROUPS:
    PROJECTIONS_BY_BLOCK.setdefault(_group.block, ())
    PROJECTIONS_BY_BLOCK[_group.block] += _group.members
PROJECTIONS: tuple[str, ...] = sum(PROJECTIONS_BY_BLOCK.values(), ())
FAMILIES: tuple[str, ...] = tuple(proj.removesuffix("_proj") for proj in PROJECTIONS)
BLOCK_PATTERN = "|".join(PROJECTIONS_BY_BLOCK)
"""Regex alternation of the block names (``self_attn|mlp``)."""
PROJECTION_PATH_PATTERN = "|".join(
    rf"{block}\.(?:{'|'.join(projs)})" for block, projs in PROJECTIONS_BY_BLOCK.items()
)
"""Regex alternation of ``<block>.<proj>`` over every projection."""


LAYER_NORMS: tuple[str, ...] = (
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
)  # fmt: skip
"""A decoder layer's RMSNorms (Gemma's sandwich: before and after attention, before and after the MLP)."""


def group_name(proj: str) -> str:
    """The run-time group a projection belongs to (``"q_proj"`` -> ``"qkv_proj"``)."""
    return next(group.name for group in FUSED_GROUPS if proj in group.members)

_WEIGHT_NAME = re.compile(
    r"^(?P<prefix>(?:(?:model|language_model)\.)*)"
    r"layers\.(?P<layer>\d+)\."
    rf"(?P<path>(?P<block>{BLOCK_PATTERN})\.(?P<proj>[a-z]+_proj))\.weight$"
)


@dataclass(frozen=True)
class ProjectionKey:
    """One projection of one decoder layer.

    Attributes:
        prefix: dotted path above ``layers`` (``""`` when there is none).
        layer: decoder layer index.
        block: ``"self_attn"`` or ``"mlp"``.
        proj: e.g. ``"q_proj"``.
    """

    prefix: str
    layer: int
    block: str
    proj: str

    def __post_init__(self) -> None:
        if self.proj not in PROJECTIONS_BY_BLOCK.get(self.block, ()):
            raise ValueError(
                f"{self.block}.{self.proj} is not a Gemma projection; expected one of "
                f"{', '.join(f'{b}.{p}' for b, ps in PROJECTIONS_BY_BLOCK.items() for p in ps)}"
            )

    @classmethod
    def parse(cls, weight_name: str) -> ProjectionKey | None:
        """The key of a ``...layers.<i>.<block>.<proj>.weight`` name, else None."""
        match = _WEIGHT_NAME.match(weight_name)
        if match is None or not re.fullmatch(PROJECTION_PATH_PATTERN, match["path"]):
            return None
        prefix = match["prefix"].removesuffix(".")
        return cls(prefix, int(match["layer"]), match["block"], match["proj"])

    @property
    def family(self) -> str:
        """``"q"``, ``"k"``, ``"v"``, ``"o"``, ``"gate"``, ``"up"`` or ``"down"``."""
        return self.proj.removesuffix("_proj")

    @property
    def module_name(self) -> str:
        """E.g. ``model.layers.3.self_attn.q_proj``."""
        head = f"{self.prefix}." if self.prefix else ""
        return f"{head}layers.{self.layer}.{self.block}.{self.proj}"

    @property
    def weight_name(self) -> str:
        """E.g. ``model.layers.3.self_attn.q_proj.weight``."""
        return f"{self.module_name}.weight"

    def sort_key(self) -> tuple[int, int]:
        """Layer order, then q, k, v, o, gate, up, down."""
        return self.layer, PROJECTIONS.index(self.proj)


def find_projections(names: Iterable[str]) -> list[ProjectionKey]:
    """Every projection weight among ``names``, in layer then projection order.

    Raises:
        ValueError: if projections sit under more than one prefix (two
            decoders in one checkpoint cannot share layer numbers).
    """
    keys = [key for key in map(ProjectionKey.parse, names) if key is not None]
    prefixes = sorted({key.prefix for key in keys})
    if len(prefixes) > 1:
        raise ValueError(
            f"projection weights found under several prefixes {prefixes}; attnquant "
            f"expects one text decoder per checkpoint"
        )
    return sorted(keys, key=ProjectionKey.sort_key)


def is_ignored(module_name: str, ignore_fragments: tuple[str, ...]) -> bool:
    """Whether any fragment names a run of whole dotted components of the module.

    ``"layers.3"`` matches ``model.layers.3.mlp.up_proj`` but not
    ``model.layers.30.mlp.up_proj``; ``"mlp"`` matches every MLP projection.
    """
    components = module_name.split(".")
    for fragment in ignore_fragments:
        wanted = fragment.split(".")
        width = len(wanted)
        if any(components[i : i + width] == wanted for i in range(len(components) - width + 1)):
            return True
    return False


def unmatched_fragments(fragments: tuple[str, ...], module_names: Iterable[str]) -> list[str]:
    """The fragments of ``fragments`` that match none of ``module_names``."""
    names = list(module_names)
    return [f for f in fragments if not any(is_ignored(name, (f,)) for name in names)]
