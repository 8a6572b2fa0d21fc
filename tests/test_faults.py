"""Faults a user can cause, each tried for real (docs/dev/reliability.md):
nothing stale is served, nothing half-written is left, bad input is one
line with the fix, and no request takes a server down.

These need no compiled MAX graph: loads run the real pipeline, and the
command-line cases stop before MAX compiles anything. The server cases
(a bad request, then a good one) are in tests/test_gemma3_max.py, which
shares its servers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from max.dtype import DType
from safetensors.torch import load_file, save_file

from attnquant.config import AttnQuantConfig
from attnquant.load import pipeline
from attnquant.load.checkpoint import checkpoint_identity, load_state_dict, read_header
from attnquant.max_compat import child_environment

REPO = Path(__file__).resolve().parents[1]


def load(model_dir: Path, cache_dir: Path, **settings: object) -> pipeline.PreparedWeights:
    """One real load of ``model_dir`` (the pipeline MAX's architectures call)."""
    config = AttnQuantConfig(quant="nvfp4", cache_dir=cache_dir, **settings)  # type: ignore[arg-type]
    files = sorted(model_dir.glob("*.safetensors"))
    return pipeline.prepare_weights(
        load_state_dict(model_dir), config, checkpoint_files=files, num_layers=2, dtype=DType.float32, device_api="cpu"
    )


def edited_copy(source: Path, target: Path, edit) -> Path:
    """A copy of ``source`` whose weights went through ``edit`` and were saved in the same layout."""
    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    edit(weights)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def zero_o_and_down(weights: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()


def one_element(weights: dict[str, torch.Tensor]) -> None:
    weight = weights["model.layers.1.mlp.gate_proj.weight"]
    weight[weight.shape[0] // 2, weight.shape[1] // 2] += 1.0


def unchanged(weights: dict[str, torch.Tensor]) -> None:
    pass


@pytest.mark.parametrize(
    ("edit", "hit"),
    [(zero_o_and_down, False), (one_element, False), (unchanged, True)],
    ids=["zeroed-o-and-down", "one-element-mid-layer", "re-saved-identical"],
)
def test_a_changed_checkpoint_is_never_served_from_the_cache(
    tiny_gemma3_dir: Path, tmp_path: Path, edit, hit: bool
) -> None:
    """The cache key hashes every byte of the weights: a fine-tune that keeps
    every shape (and the embedding) is another checkpoint."""
    cache = tmp_path / "cache"
    original = load(tiny_gemma3_dir, cache)
    assert not original.cache_hit and load(tiny_gemma3_dir, cache).cache_hit
    copy = edited_copy(tiny_gemma3_dir, tmp_path / "copy", edit)
    edited = load(copy, cache)
    assert edited.cache_hit is hit
    same = [torch.equal(edited.state_dict[n], t) for n, t in original.state_dict.items() if n.endswith("weight")]
    assert all(same) is hit


def test_nan_written_into_a_cached_checkpoint_is_found(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """Once cached, a checkpoint that later gains a NaN is quantized again
    (another identity), and quantizing refuses it, naming the tensor."""
    cache = tmp_path / "cache"
    model = shutil.copytree(tiny_gemma3_dir, tmp_path / "model")
    load(model, cache)
    weights = load_file(str(model / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"][3, 7] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' contains NaN or Inf"):
        load(model, cache)


def test_served_tensors_with_nan_are_refused_even_from_the_cache() -> None:
    good = {"w": torch.ones(2, 2), "s": torch.tensor([0x38], dtype=torch.uint8).view(torch.float8_e4m3fn)}
    pipeline.check_finite(good)
    for bad in ({"w": torch.tensor([1.0, float("inf")])}, {"s": torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn)}):
        with pytest.raises(ValueError, match=f"served tensor {next(iter(bad))} contains NaN or Inf"):
            pipeline.check_finite(bad)


def test_fingerprints_are_reused_only_while_the_file_is_unchanged(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_gemma3_dir, tmp_path / "model")
    store = tmp_path / "fingerprints"
    weights = model / "model.safetensors"
    first = checkpoint_identity(model, store)
    assert not store.exists(), "a file written a moment ago may still change within its timestamp tick"
    time.sleep(2.1)  # settled: its fingerprint may be kept
    assert checkpoint_identity(model, store) == first
    assert list(store.iterdir()), "a settled file's fingerprint is kept"
    assert checkpoint_identity(model, store) == first
    # Same size, same mtime, other bytes: the change time moves, so it hashes again.
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert checkpoint_identity(model, store) != first


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (lambda size: size - 1000, r"is (truncated|damaged)"),
        (lambda size: 5, "too short to be a safetensors file"),
    ],
    ids=["truncated-data", "truncated-header"],
)
def test_a_truncated_checkpoint_is_refused_before_it_is_mapped(
    tiny_gemma3_dir: Path, tmp_path: Path, cut, message: str
) -> None:
    model = shutil.copytree(tiny_gemma3_dir, tmp_path / "model")
    path = model / "model.safetensors"
    os.truncate(path, cut(path.stat().st_size))
    with pytest.raises(ValueError, match=message):
        read_header(path)
    result = run_max("serve", "--model-path", str(model))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and str(path) in result.stderr, result.stderr


def test_a_quant_ignore_fragment_that_matches_nothing_is_an_error(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"self-attn matches no projection.*self_attn, mlp.*layers.0 ... layers.1"):
        load(tiny_gemma3_dir, tmp_path / "cache", quant_ignore=("self-attn",))
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").glob("*.safetensors"))
    result = run_max("serve", "--model-path", str(tiny_gemma3_dir), env={"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_QUANT_IGNORE": "self-attn"})
    assert result.returncode == 2 and "self-attn matches no projection" in result.stderr, result.stderr


def run_max(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "run_max.py"), *args],
        env={**child_environment(), **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ATTNQUANT_QUANT": "int4"}, "ATTNQUANT_QUANT='int4' is invalid; allowed: none, nvfp4"),
        ({"ATTNQUANT_QUANT_IGNROE": "mlp"}, "ATTNQUANT_QUANT_IGNROE is not an attnquant setting; did you mean ATTNQUANT_QUANT_IGNORE?"),
    ],
    ids=["bad-value", "misspelled-name"],
)
def test_configuration_errors_are_one_line_before_max_starts(tiny_gemma3_dir: Path, env: dict, message: str) -> None:
    started = time.monotonic()
    result = run_max("serve", "--model-path", str(tiny_gemma3_dir), env=env)
    assert result.returncode == 2 and result.stderr.strip() == f"attnquant: error: invalid attnquant configuration: {message}"
    assert "Traceback" not in result.stderr and time.monotonic() - started < 60


def test_plain_max_serve_stops_on_a_bad_setting_in_one_line(tiny_gemma3_dir: Path) -> None:
    """Without run_max.py: MAX imports our package and reads ARCHITECTURES."""
    max_cli = [sys.executable, "-c", "from max._entrypoints.pipelines import main; main()"]
    result = subprocess.run(
        [*max_cli, "serve", "--model-path", str(tiny_gemma3_dir), "--custom-architectures", str(REPO / "attnquant")],
        env={**child_environment(), "ATTNQUANT_RANK": "-1", "HF_HUB_OFFLINE": "1", "MAX_SERVE_DISABLE_TELEMETRY": "1"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "attnquant: error: invalid attnquant configuration: ATTNQUANT_RANK='-1' is invalid" in output
    assert "Traceback" not in output, output[-3000:]


def test_a_checkpoint_of_another_architecture_is_refused_by_name(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    model = shutil.copytree(tiny_gemma3_dir, tmp_path / "gemma2")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["Gemma2ForCausalLM"]}))
    result = run_max("serve", "--model-path", str(model))
    assert result.returncode == 2
    assert "is a Gemma2ForCausalLM checkpoint; attnquant serves Gemma3ForCausalLM" in result.stderr, result.stderr


def test_a_checkpoint_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    """transformers hands MAX a placeholder tokenizer of a few tokens, and
    every completion would decode to ""; ours refuses to start (before the
    model worker, so nothing compiles)."""
    from attnquant.tools.demo_model import ensure_demo_model

    real = ensure_demo_model()
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy2(real / name, model / name)
    (model / "model.safetensors").symlink_to(real / "model.safetensors")
    result = run_max("serve", "--model-path", str(model))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "tokenizer files (tokenizer.json / tokenizer.model, tokenizer_config.json) are missing" in output, output[-3000:]


def test_prompt_token_ids_outside_the_vocabulary_are_input_errors() -> None:
    from max.pipelines.context.exceptions import InputError

    from models.common.tokenizer import check_prompt_ids

    check_prompt_ids([0, 5, 255], 256)
    check_prompt_ids("text", 256)
    for bad in ([2, 999999999, 5], [2, -5], [256]):
        with pytest.raises(InputError, match=r"prompt token id -?\d+ \(position \d\) is outside"):
            check_prompt_ids(bad, 256)


# --- files ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_quantize_refuses_to_write_over_its_source(tiny_gemma3_dir: Path, tmp_path: Path, where: str, capsys) -> None:
    from attnquant.tools import cli

    model = shutil.copytree(tiny_gemma3_dir, tmp_path / "models" / "m")
    out = {"same": model, "inside": model / "nvfp4", "parent": model.parent}[where]
    before = {p.name: p.stat().st_size for p in model.iterdir()}
    assert cli.main(["quantize", str(model), "--out", str(out), "--force", "--no-progress"]) == 2
    assert "is the source checkpoint" in capsys.readouterr().err
    assert {p.name: p.stat().st_size for p in model.iterdir()} == before


def test_a_killed_quantize_leaves_nothing_and_the_next_run_cleans_up(tiny_gemma3_dir: Path, tmp_path: Path) -> None:
    """SIGKILL while the copy is being written: no output directory, and the
    staging directory it leaves is removed by the next run."""
    out = tmp_path / "nvfp4"
    slow_save = (
        "import sys, time, safetensors.torch as st\n"
        "real = st.save_file\n"
        "def slow(*a, **k):\n"
        "    real(*a, **k); print('written', flush=True); time.sleep(60)\n"
        "st.save_file = slow\n"
        "from attnquant.tools.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", slow_save, "quantize", str(tiny_gemma3_dir), "--out", str(out), "--no-progress"],
        cwd=REPO, env=child_environment(), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stdout.readline().strip() == "written"
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert leftovers == [f".nvfp4.partial-{process.pid}"], leftovers
    from attnquant.tools import cli

    assert cli.main(["quantize", str(tiny_gemma3_dir), "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvfp4"]
    assert read_header(out / "model.safetensors")


def test_run_max_serves_several_requests_at_once_on_cpu() -> None:
    from attnquant.tools.max_cli import CPU_MAX_LENGTH, cpu_batch_size, max_arguments

    assert [cpu_batch_size(n) for n in (1, 2, 4, 8, 16, 64)] == [2, 2, 2, 4, 8, 8]
    args = max_arguments("serve", ["--model-path", "/m", "--devices", "cpu"])
    assert args[args.index("--max-batch-size") + 1] == str(cpu_batch_size())
    assert args[args.index("--max-length") + 1] == str(CPU_MAX_LENGTH)
    mine = max_arguments("serve", ["--model-path", "/m", "--devices", "cpu", "--max-batch-size", "1"])
    assert mine.count("--max-batch-size") == 1 and "--max-length" in mine
