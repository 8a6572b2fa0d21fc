"""W_eff and the precompute-outside step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnquant.formats import nvfp4
from attnquant.load import importance
from attnquant.load.checkpoint import load_state_dict
from attnquant.config import AttnQuantConfig
from attnquant.formats.names import ProjectionKey, find_projections, is_ignored
from attnquant.formats.theta import effective_weight
from attnquant.load.precompute import PrecomputeResult, precompute_outside
from attnquant.load.report import LoadReport
from attnquant.formats.names import group_name
from attnquant.load.fuse import to_runtime_layout

NVFP4 = AttnQuantConfig(quant="nvfp4")


def report_of(state: dict[str, torch.Tensor], result: PrecomputeResult, config: AttnQuantConfig) -> LoadReport:
    """The load report a load of ``state`` with ``config`` prints."""
    return LoadReport.measure(
        before=state, served=result.state_dict, keys=find_projections(state),
        quantized=len(result.quantized_modules), path="precompute-outside", blocks=config.blocks or 2,
        num_layers=2, rank=config.rank, quant=config.quant, source="prepared", layer_errors=result.layer_errors,
    )  # fmt: skip
SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def test_effective_weight_is_scaled_base_plus_low_rank() -> None:
    generator = torch.Generator().manual_seed(0)
    w0 = torch.randn(24, 32, generator=generator).bfloat16()
    s, u, v = (
        torch.rand(24, generator=generator),
        torch.randn(24, 3, generator=generator),
        torch.randn(32, 3, generator=generator),
    )
    result = effective_weight(w0, s, u, v, torch.bfloat16)
    expected = (s.double()[:, None] * w0.double() + u.double() @ v.double().T).bfloat16()
    assert result.dtype == torch.bfloat16
    assert (result.float() - expected.float()).abs().max() <= expected.float().abs().max() * 2**-8


def test_effective_weight_without_residual_keeps_negative_zero() -> None:
    w0 = torch.tensor([[-0.0, 1.0], [2.0, -3.0]], dtype=torch.bfloat16)
    result = effective_weight(
        w0, torch.ones(2), torch.zeros(2, 0), torch.zeros(2, 0), torch.bfloat16
    )
    assert torch.equal(result.view(torch.int16), w0.view(torch.int16))


def test_projection_names() -> None:
    names = [
        "model.layers.3.self_attn.q_proj.weight",
        "model.language_model.layers.3.mlp.down_proj.weight",
        "language_model.layers.0.mlp.gate_proj.weight",
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.3.mlp.fc1_proj.weight",
    ]
    key = ProjectionKey.parse(names[1])
    assert key == ProjectionKey("model.language_model", 3, "mlp", "down_proj")
    assert (key.family, key.module_name) == ("down", "model.language_model.layers.3.mlp.down_proj")
    assert [ProjectionKey.parse(n) is not None for n in names] == [
        True,
        True,
        True,
        False,
        False,
        False,
    ]
    assert ProjectionKey.parse("layers.2.self_attn.v_proj.weight") == ProjectionKey(
        "", 2, "self_attn", "v_proj"
    )
    with pytest.raises(ValueError, match="several prefixes"):
        find_projections(names[:2])
    ordered = find_projections(
        [
            f"model.layers.{i}.{b}.{p}.weight"
            for i in (1, 0)
            for b, p in (("mlp", "up_proj"), ("self_attn", "k_proj"))
        ]
    )
    assert [(k.layer, k.proj) for k in ordered] == [
        (0, "k_proj"),
        (0, "up_proj"),
        (1, "k_proj"),
        (1, "up_proj"),
    ]


@pytest.mark.parametrize(
    ("fragments", "ignored"),
    [
        (("self_attn",), True), (("mlp",), False), (("o_proj",), True),
        (("layers.3",), True), (("layers.30",), False), (("layers.3.self_attn.o_proj",), True),
        (("attn",), False), ((), False),
    ],
)  # fmt: skip
def test_is_ignored_matches_whole_components(fragments: tuple[str, ...], ignored: bool) -> None:
    assert is_ignored("model.layers.3.self_attn.o_proj", fragments) == ignored


@pytest.fixture(scope="module")
def tiny_state(tiny_gemma3_dir: Path) -> dict[str, torch.Tensor]:
    return load_state_dict(tiny_gemma3_dir)


def test_passthrough_without_quantization_returns_the_same_tensors(
    tiny_state: dict[str, torch.Tensor]
) -> None:
    result = precompute_outside(tiny_state, AttnQuantConfig(), progress=False)
    assert result.state_dict.keys() == tiny_state.keys()
    assert all(result.state_dict[name] is tensor for name, tensor in tiny_state.items())
    report = report_of(tiny_state, result, AttnQuantConfig())
    assert (report.projections, report.quantized, report.theta_error_max) == (14, 0, 0.0)
    assert report.decode_bytes_after == report.decode_bytes_before


@pytest.mark.parametrize("search", ["rtn", "weighted"])
def test_nvfp4_replaces_each_projection_with_modelopt_tensors(
    tiny_state: dict[str, torch.Tensor], search: str
) -> None:
    config = AttnQuantConfig(quant="nvfp4", scale_search=search)
    keys = find_projections(tiny_state)
    importances = importance.for_quantization(tiny_state, keys, config, importance.GEMMA3)
    assert set(importances) == ({k.weight_name for k in keys} if search == "weighted" else set())
    result = precompute_outside(tiny_state, config, importance=importances, progress=False)
    served = result.state_dict
    for key in keys:
        weight = tiny_state[key.weight_name]
        # One global scale per fused group (q|k|v, gate|up): the group's amax.
        group = [k for k in keys if k.layer == key.layer and group_name(k.proj) == group_name(key.proj)]
        amax = max(tiny_state[k.weight_name].abs().max().float().item() for k in group)
        expected = nvfp4.quantize(
            weight, amax=amax, scale_policy=nvfp4.ScalePolicy(search), importance=importances.get(key.weight_name)
        )
        tensors = [served[f"{key.module_name}.{suffix}"] for suffix in SUFFIXES]
        assert torch.equal(tensors[0], expected.packed)
        assert tensors[1].dtype == torch.float8_e4m3fn and torch.equal(
            tensors[1].view(torch.uint8), expected.block_scale_bits()
        )
        assert tensors[2].shape == () and torch.equal(tensors[2], expected.global_scale)
        assert (
            tensors[3].dtype == torch.float32
            and tensors[3].shape == ()
            and tensors[3].item() == 1.0
        )
    for name, tensor in tiny_state.items():
        if ProjectionKey.parse(name) is None:
            assert served[name] is tensor
    assert len(result.quantized_modules) == 14 and result.ignored_modules == ()
    scale = lambda layer, proj: served[f"model.layers.{layer}.{proj}.weight_scale_2"]  # noqa: E731
    for layer in (0, 1):
        qkv = [scale(layer, f"self_attn.{p}") for p in ("q_proj", "k_proj", "v_proj")]
        assert all(torch.equal(g, qkv[0]) for g in qkv)
        assert torch.equal(scale(layer, "mlp.gate_proj"), scale(layer, "mlp.up_proj"))
        assert not torch.equal(scale(layer, "mlp.down_proj"), scale(layer, "mlp.up_proj"))


def test_fused_nvfp4_parts_take_one_scale_when_their_members_share_it(
    tiny_state: dict[str, torch.Tensor]
) -> None:
    """precompute_outside's shared amax makes each fused NVFP4 part a single
    ``[1]`` scale (no per-row rescale in the graph); members quantized apart
    (e.g. another tool's checkpoint) still fuse, with a per-row scale."""
    served = precompute_outside(tiny_state, NVFP4, progress=False).state_dict
    runtime, plan = to_runtime_layout(served, fuse=True, dtype=torch.bfloat16)
    (qkv,) = plan["model.layers.0.self_attn.qkv_proj"]
    assert not qkv.per_row_scale
    assert runtime["model.layers.0.self_attn.qkv_proj.weight_scale_2"].shape == (1,)

    apart = dict(served)
    for proj in ("q_proj", "k_proj", "v_proj"):
        q = nvfp4.quantize(tiny_state[f"model.layers.0.self_attn.{proj}.weight"])
        apart[f"model.layers.0.self_attn.{proj}.weight"] = q.packed
        apart[f"model.layers.0.self_attn.{proj}.weight_scale"] = q.block_scales
        apart[f"model.layers.0.self_attn.{proj}.weight_scale_2"] = q.global_scale
    runtime, plan = to_runtime_layout(apart, fuse=True, dtype=torch.bfloat16)
    (qkv,) = plan["model.layers.0.self_attn.qkv_proj"]
    assert qkv.per_row_scale
    assert runtime["model.layers.0.self_attn.qkv_proj.weight_scale_2"].shape == (qkv.out_dim,)


def test_ignored_projections_stay_in_the_checkpoint_dtype_and_bytes_add_up(
    tiny_state: dict[str, torch.Tensor]
) -> None:
    config = AttnQuantConfig(quant="nvfp4", quant_ignore=("self_attn", "layers.1.mlp.down_proj"))
    result = precompute_outside(tiny_state, config, progress=False)
    report, served = report_of(tiny_state, result, config), result.state_dict
    expected_ignored = [
        f"model.layers.{i}.self_attn.{p}"
        for i in (0, 1)
        for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    assert sorted(result.ignored_modules) == sorted(
        [*expected_ignored, "model.layers.1.mlp.down_proj"]
    )
    assert (report.projections, report.quantized, len(result.ignored_modules)) == (14, 5, 9)
    for module in result.ignored_modules:
        assert served[f"{module}.weight"] is tiny_state[f"{module}.weight"]
        assert f"{module}.weight_scale" not in served

    projections = find_projections(tiny_state)
    before = sum(tiny_state[k.weight_name].numel() * 2 for k in projections)

    def served_bytes(key: ProjectionKey) -> int:
        numel = tiny_state[key.weight_name].numel()
        if key.module_name in result.ignored_modules:
            return numel * 2  # bf16, unchanged
        return numel // 2 + numel // 16 + 4 + 4  # codes, E4M3 scales, two float32 scalars

    after = sum(served_bytes(k) for k in projections)
    assert (report.projection_bytes_before, report.projection_bytes_after) == (before, after)
    total_before = sum(t.numel() * t.element_size() for t in tiny_state.values())
    assert report.decode_bytes_before == total_before
    assert report.decode_bytes_after == total_before - before + after
    assert "NVFP4 5/14 projections" in report.line()


def test_shared_bands_report_their_error(tiny_state: dict[str, torch.Tensor]) -> None:
    config = AttnQuantConfig(blocks=1, rank=4)
    result = precompute_outside(tiny_state, config, progress=False)
    report = report_of(tiny_state, result, config)
    assert set(report.layer_errors) == {0, 1}
    # Two random layers share little: the error is large but below 1.
    assert 0.2 < report.theta_error_mean <= report.theta_error_max < 1.0
    for key in find_projections(tiny_state):
        served = result.state_dict[key.weight_name]
        assert served.dtype == torch.bfloat16 and served.shape == tiny_state[key.weight_name].shape
        assert not torch.equal(served, tiny_state[key.weight_name])
    assert "theta G=1/2 (R=4)" in report.line() and "theta error per layer mean" in report.line()


def test_bad_inputs_are_value_errors(tiny_state: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ValueError, match="no projection weights found"):
        precompute_outside({"model.norm.weight": torch.ones(4)}, AttnQuantConfig(), progress=False)
    no_layer_0 = {k: v for k, v in tiny_state.items() if ".layers.0." not in k}
    with pytest.raises(ValueError, match=r"layers \[0\] have no projection"):
        precompute_outside(no_layer_0, AttnQuantConfig(), progress=False)
    with pytest.raises(ValueError, match="ATTNQUANT_BLOCKS=3"):
        precompute_outside(tiny_state, AttnQuantConfig(blocks=3), progress=False)
    odd = dict(tiny_state)
    odd["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 120, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.down_proj.weight' has K = 120"):
        precompute_outside(odd, NVFP4, progress=False)
