"""Decoder layers that hand the next layer its input already normalized.

A Gemma layer begins with its input norm and ends with its post-MLP norm
added to the residual. On a GPU MAX runs "norm, add, norm" as one kernel,
but a fusion never crosses a layer subgraph's call (layers share subgraphs
by default, ``layer_subgraphs``), so the boundary between two layers ran as
two kernels. Here a layer ends by normalizing its output for the next layer
and passes both on, a :class:`LayerInput`: the boundary is one kernel,
inside the layer's body.

Each layer holds a norm of its own, ``next_input_norm``, whose weight is
the next layer's input-norm weight (the final norm's after the last layer)
under the layer's own name (:func:`with_next_norms` adds those names to the
served weights), so a shared body binds it by the layer's prefix as it
binds the rest. MAX's decoder loop only hands each layer's result to the
next, so it needs no change: the first layer normalizes its plain input (in
the enclosing graph, as before) and the last returns the plain residual.
MAX normalizes the rows it keeps after the last layer again; the last
layer's own normed rows cost no launch (the same kernel writes them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

from max.dtype import DType
from max.experimental.nn import Module
from max.experimental.tensor import Tensor

from attnquant.config import AttnQuantConfig
from attnquant.graph.residual_norm import NormKernel, NormKernelConfig, NormSpec, add_and_norm, choose_norm_kernel
from attnquant.max_compat import device_arch

from .layer_subgraphs import SharableLayer, call_forward, subgraph_inputs


class LayerInput(NamedTuple):
    """What one decoder layer hands the next: the residual stream, and the
    same through the next layer's input norm."""

    residual: Tensor
    normed: Tensor


NEXT_NORM = "next_input_norm"
"""The attribute, and the weight name within a layer, of a layer's copy of the next layer's input norm."""


def norm_kernel_of(pipeline_model: Any, settings: AttnQuantConfig, hidden: int, dtype: DType) -> NormKernel:
    """Whether a MAX pipeline model's layers (on its one device, rows of
    ``hidden`` in ``dtype``) add and norm with attnquant's kernel, and how it
    launches (``attnquant.graph.residual_norm.choose_norm_kernel``, logged)."""
    device = pipeline_model.devices[0]
    return choose_norm_kernel(
        NormKernelConfig(hidden, dtype, str(device.api), settings.norm_kernel, device_arch(device), settings.pdl)
    )


def hand_on_input_norms(
    layers: Sequence[Module[..., Any]], final_norm: Module[..., Any], *, norm_kernel: NormKernel | bool
) -> None:
    """Gives each layer its ``next_input_norm``: a norm like the next
    layer's input norm (the final norm after the last layer), with a weight
    of its own that :func:`with_next_norms` names. One eps for all, or a
    shared body would normalize every layer with the first one's.
    ``norm_kernel``: the layers add and norm with attnquant's kernel
    (:func:`norm_kernel_of`)."""
    norms = [layer.input_layernorm for layer in layers[1:]] + [final_norm]
    eps = {norm.eps for norm in norms}
    if len(eps) != 1:
        raise ValueError(f"the decoder's input and final norms have different eps {sorted(eps)}; expected one")
    for i, (layer, norm) in enumerate(zip(layers, norms, strict=True)):
        setattr(layer, NEXT_NORM, type(norm)(int(norm.weight.shape[0]), eps=norm.eps))
        layer.last = i == len(layers) - 1
        layer.norm_kernel = norm_kernel


def with_next_norms(weights: Mapping[str, Any], prefix: str, num_layers: int) -> dict[str, Any]:
    """``weights`` (a decoder's, its layers under ``prefix + "layers."``) and,
    for each layer, the next layer's input-norm weight (the final norm's for
    the last) under the layer's ``next_input_norm`` name: the same arrays."""
    served = dict(weights)
    for i in range(num_layers):
        source = f"{prefix}layers.{i + 1}.input_layernorm.weight" if i + 1 < num_layers else f"{prefix}norm.weight"
        served[f"{prefix}layers.{i}.{NEXT_NORM}.weight"] = weights[source]
    return served


class BoundaryLayer(SharableLayer):
    """A decoder layer whose forward takes and returns a :class:`LayerInput`
    (its ``hidden_arg``-th argument), ending with :meth:`ending`. Its call
    takes MAX's plain hidden state too (the first layer's) and returns one
    after the ``last`` layer."""

    hidden_arg: ClassVar[int]
    norm_offset: ClassVar[float]
    """What the model's norms add to their weights (Gemma 3 1.0, Gemma 4 0.0)."""
    last: bool
    norm_kernel: NormKernel | bool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = args[self.hidden_arg]
        if not isinstance(hidden, LayerInput):
            first = LayerInput(hidden, self.input_layernorm(hidden))
            args = (*args[: self.hidden_arg], first, *args[self.hidden_arg + 1 :])
        residual, normed = call_forward(self, *args, **kwargs)
        return residual if self.last else LayerInput(residual, normed)

    def layer_values(self) -> dict[str, Any]:
        return self.self_attn.layer_values() | self.boundary_values()

    def boundary_values(self) -> dict[str, Tensor]:
        """:meth:`ending_values`, or inside a shared body, its arguments."""
        shared = subgraph_inputs()
        return shared if shared is not None else self.ending_values()

    def ending_values(self) -> dict[str, Tensor]:
        """Values the layer's ending makes of its weights alone, made in the
        enclosing graph (MAX makes them once at load; in a shared body, where
        weights are arguments, every step): none here, a model's layer adds its own."""
        return {}

    def norm_spec(self, norm: Module[..., Any], weight: Tensor | None = None) -> NormSpec:
        """One of the layer's norm modules as a :class:`NormSpec` (``weight``
        in place of its own, if given)."""
        return NormSpec(norm.weight if weight is None else weight, norm.eps, self.norm_offset)

    def after_attention(self, attn_out: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """``residual + post_attention_layernorm(attn_out)``, and that through
        ``pre_feedforward_layernorm`` (the MLP's input): one kernel on a GPU."""
        first, second = self.norm_spec(self.post_attention_layernorm), self.norm_spec(self.pre_feedforward_layernorm)
        return add_and_norm(attn_out, residual, first, second, kernel=self.norm_kernel)

    def ending(self, mlp_out: Tensor, h: Tensor, first: NormSpec, scale: Tensor | None = None) -> LayerInput:
        """The layer's result: ``h (* scale) + first(mlp_out)``, and that
        through the next layer's input norm."""
        next_norm = self.norm_spec(getattr(self, NEXT_NORM))
        return LayerInput(*add_and_norm(mlp_out, h, first, next_norm, kernel=self.norm_kernel, scale=scale))


def adopt(layer: Module[..., Any], cls: type[BoundaryLayer]) -> None:
    """Makes MAX's decoder ``layer`` a ``cls`` (a subclass of its class with
    our forward); its children stay as they are."""
    layer.__class__ = cls
