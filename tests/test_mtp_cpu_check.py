"""bench/checks/mtp_cpu_check.py's pieces that run without a server (the check itself
compiles two Gemma 4 servers: minutes, so it is a bench script, not a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from attnquant.max_compat import child_environment
from tests.bench_modules import BENCH, bench_module


def test_assistant_copy_is_float32_on_disk_and_in_its_config(tmp_path: Path) -> None:
    source = tmp_path / "assistant"
    source.mkdir()
    save_file({"w": torch.ones(2, 3, dtype=torch.bfloat16)}, source / "model.safetensors")
    (source / "config.json").write_text(json.dumps({"dtype": "bfloat16", "hidden_size": 8}))
    copy = bench_module("mtp_cpu_check").float32_copy(source, tmp_path / "f32")
    tensor = load_file(copy / "model.safetensors")["w"]
    assert tensor.dtype == torch.float32 and torch.equal(tensor, torch.ones(2, 3))
    assert json.loads((copy / "config.json").read_text()) == {"dtype": "float32", "hidden_size": 8}
    assert load_file(source / "model.safetensors")["w"].dtype == torch.bfloat16  # the original is left alone


def test_cpu_patches_still_apply_to_this_max() -> None:
    """Each patch checks MAX's source before editing it; run in a child process
    so this test session's MAX keeps its CPU refusals."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('p', {str(BENCH / 'checks' / 'mtp_cpu' / 'patches.py')!r})\n"
        "p = importlib.util.module_from_spec(spec); spec.loader.exec_module(p); p.apply(); p.apply()\n"
        "from max.pipelines.lib.pipeline_variants.overlap_text_generation import OverlapTextGenerationPipeline as O\n"
        "assert not any('does not support CPU' in str(c) for c in O.__init__.__code__.co_consts)\n"
    )
    # env= explicitly: once MAX's native library is loaded here, an inherited
    # environment runs the child outside the virtual environment (max_compat).
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=child_environment()
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("four CPU refusals patched") == 1  # applied once, idempotent


def test_table_marks_each_departure_and_fails_on_any(capsys) -> None:
    module = bench_module("mtp_cpu_check")
    greedy = bench_module("serve_benchmark").Greedy
    same = [greedy("a", [1, 2, 3], "length"), greedy("b", [4, 5, 6], "length")]
    assert module.print_table(["p0", "p1"], same, same, same, same) == 0
    late = [greedy("a", [1, 2, 3], "length"), greedy("b", [4, 9, 6], "length")]
    assert module.print_table(["p0", "p1"], same, same, late, same) == 1
    rows = capsys.readouterr().out.splitlines()
    assert rows[-2].startswith("| p0 | = | = | = | = |")
    assert rows[-1].startswith("| p1 | = | 1 | = | 1 |")  # MTP batched departs from MTP alone and from ours batched
    assert module.print_table(["p0"], same[:1], late[1:], None, None) == 1  # alone only: one comparison
    assert capsys.readouterr().out.splitlines()[-1].startswith("| p0 | 0 |")
