"""`attnquant quantize` end to end on a tiny Gemma 3 checkpoint."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnquant.max_compat import child_environment
import torch
from safetensors.torch import load_file, save_file

from attnquant.formats import nvfp4
from attnquant.load import importance
from attnquant.tools import cli
from attnquant.load.checkpoint import load_state_dict
from attnquant.formats.names import find_projections
from attnquant.formats.names import group_name

REPO = Path(__file__).resolve().parents[1]


def quantize(*args: str | Path) -> int:
    return cli.main(["quantize", *map(str, args), "--no-progress"])


def test_writes_a_modelopt_nvfp4_checkpoint(
    tiny_gemma3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "nvfp4"
    assert quantize(tiny_gemma3_dir, "--out", out) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "hf_quant_config.json",
        "model.safetensors",
        "tokenizer_config.json",
    ]
    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((tiny_gemma3_dir / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "ignore": ["lm_head"],
    }
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source_config
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["producer"]["name"] == "modelopt"
    assert hf_quant["quantization"] == {
        "quant_algo": "NVFP4",
        "kv_cache_quant_algo": None,
        "group_size": 16,
        "ignore": ["lm_head"],
    }

    original, written = load_state_dict(tiny_gemma3_dir), load_file(str(out / "model.safetensors"))
    projections = find_projections(original)
    # The default selection, weighted by the importances a served load computes.
    importances = importance.projection_importances(
        original, projections, importance.GEMMA3, embedding="model.embed_tokens.weight"
    )
    for key in projections:
        # Fused groups (q|k|v, gate|up) share one global scale: their amax.
        group = [k for k in projections if k.layer == key.layer and group_name(k.proj) == group_name(key.proj)]
        amax = max(original[k.weight_name].abs().max().float().item() for k in group)
        expected = nvfp4.quantize(
            original[key.weight_name], amax=amax, scale_policy=nvfp4.ScalePolicy.WEIGHTED,
            importance=importances[key.weight_name],
        )  # fmt: skip
        module = key.module_name
        assert torch.equal(written[f"{module}.weight"], expected.packed)
        assert torch.equal(
            written[f"{module}.weight_scale"].view(torch.uint8), expected.block_scale_bits()
        )
        assert torch.equal(written[f"{module}.weight_scale_2"], expected.global_scale)
        assert written[f"{module}.input_scale"].item() == 1.0
    names = {key.weight_name for key in projections}
    assert all(
        torch.equal(written[name], tensor) for name, tensor in original.items() if name not in names
    )

    summary = capsys.readouterr().out.strip().splitlines()
    assert (
        len(summary) == 1
        and summary[0].startswith("attnquant quantize: ")
        and "NVFP4 14/14 projections" in summary[0]
        and " -> " in summary[0]
    )
    assert str(out) in summary[0]


def test_ignored_modules_are_listed_for_modelopt_readers(
    tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert (
        quantize(
            tiny_gemma3_dir,
            "--out",
            out,
            "--ignore",
            "mlp",
            "--ignore",
            "layers.1.self_attn.o_proj",
        )
        == 0
    )
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    mlp = [
        f"model.layers.{i}.mlp.{p}" for i in (0, 1) for p in ("down_proj", "gate_proj", "up_proj")
    ]
    assert ignore == [
        "lm_head",
        *sorted([*mlp, "model.layers.1.self_attn.o_proj"]),
        "model.layers.0.mlp*",
        "model.layers.1.mlp*",
    ]
    written = load_file(str(out / "model.safetensors"))
    assert written["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.up_proj.weight_scale" not in written
    assert written["model.layers.0.self_attn.o_proj.weight"].dtype == torch.uint8


def test_theta_flags_and_progress_bar(
    tiny_gemma3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert (
        cli.main(
            [
                "quantize",
                str(tiny_gemma3_dir),
                "--out",
                str(out),
                "--blocks",
                "1",
                "--rank",
                "4",
                "--scale-search",
                "mse",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "attnquant projections" in captured.err and "theta G=1/2 (R=4)" in captured.out
    assert (out / "model.safetensors").exists()


def test_refuses_a_non_empty_out_dir_unless_forced(
    tiny_gemma3_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert quantize(tiny_gemma3_dir, "--out", out) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert quantize(tiny_gemma3_dir, "--out", out, "--force") == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no staging or previous dirs left"


def nan_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    weights["model.layers.1.self_attn.k_proj.weight"][3, 7] = float("nan")
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def corrupt_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    return target


@pytest.mark.parametrize(
    ("make_model", "extra", "message"),
    [
        (lambda src, tmp: tmp / "missing", [], "does not exist"),
        (lambda src, tmp: tmp, [], "no config.json"),
        (
            lambda src, tmp: nan_checkpoint(src, tmp / "nan"),
            [],
            r"'model.layers.1.self_attn.k_proj.weight' contains NaN or Inf \(first at \[3, 7\]",
        ),
        (
            lambda src, tmp: corrupt_checkpoint(src, tmp / "corrupt"),
            [],
            r"model.safetensors is truncated: tensor .* ends at data byte \d+, the file holds \d+",
        ),
        (lambda src, tmp: src, ["--blocks", "3"], r"ATTNQUANT_BLOCKS=3 cannot split 2 layers"),
        (lambda src, tmp: src, ["--rank", "-2"], r"ATTNQUANT_RANK='-2' is invalid; allowed: integer >= 0"),
    ],
    ids=["missing-dir", "no-config", "nan-weight", "truncated-file", "bad-blocks", "bad-rank"],
)
def test_bad_input_is_an_error_and_writes_nothing(
    tiny_gemma3_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make_model,
    extra: list[str],
    message: str,
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    model = make_model(tiny_gemma3_dir, models)
    target = tmp_path / "outputs"
    target.mkdir()
    assert quantize(model, "--out", target / "q", *extra) == 2
    error = capsys.readouterr().err
    assert error.startswith("attnquant: error: ")
    assert re.search(message, error), error
    assert list(target.iterdir()) == [], "nothing written"


def test_subcommands_can_be_registered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "_SUBCOMMANDS", dict(cli._SUBCOMMANDS))

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--times", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        print("hello " * args.times)
        return 0

    cli.register_subcommand("hello", "say hello", add_arguments, run)
    assert cli.main(["hello", "--times", "2"]) == 0
    assert capsys.readouterr().out.strip() == "hello hello"
    with pytest.raises(ValueError, match="registered twice"):
        cli.register_subcommand("hello", "again", add_arguments, run)


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "attnquant", "--help"],
        cwd=REPO,
        env=child_environment(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "quantize" in result.stdout


def test_quantize_refuses_an_nvfp4_output_head(tmp_path: Path) -> None:
    from attnquant.tools.cli import build_parser
    from attnquant.tools.quantize import quantize_config

    args = build_parser().parse_args(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                                      "--lm-head", "nvfp4"])  # fmt: skip
    with pytest.raises(ValueError, match="ATTNQUANT_LM_HEAD=nvfp4: quantize writes the output head unquantized"):
        quantize_config(args)
