"""Gemma's gated MLP over attnquant projections (gate|up fused at load)."""

from __future__ import annotations

from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.activation import activation_function_from_name
from max.experimental.tensor import Tensor

from attnquant.linear import build_projection
from attnquant.runtime_layout import PartPlan


class ProjectedMLP(Module[[Tensor], Tensor]):
    """``down(act(gate(x)) * up(x))`` with gate and up in one matmul."""

    def __init__(
        self,
        gate_up: tuple[PartPlan, ...],
        down: tuple[PartPlan, ...],
        activation: str,
    ) -> None:
        super().__init__()
        self.gate_up_proj = build_projection(gate_up)
        self.down_proj = build_projection(down)
        self.feed_forward_length = down[0].in_dim
        self.activation = activation_function_from_name(activation)

    def forward(self, x: Tensor) -> Tensor:
        n = self.feed_forward_length
        gate, up = F.split(self.gate_up_proj(x), [n, n], axis=-1)
        return self.down_proj(F.mul(self.activation(gate), up))
