"""Theta bundles: a low-parameter description of every projection weight.

For each projection family (q, k, v, o, gate, up, down) the L decoder layers
split into G contiguous, equal bands. Within a band, layers whose weights have
the same shape share one block W0 (their mean). Each layer then keeps

* ``scale``: a per-row factor s, the least-squares fit of W onto W0, and
* ``u``, ``v``: a rank-R residual, the truncated SVD of W - s*W0 (``u``
  carries the singular values),

so that ``W ~ s*W0 + u @ v.T`` (see :func:`effective_weight`).
It is analytic and one pass: no data, no training.

A group of one layer (always the case when G == L) is stored as
W0 = W, s = 1 and no residual, which reconstructs W bit-for-bit.

Storage choices: W0 is kept in the checkpoint dtype. It is the only theta
tensor as large as a weight, and in the checkpoint dtype a one-layer group's
W0 *is* that layer's weight (passthrough is exact and costs no memory). The
fit of s and the residual are made against the W0 actually stored, so its
rounding costs nothing beyond the rank truncation. s, u and v stay float32:
together they are ~R/min(N, K) of a weight.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from attnquant.formats.names import FAMILIES, ProjectionKey

# Randomized SVD settings (Halko, Martinsson & Tropp 2011): an oversampled
# sketch and two power iterations give near-optimal rank-R residuals at
# O(N*K*R) cost; a full SVD of a 21504 x 5376 residual would take minutes.
_SVD_OVERSAMPLE = 8
_SVD_POWER_ITERATIONS = 2
_SVD_SEED = 0  # fixed: the same checkpoint and config give the same bundle

LayerId = tuple[str, int]
"""(family, layer), e.g. ("q", 3)."""


@dataclass(frozen=True)
class LayerTheta:
    """One layer's part of a family: W ~ scale[:, None] * W0[group] + u @ v.T.

    Attributes:
        group: name of the shared block W0 this layer uses.
        scale: float32 [N]; exactly 1.0 for a one-layer group.
        u: float32 [N, r], the singular values folded in (r may be 0).
        v: float32 [K, r].
    """

    group: str
    scale: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor

    def __post_init__(self) -> None:
        if (
            self.u.dim() != 2
            or self.v.dim() != 2
            or self.scale.shape != (self.u.shape[0],)
            or self.u.shape[1] != self.v.shape[1]
        ):
            raise ValueError(
                f"inconsistent theta for group {self.group!r}: scale "
                f"{tuple(self.scale.shape)}, u {tuple(self.u.shape)}, v {tuple(self.v.shape)} "
                f"(want [N], [N, r], [K, r])"
            )
        assert self.scale.dtype == self.u.dtype == self.v.dtype == torch.float32

    @property
    def rank(self) -> int:
        return self.u.shape[1]


@dataclass(frozen=True)
class ThetaBundle:
    """Every projection's theta, plus what it was built from.

    Attributes:
        blocks: G, the number of bands per family.
        rank: R, the requested residual rank (a layer's may be lower when
            min(N, K) < R, or 0 in a one-layer group).
        num_layers: L.
        shared: group name -> W0, in the checkpoint dtype.
        layers: (family, layer) -> that layer's theta.
    """

    blocks: int
    rank: int
    num_layers: int
    shared: dict[str, torch.Tensor]
    layers: dict[LayerId, LayerTheta]

    def is_passthrough(self, layer_id: LayerId) -> bool:
        """Whether this layer reconstructs as its own weight, bit-for-bit."""
        return self.layers[layer_id].group == _passthrough_group(*layer_id)


def band_size(num_layers: int, blocks: int) -> int:
    """Layers per band for G = ``blocks``.

    Raises:
        ValueError: unless 1 <= G <= L and G divides L.
    """
    if not 1 <= blocks <= num_layers or num_layers % blocks:
        divisors = [g for g in range(1, num_layers + 1) if num_layers % g == 0]
        raise ValueError(
            f"ATTNQUANT_BLOCKS={blocks} cannot split {num_layers} layers into equal "
            f"contiguous bands; allowed values for this model: {divisors}"
        )
    return num_layers // blocks


def build_theta(
    weights: Mapping[ProjectionKey, torch.Tensor],
    *,
    blocks: int | None,
    rank: int,
    num_layers: int,
    progress: bool = False,
) -> ThetaBundle:
    """Decomposes projection weights into a theta bundle.

    Args:
        weights: every projection to describe, by key (layers may lack some
            families, e.g. Gemma 4 layers without v_proj).
        blocks: G; None means L (passthrough).
        rank: R >= 0.
        num_layers: L; every key's layer must be below it.
        progress: show a tqdm bar over the non-passthrough groups.

    Raises:
        ValueError: for a G that does not split L evenly, R < 0, a layer
            index outside [0, L), or a weight that is not a 2-D float tensor.
    """
    blocks = num_layers if blocks is None else blocks
    per_band = band_size(num_layers, blocks)
    if rank < 0:
        raise ValueError(f"ATTNQUANT_RANK={rank} must be >= 0")
    for key, weight in weights.items():
        if not 0 <= key.layer < num_layers:
            raise ValueError(f"{key.weight_name}: layer {key.layer} outside 0..{num_layers - 1}")
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"{key.weight_name} must be a 2-D floating-point weight, got "
                f"{weight.dtype} {tuple(weight.shape)}"
            )

    shared: dict[str, torch.Tensor] = {}
    layers: dict[LayerId, LayerTheta] = {}
    groups = _groups(weights, per_band)
    for key in (members[0] for members in groups.values() if len(members) == 1):
        theta = _passthrough_theta(key, weights[key])
        shared[theta.group] = weights[key]
        layers[(key.family, key.layer)] = theta
    shared_groups = {name: members for name, members in groups.items() if len(members) > 1}
    for name, members in tqdm(shared_groups.items(), desc="attnquant theta", disable=not progress):
        w0 = _mean(weights[key] for key in members).to(weights[members[0]].dtype)
        shared[name] = w0
        for key in members:
            layers[(key.family, key.layer)] = _fit_layer(name, weights[key], w0, rank)
    return ThetaBundle(blocks, rank, num_layers, shared, layers)


def _groups(
    weights: Mapping[ProjectionKey, torch.Tensor], per_band: int
) -> dict[str, list[ProjectionKey]]:
    """Group name -> its layers: same family, same band, same weight shape."""
    groups: dict[str, list[ProjectionKey]] = defaultdict(list)
    for key in sorted(weights, key=lambda k: (FAMILIES.index(k.family), k.layer)):
        rows, cols = weights[key].shape
        groups[f"{key.family}.band{key.layer // per_band}.{rows}x{cols}"].append(key)
    return groups


def _passthrough_group(family: str, layer: int) -> str:
    return f"{family}.layer{layer}"


def _passthrough_theta(key: ProjectionKey, weight: torch.Tensor) -> LayerTheta:
    """W0 = W, s = 1, no residual: reconstructs W exactly, by construction."""
    rows, cols = weight.shape
    return LayerTheta(
        _passthrough_group(key.family, key.layer),
        torch.ones(rows, device=weight.device),
        torch.zeros(rows, 0, device=weight.device),
        torch.zeros(cols, 0, device=weight.device),
    )


def _mean(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """float32 mean, accumulated one tensor at a time."""
    total, count = None, 0
    for tensor in tensors:
        total = tensor.float().clone() if total is None else total.add_(tensor.float())
        count += 1
    assert total is not None
    return total.div_(count)


def _fit_layer(group: str, weight: torch.Tensor, w0: torch.Tensor, rank: int) -> LayerTheta:
    """Per-row least-squares scale onto W0, then a rank-R SVD of the rest."""
    assert weight.shape == w0.shape
    w, base = weight.float(), w0.float()
    base_norm2 = base.square().sum(1)
    # s_r = <W_r, W0_r> / |W0_r|^2; a zero row of W0 leaves s free: take 1.
    scale = torch.where(base_norm2 > 0, (w * base).sum(1) / base_norm2, 1.0)
    residual = w - scale.unsqueeze(1) * base
    u, v = truncated_svd(residual, rank)
    return LayerTheta(group, scale, u, v)


def truncated_svd(matrix: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U*sigma [N, r], V [K, r]) of the best rank-r approximation, r = min(rank, N, K).

    Exact SVD when the sketch would not be smaller than the matrix, else a
    seeded randomized SVD (deterministic for a given input).
    """
    assert matrix.dim() == 2 and matrix.dtype == torch.float32
    n, k = matrix.shape
    r = min(rank, n, k)
    if r == 0:
        return matrix.new_zeros(n, 0), matrix.new_zeros(k, 0)
    sketch = r + _SVD_OVERSAMPLE
    if sketch >= min(n, k):
        u, sigma, vh = torch.linalg.svd(matrix, full_matrices=False)
    else:
        generator = torch.Generator(device=matrix.device).manual_seed(_SVD_SEED)
        probe = torch.randn(k, sketch, generator=generator, device=matrix.device)
        basis = torch.linalg.qr(matrix @ probe).Q
        for _ in range(_SVD_POWER_ITERATIONS):
            basis = torch.linalg.qr(matrix @ torch.linalg.qr(matrix.T @ basis).Q).Q
        small_u, sigma, vh = torch.linalg.svd(basis.T @ matrix, full_matrices=False)
        u = basis @ small_u
    return (u[:, :r] * sigma[:r]).contiguous(), vh[:r].T.contiguous()


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
    error2, norm2 = squared_error_terms(weight, approximation)
    return math.sqrt(error2 / norm2) if norm2 else (0.0 if error2 == 0 else math.inf)


def squared_error_terms(weight: torch.Tensor, approximation: torch.Tensor) -> tuple[float, float]:
    """(|W - A|_F^2, |W|_F^2), reduced in float32."""
    if approximation is weight:
        return 0.0, _squared_norm(weight)
    return _squared_norm(weight.float() - approximation.float()), _squared_norm(weight)


def _squared_norm(tensor: torch.Tensor) -> float:
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).item() ** 2
