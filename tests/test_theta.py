"""Theta bundles: band split, passthrough exactness, error vs G and R, files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnquant.formats.names import ProjectionKey
from attnquant.formats.theta import effective_weight, relative_error
from attnquant.formats.theta import ThetaBundle, band_size, build_theta, truncated_svd

SHAPES = {"q_proj": (64, 32), "k_proj": (32, 32), "v_proj": (32, 32), "o_proj": (32, 64)}


def drifting_weights(
    num_layers: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> dict[ProjectionKey, torch.Tensor]:
    """Per family: a base matrix, a slow drift across layers, a per-row gain
    and per-layer noise, roughly how trained layers relate."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for proj, shape in SHAPES.items():
        base, drift = torch.randn(shape, generator=generator), torch.randn(
            shape, generator=generator
        )
        for layer in range(num_layers):
            gain = 1 + 0.1 * torch.randn(shape[0], 1, generator=generator)
            noise = 0.2 * torch.randn(shape, generator=generator)
            weight = gain * (base + drift * layer / num_layers) + noise
            weights[ProjectionKey("model", layer, "self_attn", proj)] = weight.to(dtype)
    return weights


def reconstruct(bundle: ThetaBundle, key: ProjectionKey, dtype: torch.dtype) -> torch.Tensor:
    theta = bundle.layers[(key.family, key.layer)]
    return effective_weight(bundle.shared[theta.group], theta.scale, theta.u, theta.v, dtype)


def mean_error(weights: dict[ProjectionKey, torch.Tensor], **kwargs) -> float:
    bundle = build_theta(weights, num_layers=8, **kwargs)
    errors = [relative_error(w, reconstruct(bundle, key, w.dtype)) for key, w in weights.items()]
    return sum(errors) / len(errors)


@pytest.mark.parametrize(("blocks", "layers"), [(0, 4), (5, 4), (3, 4), (-1, 4)])
def test_blocks_must_split_the_layers_evenly(blocks: int, layers: int) -> None:
    with pytest.raises(
        ValueError, match=rf"ATTNQUANT_BLOCKS={blocks} cannot split {layers} layers.*\[1, 2, 4\]"
    ):
        band_size(layers, blocks)


def test_band_size() -> None:
    assert [band_size(26, g) for g in (1, 2, 13, 26)] == [26, 13, 2, 1]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float16), ids=str)
def test_passthrough_reconstructs_bit_for_bit(dtype: torch.dtype) -> None:
    weights = drifting_weights(4, dtype)
    specials = torch.tensor(
        [-0.0, 0.0, 1e-40, -1e-40, 3.0e38 if dtype != torch.float16 else 60000.0]
    )
    for weight in weights.values():
        weight.view(-1)[: len(specials)] = specials.to(dtype)
    bundle = build_theta(weights, blocks=None, rank=16, num_layers=4)
    for key, weight in weights.items():
        assert bundle.is_passthrough((key.family, key.layer))
        theta = bundle.layers[(key.family, key.layer)]
        assert theta.rank == 0 and torch.equal(theta.scale, torch.ones_like(theta.scale))
        rebuilt = reconstruct(bundle, key, dtype)
        assert rebuilt.dtype == dtype
        bits = torch.int16 if dtype.itemsize == 2 else torch.int32
        assert torch.equal(rebuilt.view(bits), weight.view(bits))


def test_a_one_layer_group_inside_a_band_is_passthrough() -> None:
    # Gemma 4 style: layer 1's q_proj has another shape than layer 0's, and
    # layer 1 has no v_proj, so neither shares a band group.
    weights = drifting_weights(2)
    weights[ProjectionKey("model", 1, "self_attn", "q_proj")] = torch.randn(128, 32)
    del weights[ProjectionKey("model", 1, "self_attn", "v_proj")]
    bundle = build_theta(weights, blocks=1, rank=4, num_layers=2)
    for key, weight in weights.items():
        layer_id = (key.family, key.layer)
        alone = key.family in ("q", "v")
        assert bundle.is_passthrough(layer_id) == alone
        if alone:
            assert torch.equal(reconstruct(bundle, key, weight.dtype), weight)
    assert ("v", 1) not in bundle.layers


def test_error_falls_as_rank_grows() -> None:
    weights = drifting_weights(8)
    errors = [mean_error(weights, blocks=1, rank=rank) for rank in (0, 2, 8, 32)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5 * errors[0], errors
    # R >= min(N, K) leaves nothing out.
    assert mean_error(weights, blocks=1, rank=64) < 1e-5


def test_error_falls_as_bands_grow() -> None:
    weights = drifting_weights(8)
    errors = [mean_error(weights, blocks=blocks, rank=2) for blocks in (1, 2, 4, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] == 0.0, errors


def test_scale_is_the_least_squares_fit() -> None:
    weights = drifting_weights(2)
    bundle = build_theta(weights, blocks=1, rank=0, num_layers=2)
    key = ProjectionKey("model", 1, "self_attn", "o_proj")
    theta = bundle.layers[(key.family, key.layer)]
    w0, w = bundle.shared[theta.group].double(), weights[key].double()
    best = (w * w0).sum(1) / (w0 * w0).sum(1)
    torch.testing.assert_close(theta.scale.double(), best, rtol=1e-5, atol=0)


def test_randomized_svd_is_near_optimal_and_deterministic() -> None:
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(300, 8, generator=generator) @ torch.randn(8, 200, generator=generator) * 3
    matrix += 0.1 * torch.randn(300, 200, generator=generator)
    u, v = truncated_svd(matrix, 4)
    assert u.shape == (300, 4) and v.shape == (200, 4)
    exact_u, sigma, exact_vh = torch.linalg.svd(matrix, full_matrices=False)
    optimal = (matrix - (exact_u[:, :4] * sigma[:4]) @ exact_vh[:4]).norm()
    assert (matrix - u @ v.T).norm() <= optimal * 1.01
    u2, v2 = truncated_svd(matrix, 4)
    assert torch.equal(u, u2) and torch.equal(v, v2)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="ATTNQUANT_RANK=-1"):
        build_theta(drifting_weights(2), blocks=1, rank=-1, num_layers=2)
    with pytest.raises(ValueError, match="layer 1 outside 0..0"):
        build_theta(drifting_weights(2), blocks=1, rank=1, num_layers=1)
    weights = drifting_weights(2)
    weights[ProjectionKey("model", 0, "self_attn", "q_proj")] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"q_proj.weight must be a 2-D floating-point weight"):
        build_theta(weights, blocks=1, rank=1, num_layers=2)


