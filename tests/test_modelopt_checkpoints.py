"""Checkpoints stored as ModelOpt NVFP4 (``attnquant quantize`` output, NVIDIA's
``*-NVFP4`` exports): served as stored, never quantized again, checked
before anything is built. The load pipeline on a tiny Gemma 3; serving the
real 270M's export is in tests/test_gemma3_max.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from max.dtype import DType
from safetensors.torch import load_file, save_file

from attnquant.config import AttnQuantConfig
from attnquant.load import importance, pipeline
from attnquant.load.checkpoint import load_state_dict
from attnquant.load.memory import check_before_serving, quantization_saving
from attnquant.tools import cli


def export(source: Path, out: Path, *ignore: str) -> Path:
    args = ["quantize", str(source), "--out", str(out), "--no-progress"]
    assert cli.main([*args, *(["--ignore", *ignore] if ignore else [])]) == 0
    return out


def load(model_dir: Path, cache: Path, **settings: object) -> pipeline.PreparedWeights:
    """A load as our Gemma 3 architecture makes it (its residual stream for the scale search)."""
    config = AttnQuantConfig(cache_dir=cache, **settings)  # type: ignore[arg-type]
    return pipeline.prepare_weights(
        load_state_dict(model_dir), config, checkpoint_files=sorted(model_dir.glob("*.safetensors")),
        num_layers=2, dtype=DType.float32, device_api="cpu", stream=importance.GEMMA3,
    )  # fmt: skip


@pytest.mark.parametrize("ignore", [(), ("self_attn",)], ids=["everything", "attention-kept-bf16"])
def test_an_export_serves_what_quantizing_at_load_serves(tiny_gemma3_dir: Path, tmp_path: Path, ignore) -> None:
    """Serving the export with no setting gives, tensor for tensor, what
    serving the original with ATTNQUANT_QUANT=nvfp4 (and the same ignore list) gives."""
    stored = load(export(tiny_gemma3_dir, tmp_path / "export", *ignore), tmp_path / "stored-cache")
    at_load = load(tiny_gemma3_dir, tmp_path / "cache", quant="nvfp4", quant_ignore=ignore)
    assert stored.plan == at_load.plan
    assert stored.state_dict.keys() == at_load.state_dict.keys()
    for name, tensor in at_load.state_dict.items():
        assert torch.equal(stored.state_dict[name].view(torch.uint8), tensor.view(torch.uint8)), name
    expected = "NVFP4 14/14" if not ignore else "NVFP4 6/14"
    assert expected in stored.report.line() and "checkpoint weights" in stored.report.line()
    # The same bytes before (the unquantized model) and after, so the same ratio.
    for figure in ("projection_bytes_before", "projection_bytes_after", "decode_bytes_before", "decode_bytes_after"):
        assert getattr(stored.report, figure) == getattr(at_load.report, figure), figure
    assert not (tmp_path / "stored-cache").exists(), "nothing to prepare, nothing cached"


def test_bf16_projections_of_an_export_are_quantized_only_when_asked(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    model = export(tiny_gemma3_dir, tmp_path / "export", "self_attn")
    assert "NVFP4 6/14" in load(model, tmp_path / "cache").report.line()
    assert "NVFP4 14/14" in load(model, tmp_path / "cache", quant="nvfp4").report.line()
    with pytest.raises(ValueError, match="stores NVFP4 projections.*theta"):
        load(model, tmp_path / "cache", blocks=1)


def edit(model: Path, name: str, change) -> None:
    weights = load_file(str(model / "model.safetensors"))
    weights[name] = change(weights[name])
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("tensor", "change", "message"),
    [
        ("weight_scale", lambda t: t[:, :3].contiguous(), r"weight_scale is .* \[32, 3\], not E4M3 \[32, 4\]"),
        ("weight_scale", lambda t: t.view(torch.uint8) | 0x80, "weight_scale holds negative or NaN block scales"),
        ("weight", lambda t: t[:, :28].contiguous(), "K = 56 is not a multiple of 16"),
        ("weight_scale_2", lambda t: torch.tensor(float("nan")), "weight_scale_2 = nan is not a positive finite scale"),
        ("weight", lambda t: t.float(), r"weight is torch.float32 .*not packed uint8"),
    ],
    ids=["scales-cut", "negative-scales", "weight-cut", "nan-global-scale", "float-weight"],
)
def test_an_export_that_does_not_fit_is_refused_naming_the_tensor(
    tiny_gemma3_dir: Path, tmp_path: Path, tensor: str, change, message: str
) -> None:
    model = export(tiny_gemma3_dir, tmp_path / "export")
    edit(model, f"model.layers.1.self_attn.k_proj.{tensor}", change)
    with pytest.raises(ValueError, match=rf"model.layers.1.self_attn.k_proj: {message}"):
        load(model, tmp_path / "cache", quant="nvfp4")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.safetensors")), "nothing cached"


def test_other_quantizations_are_refused_before_serving(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    model = export(tiny_gemma3_dir, tmp_path / "export")
    check_before_serving(model, AttnQuantConfig())
    config = json.loads((model / "config.json").read_text())
    for declared, message in [
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quantized with modelopt/FP8"),
        ({"quant_method": "awq", "bits": 4}, "quantized with awq/"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
    ]:
        (model / "config.json").write_text(json.dumps({**config, "quantization_config": declared}))
        with pytest.raises(ValueError, match=message):
            check_before_serving(model, AttnQuantConfig())


def test_the_memory_estimate_counts_no_saving_for_stored_nvfp4(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    model = export(tiny_gemma3_dir, tmp_path / "export", "mlp")
    original = quantization_saving(tiny_gemma3_dir, AttnQuantConfig(quant="nvfp4"))
    mlp = quantization_saving(tiny_gemma3_dir, AttnQuantConfig(quant="nvfp4", quant_ignore=("self_attn",)))
    # Only the export's bf16 MLP is left to save on.
    assert quantization_saving(model, AttnQuantConfig(quant="nvfp4")) == mlp < original
    assert quantization_saving(model, AttnQuantConfig()) == 0
    shutil.rmtree(model)
