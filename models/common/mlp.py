"""Gemma's gated MLP over attnquant projections (gate|up fused at load)."""

from __future__ import annotations

from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.activation import activation_function_from_name
from max.experimental.tensor import Tensor

from attnquant.graph import generated
from attnquant.graph.projections import ProjectionGroup, build_projection
from attnquant.graph.theta import GeneratedThetaProjection
from attnquant.plan import GENERATED_MLP, PartPlan


class ProjectedMLP(Module[[Tensor], Tensor]):
    """``down(act(gate(x)) * up(x))`` with gate and up in one matmul; a gated
    gate|up part (``PartPlan.gated``: NVFP4 on Hopper) applies the activation
    and the product itself."""

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
        self.gated = len(gate_up) == 1 and gate_up[0].gated
        self.activation = activation_function_from_name(activation)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            return self.down_proj(self.gate_up_proj(x))
        n = self.feed_forward_length
        gate, up = F.split(self.gate_up_proj(x), [n, n], axis=-1)
        return self.down_proj(F.mul(self.activation(gate), up))


class GeneratedMLP(Module[[Tensor], Tensor]):
    """``ATTNQUANT_FUSED_MLP=1`` on the generated path: gate, up, the
    activation and down in one ``generated_mlp`` dispatch. The tensors keep
    the names of the unfused parts (``gate_up_proj.0``/``.1``, ``down_proj``)."""

    def __init__(self, gate_up: tuple[PartPlan, ...], down: tuple[PartPlan, ...], activation: str) -> None:
        super().__init__()
        if activation not in generated.MLP_ACTIVATIONS:
            raise ValueError(
                f"generated_mlp implements {generated.MLP_ACTIVATIONS}, not {activation!r}; "
                "set ATTNQUANT_FUSED_MLP=0"
            )
        gate, up = gate_up
        self.gate_up_proj = ProjectionGroup([GeneratedThetaProjection(gate), GeneratedThetaProjection(up)])
        self.down_proj = GeneratedThetaProjection(down[0])

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj
        return generated.generated_mlp(
            x, gate.theta_args(), up.theta_args(), self.down_proj.theta_args()
        )


def build_mlp(
    gate_up: tuple[PartPlan, ...], down: tuple[PartPlan, ...], activation: str
) -> Module[[Tensor], Tensor]:
    """The MLP module the projection plan asks for."""
    if all(p.reconstruction == GENERATED_MLP for p in (*gate_up, *down)):
        return GeneratedMLP(gate_up, down, activation)
    return ProjectedMLP(gate_up, down, activation)
