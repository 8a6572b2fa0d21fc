"""The precompute-outside step: from theta back to served weights.

:func:`precompute_outside` turns a checkpoint's state dict into the one the
model serves: every projection weight replaced by its theta reconstruction
W_eff, and with ``ATTNQUANT_QUANT=nvfp4`` by ModelOpt-layout NVFP4 tensors::

    X.weight          uint8 [N, K/2]          packed E2M1 codes
    X.weight_scale    float8_e4m3fn [N, K/16] block scales
    X.weight_scale_2  float32 []              global scale
    X.input_scale     float32 [] = 1.0        (weight-only: activations stay
                                               in the checkpoint dtype)
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from attnquant.config import AttnQuantConfig
from attnquant.formats import nvfp4
from attnquant.formats.names import (
    PROJECTIONS,
    PROJECTIONS_BY_BLOCK,
    ProjectionKey,
    find_projections,
    group_name,
    is_ignored,
    unmatched_fragments,
)
from attnquant.formats.theta import ThetaBundle, build_theta, effective_weight, squared_error_terms
from attnquant.load.head import OutputHead
from attnquant.load.prepare_device import CPU


@dataclass(frozen=True)
class PrecomputeResult:
    """The served state dict and what went into it."""

    state_dict: dict[str, torch.Tensor]
    quantized_modules: tuple[str, ...]
    """Projections served as NVFP4."""
    ignored_modules: tuple[str, ...]
    """Projections ``ATTNQUANT_QUANT_IGNORE`` kept in the checkpoint dtype."""
    layer_errors: dict[int, float] = field(repr=False)
    """Per decoder layer: relative Frobenius error of its projections' W_eff
    against the checkpoint's weights (0 at passthrough)."""


def num_layers_of(keys: list[ProjectionKey]) -> int:
    """L from the projection keys; every layer 0..L-1 must have one.

    Raises:
        ValueError: when there are no projections or a layer has none.
    """
    if not keys:
        raise ValueError(
            "no projection weights found (expected names like "
            "model.layers.0.self_attn.q_proj.weight); is this a Gemma text checkpoint?"
        )
    present = {key.layer for key in keys}
    missing = sorted(set(range(max(present) + 1)) - present)
    if missing:
        raise ValueError(
            f"decoder layers {missing} have no projection weights; checkpoint incomplete?"
        )
    return max(present) + 1


def check_ignore_fragments(config: AttnQuantConfig, keys: Sequence[ProjectionKey]) -> None:
    """Refuses ``ATTNQUANT_QUANT_IGNORE`` fragments that match no projection:
    a misspelled one would quantize everything without a word.

    Raises:
        ValueError: listing the fragments that match nothing and the ones this checkpoint has.
    """
    if config.quant != "nvfp4" or not config.quant_ignore:
        return
    unmatched = unmatched_fragments(config.quant_ignore, [key.module_name for key in keys])
    if unmatched:
        blocks = [block for block in PROJECTIONS_BY_BLOCK if any(key.block == block for key in keys)]
        projs = [proj for proj in PROJECTIONS if any(key.proj == proj for key in keys)]
        layers = sorted({key.layer for key in keys})
        raise ValueError(
            f"ATTNQUANT_QUANT_IGNORE={','.join(config.quant_ignore)}: {', '.join(unmatched)} matches no "
            f"projection of this checkpoint. A fragment is a run of whole name components: "
            f"{', '.join(blocks)}, {', '.join(projs)}, layers.{layers[0]} ... layers.{layers[-1]}, "
            f"or dotted runs of them (layers.3.mlp, self_attn.o_proj)"
        )


def precompute_outside(
    state_dict: Mapping[str, torch.Tensor],
    config: AttnQuantConfig,
    *,
    keys: Sequence[ProjectionKey] | None = None,
    head: OutputHead | None = None,
    importance: Mapping[str, torch.Tensor] | None = None,
    progress: bool = True,
    device: torch.device = CPU,
) -> PrecomputeResult:
    """The served state dict: W_eff for every projection, NVFP4 if configured.

    Non-projection tensors are passed through as the same objects, and so is
    every projection that is passthrough (G = L) and stays unquantized.
    Projections are handled one fused group at a time, so beyond the input and
    the output the working memory is about one group's float32 temporaries
    (plus the band means W0 when G < L). ``device``: where W_eff and the
    quantization are computed (the theta fit stays on the host); the results
    come back to the host. ``keys``: the state dict's projections, when the
    caller has found them already. ``head``: where the model's output head
    is; with ``ATTNQUANT_LM_HEAD=nvfp4`` it is quantized too (its own global
    scale), and the served state dict holds it under the head's name.
    ``importance``: weight name -> the weighted scale search's column weights
    (``attnquant.load.importance.for_quantization``; a name without one: equal weights).

    Raises:
        ValueError: for a state dict without projections, a bad G or R, or a
            projection NVFP4 cannot encode (its name is in the message).
    """
    keys = find_projections(state_dict) if keys is None else list(keys)
    num_layers = num_layers_of(keys)
    check_ignore_fragments(config, keys)
    weights = {key: state_dict[key.weight_name] for key in keys}
    theta = build_theta(
        weights, blocks=config.blocks, rank=config.rank, num_layers=num_layers, progress=progress
    )

    quantized = {
        key
        for key in keys
        if config.quant == "nvfp4" and not is_ignored(key.module_name, config.quant_ignore)
    }
    ignored = tuple(key.module_name for key in keys if config.quant == "nvfp4" and key not in quantized)
    importance = importance or {}
    replacements: dict[str, dict[str, torch.Tensor]] = {}
    error2_of_layer: dict[int, float] = defaultdict(float)
    norm2_of_layer: dict[int, float] = defaultdict(float)
    bar = tqdm(total=len(keys), desc="attnquant projections", disable=not progress)
    # Each band's W0 goes to ``device`` once, not once per layer of the band:
    # groups walk the layers in order, so one layer's families are the working set.
    families = len({key.family for key in keys})
    shared_w0 = functools.lru_cache(maxsize=families)(lambda group: theta.shared[group].to(device))
    for group in fusion_groups(keys):
        # A passthrough projection that stays unquantized is served as is (no copy).
        originals = {
            key: weights[key] if _unchanged(theta, key, quantized) else weights[key].to(device)
            for key in group
        }
        w_effs = {key: _served_weight(theta, key, originals[key], shared_w0) for key in group}
        # One global scale for the NVFP4 members of a fused group (ModelOpt's
        # convention): the fused matmul then needs no per-row rescale.
        amax = _shared_amax([w for key, w in w_effs.items() if key in quantized])
        for key, w_eff in w_effs.items():
            error2, norm2 = squared_error_terms(originals[key], w_eff)
            error2_of_layer[key.layer] += error2
            norm2_of_layer[key.layer] += norm2
            out = (
                quantized_tensors(key.module_name, w_eff, config, amax, importance.get(key.weight_name))
                if key in quantized else {key.weight_name: w_eff}
            )  # fmt: skip
            replacements[key.weight_name] = {name: t.to(CPU) for name, t in out.items()}
            bar.update()
    bar.close()
    shared_w0.cache_clear()

    served = {}
    for name, tensor in state_dict.items():
        served |= replacements.get(name, {name: tensor})
    if head is not None and config.lm_head == "nvfp4":
        # The packed copy replaces an untied head's weight; a tied embedding
        # stays, for the token lookup.
        packed = quantized_tensors(
            head.group, head.source(state_dict).to(device), config, importance=importance.get(head.weight_name)
        )
        served.pop(head.weight_name, None)
        served.update({name: t.to(CPU) for name, t in packed.items()})
    layer_errors = {
        layer: math.sqrt(error2_of_layer[layer] / norm2) if norm2 else 0.0
        for layer, norm2 in sorted(norm2_of_layer.items())
    }
    quantized_modules = tuple(key.module_name for key in keys if key in quantized)
    return PrecomputeResult(served, quantized_modules, ignored, layer_errors)


def _unchanged(theta: ThetaBundle, key: ProjectionKey, quantized: set[ProjectionKey]) -> bool:
    return key not in quantized and theta.is_passthrough((key.family, key.layer))


def _served_weight(
    theta: ThetaBundle,
    key: ProjectionKey,
    weight: torch.Tensor,
    shared_w0: Callable[[str], torch.Tensor],
) -> torch.Tensor:
    """W_eff on ``weight``'s device; ``shared_w0(group)``: that band's W0 there."""
    layer_id = (key.family, key.layer)
    if theta.is_passthrough(layer_id):
        # effective_weight would return an identical copy; skip the copy.
        return weight
    layer = theta.layers[layer_id]
    factors = (layer.scale, layer.u, layer.v)
    return effective_weight(shared_w0(layer.group), *(t.to(weight.device) for t in factors), weight.dtype)


def fusion_groups(keys: Sequence[ProjectionKey]) -> list[list[ProjectionKey]]:
    """``keys`` (in order) split into the groups the run-time layout fuses:
    one layer's q/k/v, its gate/up, and every other projection alone."""
    groups: dict[tuple[str, int, str], list[ProjectionKey]] = {}
    for key in keys:
        groups.setdefault((key.prefix, key.layer, group_name(key.proj)), []).append(key)
    return list(groups.values())


def _shared_amax(w_effs: list[torch.Tensor]) -> float | None:
    return max(w.abs().max().float().item() for w in w_effs) if w_effs else None


def quantized_tensors(
    module: str,
    weight: torch.Tensor,
    config: AttnQuantConfig,
    amax: float | None = None,
    importance: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``module``'s ModelOpt NVFP4 tensors for ``weight``, with the configured
    scale selection (``amax``: a global scale shared with fused neighbours;
    ``importance``: the weighted search's column weights)."""
    policy = nvfp4.ScalePolicy(config.scale_search)
    q = nvfp4.quantize(
        weight, scale_policy=policy, name=f"{module}.weight", amax=amax,
        importance=importance.to(weight.device) if importance is not None else None,
    )  # fmt: skip
    return {
        f"{module}.weight": q.packed,
        f"{module}.weight_scale": q.block_scales,
        f"{module}.weight_scale_2": q.global_scale,
        f"{module}.input_scale": torch.ones((), dtype=torch.float32, device=weight.device),
    }
