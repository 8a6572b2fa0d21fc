"""Run-time projection modules (MAX ModuleV3) built from a ``ProjectionPlan``.

Each module declares exactly the tensors the load wrote for its part, so
MAX's weight binding checks names, shapes and dtypes for us. Dense and NVFP4
parts are here; theta parts (in-graph reconstruction) in ``graph.theta``.
"""

from __future__ import annotations

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.sequential import ModuleList
from max.experimental.tensor import Tensor

from attnquant.graph import matmul, nvfp4
from attnquant.graph.theta import build_theta_part
from attnquant.max_compat import RowPadding, device_arch
from attnquant.plan import PartPlan


class DenseProjection(Module[[Tensor], Tensor]):
    """``x @ W.T`` with W in the model dtype; ``weight``: a tensor of the
    model to read instead of declaring one (an embedding the head is tied to:
    MAX then binds one buffer for both)."""

    def __init__(self, part: PartPlan, weight: Tensor | None = None) -> None:
        super().__init__()
        self.weight = Tensor.zeros([part.out_dim, part.in_dim]) if weight is None else weight
        self.padding = RowPadding(part.row_padding)

    def forward(self, x: Tensor) -> Tensor:
        return matmul.linear(x, self.weight, self.padding)


class NVFP4Projection(Module[[Tensor], Tensor]):
    """``x @ dequant(W).T`` with W kept packed, read by the backend the plan
    names; a gated gate|up part (``PartPlan.gated``) gives ``gelu_tanh(gate) * up``."""

    def __init__(self, part: PartPlan) -> None:
        super().__init__()
        n, k = part.out_dim, part.in_dim
        self.backend = nvfp4.backend_named(part.backend)
        self.padding = RowPadding(part.row_padding)
        self.gemv_only = part.gemv_only
        self.kernel_params = part.kernel_params
        self.per_row_scale = part.per_row_scale
        self.gated = part.gated
        packed_shape, scale_shape = self.backend.layout.shapes(n, k)
        self.weight = Tensor.zeros(packed_shape, dtype=DType.uint8)
        self.weight_scale = Tensor.zeros(scale_shape, dtype=self.backend.layout.scale_dtype)
        self.weight_scale_2 = Tensor.zeros([n if self.per_row_scale else 1], dtype=DType.float32)
        self.out_features, self.in_features = n, k

    def _linear(self, x: Tensor, global_scale: Tensor) -> Tensor:
        config = nvfp4.NVFP4LayerConfig(
            self.out_features, self.in_features, x.dtype, str(x.device.api), device_arch(x.device),
            gemv_only=self.gemv_only, padding=self.padding, kernel_params=self.kernel_params, gated=self.gated,
        )  # fmt: skip
        return nvfp4.apply(self.backend, x, (self.weight, self.weight_scale, global_scale), config)

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


def build_output_head(parts: tuple[PartPlan, ...], embedding: Tensor) -> Module[[Tensor], Tensor]:
    """The output head the plan asks for: a dense head tied to the embedding
    (``PartPlan.shared_with``) reads the ``embedding`` tensor itself."""
    (part,) = parts
    if part.kind == "dense" and part.shared_with:
        return DenseProjection(part, weight=embedding)
    return build_part(part)


def build_projection(parts: tuple[PartPlan, ...]) -> Module[[Tensor], Tensor]:
    """One module for a group: the part itself, or a ``ProjectionGroup``."""
    if len(parts) == 1:
        return build_part(parts[0])
    return ProjectionGroup([build_part(p) for p in parts])
