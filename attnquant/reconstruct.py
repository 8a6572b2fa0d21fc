"""From theta back to served weights: W_eff, and the precompute-outside step.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from attnquant import nvfp4
from attnquant.config import AttnQuantConfig
from attnquant.prepare_device import CPU
from attnquant.projections import ProjectionKey, find_projections, is_ignored
from attnquant.runtime_layout import group_name
from attnquant.theta import ThetaBundle, build_theta


def effective_weight(
    w0: torch.Tensor, s: torch.Tensor, u: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """s[:, None] * W0 + U @ V.T, accumulated in float32, returned as ``out_dtype``.

    With W0 = W, s = 1 and no residual (passthrough) it returns W bit-for-bit:
    scaling by 1.0 is exact, and a rank-0 residual is not added at all, so
    not even the sign of a zero can change.
    """
    n, k = w0.shape
    assert s.shape == (n,), f"scale {tuple(s.shape)} does not match W0 {(n, k)}"
    assert (
        u.shape[0] == n and v.shape[0] == k and u.shape[1] == v.shape[1]
    ), f"residual u {tuple(u.shape)} / v {tuple(v.shape)} does not match W0 {(n, k)}"
    weight = w0.float() * s.float().unsqueeze(1)
    if u.shape[1]:
        weight.addmm_(u.float(), v.float().T)
    return weight.to(out_dtype)


def relative_error(weight: torch.Tensor, approximation: torch.Tensor) -> float:
    """|W - A|_F / |W|_F (0 when both are zero)."""
    error2, norm2 = _squared_error_terms(weight, approximation)
    return math.sqrt(error2 / norm2) if norm2 else (0.0 if error2 == 0 else math.inf)


def _squared_error_terms(weight: torch.Tensor, approximation: torch.Tensor) -> tuple[float, float]:
    """(|W - A|_F^2, |W|_F^2), reduced in float32."""
    if approximation is weight:
        return 0.0, _squared_norm(weight)
    return _squared_norm(weight.float() - approximation.float()), _squared_norm(weight)


def _squared_norm(tensor: torch.Tensor) -> float:
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).item() ** 2


@dataclass(frozen=True)
class PrecomputeReport:
    """What :func:`precompute_outside` did, for logs and the CLI."""

    path: str
    projections_total: int
    projections_quantized: int
    ignored_modules: tuple[str, ...]
    projection_bytes_before: int
    projection_bytes_after: int
    state_dict_bytes_before: int
    state_dict_bytes_after: int
    layer_errors: dict[int, float] = field(repr=False)
    """Per decoder layer: relative Frobenius error of its projections' W_eff."""

    @property
    def projections_ignored(self) -> int:
        return len(self.ignored_modules)

    @property
    def theta_error_max(self) -> float:
        return max(self.layer_errors.values(), default=0.0)

    @property
    def theta_error_mean(self) -> float:
        return (
            sum(self.layer_errors.values()) / len(self.layer_errors) if self.layer_errors else 0.0
        )

    def summary_line(self) -> str:
        return (
            f"attnquant: {self.path}: {self.projections_quantized}/{self.projections_total} "
            f"projections quantized ({self.projections_ignored} ignored), projection bytes "
            f"{_gib(self.projection_bytes_before)} -> {_gib(self.projection_bytes_after)}, "
            f"state dict {_gib(self.state_dict_bytes_before)} -> "
            f"{_gib(self.state_dict_bytes_after)}, theta error max "
            f"{self.theta_error_max:.3g} mean {self.theta_error_mean:.3g}"
        )


@dataclass(frozen=True)
class PrecomputeResult:
    """The served state dict and what it took to make it."""

    state_dict: dict[str, torch.Tensor]
    report: PrecomputeReport


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


def precompute_outside(
    state_dict: Mapping[str, torch.Tensor],
    config: AttnQuantConfig,
    *,
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
    come back to the host.

    Raises:
        ValueError: for a state dict without projections, a bad G or R, or a
            projection NVFP4 cannot encode (its name is in the message).
    """
    keys = find_projections(state_dict)
    num_layers = num_layers_of(keys)
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
            error2, norm2 = _squared_error_terms(originals[key], w_eff)
            error2_of_layer[key.layer] += error2
            norm2_of_layer[key.layer] += norm2
            out = _nvfp4_tensors(key, w_eff, config, amax) if key in quantized else {key.weight_name: w_eff}
            replacements[key.weight_name] = {name: t.to(CPU) for name, t in out.items()}
            bar.update()
    bar.close()
    shared_w0.cache_clear()

    served = {}
    for name, tensor in state_dict.items():
        served |= replacements.get(name, {name: tensor})
    report = PrecomputeReport(
        path=_describe_path(config, theta),
        projections_total=len(keys),
        projections_quantized=len(quantized),
        ignored_modules=ignored,
        projection_bytes_before=sum(_nbytes(w) for w in weights.values()),
        projection_bytes_after=sum(_nbytes(t) for r in replacements.values() for t in r.values()),
        state_dict_bytes_before=sum(_nbytes(t) for t in state_dict.values()),
        state_dict_bytes_after=sum(_nbytes(t) for t in served.values()),
        layer_errors={
            layer: math.sqrt(error2_of_layer[layer] / norm2) if norm2 else 0.0
            for layer, norm2 in sorted(norm2_of_layer.items())
        },
    )
    return PrecomputeResult(served, report)


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


def fusion_groups(keys: list[ProjectionKey]) -> list[list[ProjectionKey]]:
    """``keys`` (in order) split into the groups the run-time layout fuses:
    one layer's q/k/v, its gate/up, and every other projection alone."""
    groups: dict[tuple[str, int, str], list[ProjectionKey]] = {}
    for key in keys:
        groups.setdefault((key.prefix, key.layer, group_name(key.proj)), []).append(key)
    return list(groups.values())


def _shared_amax(w_effs: list[torch.Tensor]) -> float | None:
    return max(w.abs().max().float().item() for w in w_effs) if w_effs else None


def _nvfp4_tensors(
    key: ProjectionKey, w_eff: torch.Tensor, config: AttnQuantConfig, amax: float | None
) -> dict[str, torch.Tensor]:
    q = nvfp4.quantize(
        w_eff, scale_policy=nvfp4.ScalePolicy(config.scale_search), name=key.weight_name, amax=amax
    )
    module = key.module_name
    return {
        f"{module}.weight": q.packed,
        f"{module}.weight_scale": q.block_scales,
        f"{module}.weight_scale_2": q.global_scale,
        f"{module}.input_scale": torch.ones((), dtype=torch.float32, device=w_eff.device),
    }


def _describe_path(config: AttnQuantConfig, theta: ThetaBundle) -> str:
    passthrough = theta.blocks == theta.num_layers
    bands = f"G={theta.blocks}/{theta.num_layers} layers" + (
        " (passthrough)" if passthrough else f", R={theta.rank}"
    )
    target = f"nvfp4 ({config.scale_search})" if config.quant == "nvfp4" else "checkpoint dtype"
    return f"precompute-outside, theta {bands} -> {target}"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
