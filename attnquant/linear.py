"""Run-time projection modules (MAX ModuleV3) built from a ``ProjectionPlan``.

Each module declares exactly the tensors ``runtime_layout`` writes, so MAX's
weight binding checks names, shapes and dtypes for us.
"""

from __future__ import annotations

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.sequential import ModuleList
from max.experimental.tensor import Tensor

from attnquant import kernels, matmul
from attnquant.runtime_layout import PartPlan
from attnquant.theta_linear import build_theta_part


class DenseProjection(Module[[Tensor], Tensor]):
    """``x @ W.T`` with W in the model dtype."""

    def __init__(self, part: PartPlan) -> None:
        super().__init__()
        self.weight = Tensor.zeros([part.out_dim, part.in_dim])

    def forward(self, x: Tensor) -> Tensor:
        return matmul.linear(x, self.weight)


class NVFP4Projection(Module[[Tensor], Tensor]):
    """``x @ dequant(W).T`` with W kept packed (ModelOpt NVFP4, scales as bits)."""

    def __init__(self, part: PartPlan) -> None:
        super().__init__()
        n, k = part.out_dim, part.in_dim
        self.out_features = n
        self.layout = kernels.WeightLayout(part.layout)
        packed_shape, scale_shape = self.layout.shapes(n, k)
        self.per_row_scale = part.per_row_scale
        self.gemv_only = part.gemv_only
        self.weight = Tensor.zeros(packed_shape, dtype=DType.uint8)
        self.weight_scale = Tensor.zeros(scale_shape, dtype=DType.uint8)
        self.weight_scale_2 = Tensor.zeros(
            [n if self.per_row_scale else 1], dtype=DType.float32
        )

    def _linear(self, x: Tensor, global_scale: Tensor) -> Tensor:
        return kernels.nvfp4_linear(
            x, self.weight, self.weight_scale, global_scale,
            layout=self.layout, out_features=self.out_features, gemv_only=self.gemv_only,
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        if not self.per_row_scale:
            return self._linear(x, self.weight_scale_2)
        # Fused members with different global scales: decode at scale 1,
        # then apply each output row's scale to the (small) activation output.
        one = F.constant(1.0, DType.float32, device=self.weight.device).reshape([1])
        y = self._linear(x, one)
        return y * F.cast(self.weight_scale_2, y.dtype)


class ProjectionGroup(ModuleList[Module[[Tensor], Tensor]]):
    """Several parts of one fused group; outputs concatenated in member order."""

    def forward(self, x: Tensor) -> Tensor:
        return F.concat([part(x) for part in self], axis=-1)


def build_part(part: PartPlan) -> Module[[Tensor], Tensor]:
    if part.kind == "theta":
        return build_theta_part(part)
    return NVFP4Projection(part) if part.kind == "nvfp4" else DenseProjection(part)


def build_projection(parts: tuple[PartPlan, ...]) -> Module[[Tensor], Tensor]:
    """One module for a group: the part itself, or a ``ProjectionGroup``."""
    if len(parts) == 1:
        return build_part(parts[0])
    return ProjectionGroup([build_part(p) for p in parts])
