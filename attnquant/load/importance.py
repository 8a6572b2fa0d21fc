"""How much each input column of each projection matters, from the checkpoint alone.

The weighted NVFP4 scale search (``ATTNQUANT_SCALE_SEARCH=weighted``) weighs
a block's squared error per input column by an estimate of that input's
second moment E[x_k^2]: an error on a column that carries large inputs moves
the output more. No calibration data: the estimate follows the residual
stream through Gemma's sandwich norms.

* The embedding output has channel second moments ``hidden * mean_v E[v, k]^2``
  (Gemma scales embeddings by sqrt(hidden)).
* Every residual update is an RMSNorm output (unit mean square over the
  channels) times its gain, so with independent signs each layer adds
  ``gain_post_attention^2`` and then ``gain_post_feedforward^2`` to the
  stream's channel second moments (times Gemma 4's ``layer_scalar^2`` after
  the layer).
* q/k/v read ``input_layernorm``'s output: ``gain^2 * var_k / mean(var)``;
  gate/up the same with ``pre_feedforward_layernorm``.
* o_proj reads the attention output, whose column (head h, dim d) has the
  second moment of v_d: ``sum_k W_v[d, k]^2 imp_qkv[k]`` (k_proj where the
  layer shares k and v).
* down_proj reads gelu_tanh(gate) * up: ``E[gelu_tanh(g)^2] * E[u^2]`` with g
  and u Gaussian of those second moments.
* The output head reads the final norm's output.

A norm's gain is ``1 + w`` in Gemma 3 and ``w`` in Gemma 4
(:class:`ResidualStream`). The estimates are raised to the power
:data:`POWER`: the proxy understates the spread between channels, and 1.5
gave the lowest KL of {0.5, 1, 1.5, 2} on the real Gemma 3 270M
(docs/quality.md). Weighting by the norm gains alone is much worse than
no weighting: Gemma's gains compensate the stream's channel scales.

Everything is computed on the host CPU in float64 and rounded to float32, so
a load that quantizes on a GPU searches with the same weights as one on the
CPU.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnquant.config import LOGGER_NAME, AttnQuantConfig
from attnquant.formats.names import LAYER_NORMS, ProjectionKey

logger = logging.getLogger(LOGGER_NAME)

POWER = 1.5
_HERMITE_NODES = 64  # Gauss-Hermite points for E[gelu_tanh(g)^2]; exact to ~1e-12 here


@dataclass(frozen=True)
class ResidualStream:
    """What the estimate needs to know about an architecture's residual stream.

    Attributes:
        norm_offset: a norm's gain is ``norm_offset + w`` (1 in Gemma 3, 0 in Gemma 4).
    """

    norm_offset: float


GEMMA3 = ResidualStream(norm_offset=1.0)
GEMMA4 = ResidualStream(norm_offset=0.0)
_BY_MODEL_TYPE = {"gemma3": GEMMA3, "gemma4": GEMMA4}


def for_checkpoint_config(config: Mapping[str, object]) -> ResidualStream | None:
    """The stream of a checkpoint's config.json (its ``model_type``: ``gemma3``,
    ``gemma3_text``, ``gemma4`` ...), or None for another model."""
    return _BY_MODEL_TYPE.get(str(config.get("model_type", "")).removesuffix("_text"))


def projection_importances(
    tensors: Mapping[str, torch.Tensor],
    keys: Sequence[ProjectionKey],
    stream: ResidualStream,
    *,
    embedding: str,
    head: str | None = None,
) -> dict[str, torch.Tensor]:
    """Weight name -> float32 [K] importance, for every projection in ``keys``
    (and the output head's weight name ``head``, when given).

    Raises:
        KeyError: a tensor the estimate reads is missing (callers fall back
            to equal weights and say so).
    """
    prefix = keys[0].prefix
    layers = sorted({key.layer for key in keys})
    by_layer: dict[int, dict[str, ProjectionKey]] = {}
    for key in keys:
        by_layer.setdefault(key.layer, {})[key.proj] = key
    var = _exact_column_sum_squares(tensors[embedding]) * tensors[embedding].shape[1]
    var /= tensors[embedding].shape[0]
    out: dict[str, torch.Tensor] = {}
    for layer in layers:
        norm = {name: _gain(tensors, f"{_layer_path(prefix, layer)}.{name}.weight", stream) for name in LAYER_NORMS}
        before_attention = var
        var = var + norm["post_attention_layernorm"]
        before_mlp = var
        var = var + norm["post_feedforward_layernorm"]
        scalar = tensors.get(f"{_layer_path(prefix, layer)}.layer_scalar")
        if scalar is not None:
            var = var * float(scalar.double().reshape(-1)[0]) ** 2
        out |= _layer_importances(
            tensors, by_layer[layer], norm["input_layernorm"] * before_attention / before_attention.mean(),
            norm["pre_feedforward_layernorm"] * before_mlp / before_mlp.mean(),
        )  # fmt: skip
    if head is not None:
        final = _gain(tensors, f"{prefix}.norm.weight" if prefix else "norm.weight", stream)
        out[head] = final * var / var.mean()
    return {name: imp.pow(POWER).to(torch.float32) for name, imp in out.items()}


def for_quantization(
    tensors: Mapping[str, torch.Tensor],
    keys: Sequence[ProjectionKey],
    config: AttnQuantConfig,
    stream: ResidualStream | None,
    *,
    embedding: str | None = None,
    head: str | None = None,
) -> dict[str, torch.Tensor]:
    """The importances a load with ``config`` quantizes with: empty unless the
    weighted scale search quantizes something; empty too (logged: the search
    then weighs every column equally) when the stream is unknown or a tensor
    the estimate reads is missing. ``embedding``: the embedding's name
    (default: beside the layers); ``head``: the output head's weight name when
    it is quantized."""
    if config.scale_search != "weighted" or (config.quant != "nvfp4" and head is None) or not keys:
        return {}
    embedding = embedding or f"{keys[0].prefix}.embed_tokens.weight".lstrip(".")
    if stream is None:
        logger.info("attnquant: no importance estimate for this model; the weighted scale search weighs columns equally")
        return {}
    try:
        return projection_importances(tensors, keys, stream, embedding=embedding, head=head)
    except KeyError as missing:
        logger.warning(
            "attnquant: the importance estimate needs %s, which the checkpoint lacks; "
            "the weighted scale search weighs columns equally", missing,
        )  # fmt: skip
        return {}


def _layer_path(prefix: str, layer: int) -> str:
    return f"{prefix}.layers.{layer}" if prefix else f"layers.{layer}"


def _gain(tensors: Mapping[str, torch.Tensor], name: str, stream: ResidualStream) -> torch.Tensor:
    """float64 [hidden]: the squared gain of the norm ``name``."""
    return (tensors[name].to("cpu", torch.float64) + stream.norm_offset).square()


def _layer_importances(
    tensors: Mapping[str, torch.Tensor],
    projections: Mapping[str, ProjectionKey],
    attention_input: torch.Tensor,
    mlp_input: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """float64 [K] per projection of one layer, from its two normed inputs' second moments."""
    names = {proj: key.weight_name for proj, key in projections.items()}
    out = {names[p]: attention_input for p in ("q_proj", "k_proj", "v_proj") if p in names}
    out |= {names[p]: mlp_input for p in ("gate_proj", "up_proj") if p in names}
    if "o_proj" in names:
        # Without v_proj the layer's values are its keys (Gemma 4's attention_k_eq_v).
        values = tensors[names.get("v_proj", names["k_proj"])]
        per_value_dim = _weighted_row_sum_squares(values, attention_input)  # [kv_heads * head_dim]
        # k_norm normalizes each head: its width is head_dim. Query head h
        # reads KV head h // group; its output columns are h * head_dim + d.
        head_dim = tensors[names["k_proj"].replace("k_proj.weight", "k_norm.weight")].shape[0]
        kv_heads = per_value_dim.numel() // head_dim
        group = tensors[names["o_proj"]].shape[1] // (kv_heads * head_dim)
        out[names["o_proj"]] = per_value_dim.view(kv_heads, head_dim).repeat_interleave(group, dim=0).reshape(-1)
    if "down_proj" in names and "gate_proj" in names and "up_proj" in names:
        gate = _weighted_row_sum_squares(tensors[names["gate_proj"]], mlp_input)
        up = _weighted_row_sum_squares(tensors[names["up_proj"]], mlp_input)
        out[names["down_proj"]] = _gelu_tanh_second_moment(gate.sqrt()) * up
    return out


def _weighted_row_sum_squares(weight: torch.Tensor, column_weights: torch.Tensor) -> torch.Tensor:
    """float64 [N]: sum_k W[n, k]^2 * c[k] (the second moment of W x for
    independent inputs of second moments c)."""
    w = weight.to("cpu", torch.float64)
    return w.square_() @ column_weights


def _exact_column_sum_squares(weight: torch.Tensor) -> torch.Tensor:
    """float64 [K]: sum_n W[n, k]^2 over a (large) embedding, in chunks."""
    total = torch.zeros(weight.shape[1], dtype=torch.float64)
    step = max(1, (1 << 22) // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], step):
        total += weight[start : start + step].to("cpu", torch.float64).square().sum(0)
    return total


def _gelu_tanh_second_moment(sigma: torch.Tensor) -> torch.Tensor:
    """float64: E[gelu_tanh(g)^2] for g ~ N(0, sigma^2), per element (Gauss-Hermite)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(_HERMITE_NODES)
    z = torch.from_numpy(nodes)
    w = torch.from_numpy(weights) / math.sqrt(2 * math.pi)
    g = torch.nn.functional.gelu(sigma.to(torch.float64).unsqueeze(-1) * z, approximate="tanh")
    return (g.square() * w).sum(-1)
