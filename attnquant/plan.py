"""The plan: what the load decided for each run-time matmul.

The load pipeline (``attnquant.load``) writes it, the conversion for the
serving device (``attnquant.graph.runtime``) completes it, and the graph
modules (``attnquant.graph``) read it and decide nothing again. It is the one
object load-time and run-time code share.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

Kind = Literal["dense", "nvfp4", "theta"]


class ReconstructionPath(str, enum.Enum):
    """How the projections' served weights are computed (``attnquant.load.path``)."""

    PRECOMPUTE_OUTSIDE = "precompute-outside"
    GRAPH_FOLD = "graph-fold"
    GEMM = "gemm"
    GENERATED = "generated"


GENERATED_MLP = "generated-mlp"
"""``PartPlan.reconstruction`` of MLP parts that one ``generated_mlp`` dispatch serves."""


@dataclass(frozen=True)
class PartPlan:
    """One run-time matmul: consecutive members of a fused group, of one kind.

    Fields up to ``reconstruction`` are written at load (``attnquant.load``);
    ``backend``, ``gemv_only``, ``kernel_params``, ``gated`` and ``row_padding`` when the weights are converted
    for the serving device (``attnquant.graph.runtime``).
    """

    kind: Kind
    members: tuple[str, ...]
    out_dims: tuple[int, ...]
    in_dim: int
    per_row_scale: bool = False
    """NVFP4 parts: ``weight_scale_2`` is one scale per output row (fused members
    quantized with different global scales; one more op after the matmul)."""
    rank: int = 0
    """Theta parts: the residual width (sum of the members' ranks, padded; 0: none)."""
    shared_with: str = ""
    """Theta parts: the part whose ``w0`` this part's ``w0`` is (itself if
    first). A dense output head: the embedding tensor it is tied to."""
    reconstruction: str = ""
    """Theta parts: the in-graph path (a :class:`ReconstructionPath` value or
    :data:`GENERATED_MLP`)."""
    backend: str = ""
    """NVFP4 parts: the kernel that serves it (``attnquant.graph.nvfp4``); its
    weights are laid out for that kernel."""
    gemv_only: bool = False
    """NVFP4 parts: the GEMV kernel at every token count (``ATTNQUANT_NVFP4_DISPATCH=gemv``)."""
    kernel_params: tuple[tuple[str, int], ...] = ()
    """NVFP4 parts: the backend's kernel parameters (the sm90 GEMV variant)."""
    gated: bool = False
    """NVFP4 gate|up parts: rows interleaved for the backend's gated epilogue,
    which gives the MLP's hidden state ``act(gate) * up`` (``out_dim / 2``
    columns) instead of gate|up (``ATTNQUANT_GATED_GEMV``)."""
    row_padding: str = "off"
    """How our MAX matmuls on this part pad their token rows to full tiles (an
    ``attnquant.max_compat.RowPadding`` value; ``ATTNQUANT_ROW_PADDING``)."""

    @property
    def out_dim(self) -> int:
        return sum(self.out_dims)


ProjectionPlan = dict[str, tuple[PartPlan, ...]]
"""``"model.layers.3.self_attn.qkv_proj"`` -> its parts, in output order. The
output head, when attnquant computes it, is the group ``LM_HEAD``."""

LM_HEAD = "lm_head"
"""The plan key (and tensor prefix) of the output head."""


def part_name(group: str, index: int, num_parts: int) -> str:
    """Where a part's tensors live: the group's own name when it is the only part."""
    return group if num_parts == 1 else f"{group}.{index}"
