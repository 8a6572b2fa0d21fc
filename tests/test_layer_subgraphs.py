"""Decoder layers of one structure share one MAX subgraph (``models/common/layer_subgraphs.py``).

Which layers may share is decided from the projection plan; a wrong grouping
would run one layer's ops (a kernel choice, a dense part) on another's
weights, so grouping is pinned here. That shared layers bind their own
weights and KV-cache slot is checked end to end by the served models' tests
(``tests/test_gemma3_max.py`` compares every completion with a float32
reference; subgraphs are on by default), and on a toy stack of layers by
:func:`test_shared_layers_run_their_own_weights_and_values`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.sharding import TensorLayout
from max.experimental.tensor import Tensor, default_device

from attnquant.config import AttnQuantConfig
from attnquant.plan import PartPlan
from models.common import layer_subgraphs as ls
from models.common.attention import layer_values
from attnquant.graph.residual_norm import NormSpec
from models.common.layer_boundary import BoundaryLayer, LayerInput, hand_on_input_norms, with_next_norms

DENSE = PartPlan("dense", ("layers.0.mlp.down_proj",), (8,), 8)
NVFP4 = PartPlan("nvfp4", ("layers.0.mlp.down_proj",), (8,), 8, backend="mojo-sm90", kernel_params=(("variant", 0),))
THETA = PartPlan("theta", ("layers.0.mlp.down_proj",), (8,), 8, shared_with="layers.0.mlp.down_proj", rank=4)


def renamed(part: PartPlan, layer: int) -> PartPlan:
    return dataclasses.replace(part, members=(f"layers.{layer}.mlp.down_proj",), shared_with=part.shared_with and f"layers.{layer}.x")


class Mlp(Module[[Tensor], Tensor]):
    def __init__(self) -> None:
        super().__init__()
        self.weight = Tensor.zeros([8, 8])

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.T


class Attention(Module[[Tensor], Tensor]):
    """Adds a per-layer value that must reach a shared body as an argument,
    as the KV-cache index does in our Gemma attention."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = offset

    def layer_values(self) -> dict[str, Tensor]:
        shared = ls.subgraph_inputs()
        return shared if shared is not None else {"offset": F.constant(self.offset, DType.float32, device=CPU())}

    def forward(self, x: Tensor) -> Tensor:
        return x + self.layer_values()["offset"].to(x.device)


class Layer(ls.SharableLayer):
    """A decoder-layer stand-in: ``mlp(self_attn(x))``."""

    def __init__(self, offset: float = 0.0, attention: Module[[Tensor], Tensor] | None = None) -> None:
        super().__init__()
        self.self_attn = attention if attention is not None else Attention(offset)
        self.mlp = Mlp()

    def layer_values(self) -> dict[str, Tensor]:
        return self.self_attn.layer_values()

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.self_attn(x))


class Stack(Module[[Tensor], Tensor]):
    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def share_all(layers: list[Layer], plans: list[PartPlan], kinds: list[str]) -> ls.LayerSubgraphs:
    subgraphs = ls.LayerSubgraphs("toy", ls.choose_layer_subgraphs(True, "cpu", CPU()))
    for layer, part, kind in zip(layers, plans, kinds, strict=True):
        subgraphs.share(layer, kind, [(part,)])
    return subgraphs


def test_layers_share_a_subgraph_only_when_their_ops_match() -> None:
    with default_device(CPU()):
        layers = [Layer(float(i)) for i in range(6)]
    plans = [renamed(DENSE, 0), renamed(DENSE, 1), renamed(NVFP4, 2), renamed(NVFP4, 3), renamed(DENSE, 4), renamed(THETA, 5)]
    kinds = ["sliding", "sliding", "sliding", "sliding", "full", "sliding"]
    subgraphs = share_all(layers, plans, kinds)
    names = [getattr(layer, "subgraph_name", None) for layer in layers]
    # Names differ between layers only in the layer index: dense 0 and 1 share.
    assert names[0] == names[1] and names[2] == names[3]
    assert len({names[0], names[2], names[4]}) == 3  # another kernel, another attention kind
    assert names[5] is None  # theta: inlined
    assert subgraphs.layers["inlined"] == 1 and len(subgraphs.names) == 3


class _Accelerator:
    is_host = False


def test_subgraphs_are_shared_on_every_device_unless_told_otherwise_and_the_log_says_why(caplog) -> None:
    default = AttnQuantConfig.from_env({}).layer_subgraphs
    assert ls.choose_layer_subgraphs(True, default, _Accelerator()).enabled  # type: ignore[arg-type]
    assert ls.choose_layer_subgraphs(True, "cpu", CPU()).enabled
    off = ls.choose_layer_subgraphs(False, default, CPU())
    gpu = ls.choose_layer_subgraphs(True, "cpu", _Accelerator())  # type: ignore[arg-type]
    assert not off.enabled and not gpu.enabled and "GPU" in gpu.reason and "--no-use-subgraphs" in off.reason
    with default_device(CPU()):
        layers = [Layer(float(i)) for i in range(3)]
    subgraphs = ls.LayerSubgraphs("toy", gpu)
    for i, layer in enumerate(layers):
        subgraphs.share(layer, "sliding", [(renamed(DENSE, i),)])
    assert not any(layer.subgraph_name for layer in layers)
    with caplog.at_level("INFO"):
        subgraphs.log()
    assert f"toy: 3 decoder layers inlined ({gpu.reason})" in caplog.text


def test_kernel_choice_is_part_of_the_structure() -> None:
    other = dataclasses.replace(NVFP4, kernel_params=(("variant", 4),))
    assert ls.part_structure(renamed(NVFP4, 1)) == ls.part_structure(renamed(NVFP4, 7))
    assert ls.part_structure(other) != ls.part_structure(NVFP4)
    assert ls.part_structure(THETA) is None


def compile_recording(stack: Stack, weights: dict[str, np.ndarray]) -> tuple[str, Any]:
    """``stack`` compiled on the CPU: (the text of the graph MAX compiled, the compiled model)."""
    from max.engine import InferenceSession

    session = InferenceSession(devices=[CPU()])
    graphs: list[str] = []
    compile_graph = session.compile_reusing_mefs

    def recording(graph, *args, **kwargs):  # noqa: ANN001, ANN202
        graphs.append(str(graph))
        return compile_graph(graph, *args, **kwargs)

    session.compile_reusing_mefs = recording  # type: ignore[method-assign]
    run = stack.compile(TensorLayout(DType.float32, ["m", 8], CPU()), weights=weights, session=session)
    (text,) = graphs
    return text, run


@pytest.mark.max
def test_shared_layers_run_their_own_weights_and_values() -> None:
    """Six layers, two structures: the compiled graph calls two subgraphs six
    times (bodies live beside it in the module), and each call computes with its own layer's weight
    (bound by name prefix) and its own per-layer value (an argument)."""
    with default_device(CPU()):
        layers = [Layer(float(i)) for i in range(6)]
        stack = Stack(layers)
    share_all(layers, [renamed(DENSE, i) for i in range(6)], ["sliding"] * 5 + ["full"])
    weights = {f"layers.{i}.mlp.weight": np.eye(8, dtype=np.float32) * (i + 1) for i in range(6)}
    text, run = compile_recording(stack, weights)
    assert text.count("mo.call @") == 6
    assert text.count("mo.call @toy_sliding_layer_0") == 5 and text.count("mo.call @toy_full_layer_1") == 1
    expected = 1.0
    for i in range(6):
        expected = (expected + i) * (i + 1)  # (x + offset_i) @ ((i+1) I)
    out = np.from_dlpack(run(Tensor.ones([2, 8], device=CPU())))
    assert np.all(out == expected), (out[0, 0], expected)


class _NoRope:
    freqs_cis = None


class WeightValueAttention(Module[[Tensor], Tensor]):
    """A per-layer value made of the layer's own weight alone (as Gemma 4's
    per-head q/k/v norm weights are), through ``common.attention.layer_values``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.weight = Tensor.zeros([8])

    def layer_values(self) -> dict[str, Tensor]:
        def rows() -> Tensor:
            return F.broadcast_to(self.weight.reshape((1, 8)), (3, 8))

        return layer_values(_NoRope(), self.index, rows=rows)

    def forward(self, x: Tensor) -> Tensor:
        values = self.layer_values()
        return x + values["rows"][2].to(x.device) + values["cache_layer"].cast(DType.float32).to(x.device)


@pytest.mark.max
def test_values_made_of_weights_are_made_in_the_enclosing_graph() -> None:
    """There MAX evaluates them once at load; inside the shared body, where
    the weights are arguments, they would run every step."""
    with default_device(CPU()):
        layers = [Layer(attention=WeightValueAttention(i)) for i in range(3)]
        stack = Stack(layers)
    share_all(layers, [renamed(DENSE, i) for i in range(3)], ["sliding"] * 3)
    weights = {f"layers.{i}.mlp.weight": np.eye(8, dtype=np.float32) for i in range(3)}
    weights |= {f"layers.{i}.self_attn.weight": np.full(8, i + 1, np.float32) for i in range(3)}
    text, run = compile_recording(stack, weights)  # the text: the enclosing graph; the bodies live beside it
    assert text.count("rmo.broadcast_to") == 3 and text.count("mo.call @toy_sliding_layer_0") == 3
    assert all("!mo.tensor<[3, 8], f32>" in line for line in text.splitlines() if "mo.call @" in line)
    out = np.from_dlpack(run(Tensor.ones([1, 8], device=CPU())))
    assert np.all(out == 1 + (1 + 0) + (2 + 1) + (3 + 2)), out  # x + weight_i + cache index i, layer by layer


@pytest.mark.max
def test_eager_calls_run_the_layer_itself() -> None:
    with default_device(CPU()):
        layer = Layer(2.0)
        share_all([layer], [DENSE], ["sliding"])
        x = Tensor.ones([1, 8])
        assert float(layer(x)[0, 0].item()) == pytest.approx(0.0)  # (1 + 2) @ zeros


def test_weight_prefix_is_read_off_the_mlp() -> None:
    class Named:
        external_name = "language_model.layers.3.mlp.weight"

    class Fake:
        class mlp:  # noqa: N801
            parameters = [("weight", Named())]

    assert ls.weight_prefix(Fake()) == "language_model.layers.3."
    Named.external_name = "rope.weight"
    with pytest.raises(ValueError, match="not '<prefix>mlp.weight'"):
        ls.weight_prefix(Fake())


class Norm(Module[[Tensor], Tensor]):
    def __init__(self, dim: int = 8, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = Tensor.zeros([dim])

    def forward(self, x: Tensor) -> Tensor:
        return NormSpec(self.weight, self.eps, offset=1.0)(x)


class BoundaryToy(BoundaryLayer):
    """A decoder-layer stand-in ending with the next layer's input norm:
    ``h + post_norm(mlp(self_attn(norm(h))))``."""

    hidden_arg = 0
    norm_offset = 1.0

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.input_layernorm = Norm()
        self.post_feedforward_layernorm = Norm()
        self.self_attn = Attention(offset)
        self.mlp = Mlp()

    def forward(self, x: LayerInput) -> LayerInput:  # type: ignore[override]
        residual, normed = x
        mlp_out = self.mlp(self.self_attn(normed))
        return self.ending(mlp_out, residual, self.norm_spec(self.post_feedforward_layernorm))


class NormedStack(Stack):
    def __init__(self, layers: list[Layer]) -> None:
        super().__init__(layers)
        self.norm = Norm()


@pytest.mark.max
def test_layers_hand_on_the_next_layers_normed_input() -> None:
    """Three layers, two shared and one inlined: each shared body takes and
    returns the residual and its normed twin, the stack's result is the
    plain residual, and every layer's input is normalized with that layer's
    input-norm weight (by the layer before it, under its own name)."""
    rng = np.random.default_rng(0)
    with default_device(CPU()):
        layers = [BoundaryToy(float(i)) for i in range(3)]
        stack = NormedStack(layers)
        hand_on_input_norms(layers, stack.norm, norm_kernel=False)
    share_all(layers, [renamed(DENSE, 0), renamed(DENSE, 1), renamed(THETA, 2)], ["sliding"] * 3)
    mlp = [rng.standard_normal((8, 8)).astype(np.float32) / 4 for _ in range(3)]
    norm = [rng.standard_normal(8).astype(np.float32) / 4 for _ in range(4)]
    post = [rng.standard_normal(8).astype(np.float32) / 4 for _ in range(3)]
    weights = {f"layers.{i}.mlp.weight": mlp[i] for i in range(3)}
    weights |= {f"layers.{i}.input_layernorm.weight": norm[i] for i in range(3)} | {"norm.weight": norm[3]}
    weights |= {f"layers.{i}.post_feedforward_layernorm.weight": post[i] for i in range(3)}
    text, run = compile_recording(stack, with_next_norms(weights, "", 3))
    calls = [line for line in text.splitlines() if "mo.call @toy_sliding_layer_0" in line]
    assert len(calls) == 2 and all(line.count("!mo.tensor<[m, 8], f32>") >= 4 for line in calls), calls
    x = rng.standard_normal((2, 8)).astype(np.float32)
    h = x.astype(np.float64)
    def rms_norm(v: np.ndarray, w: np.ndarray) -> np.ndarray:
        return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + 1e-6) * (1 + w)

    for i in range(3):
        h = h + rms_norm((rms_norm(h, norm[i]) + i) @ mlp[i].T, post[i])
    out = np.from_dlpack(run(Tensor.from_dlpack(x)))
    np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-5)
