"""The benchmark harness's cells (bench/harness/serve_benchmark.py): what each server is given."""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.bench_modules import bench_module


def _args(**overrides) -> argparse.Namespace:
    values = dict(model=Path("/m/target"), mtp_target=Path("/m/mtp"), draft_model=Path("/m/assistant"))
    return argparse.Namespace(**(values | overrides))


def test_mtp_cell_serves_the_mtp_twin_with_the_assistant_drafting_3() -> None:
    harness = bench_module("serve_benchmark")
    cell = harness.Cell.parse("attnquant-nvfp4-mtp3:on+ATTNQUANT_GEMMA4_GRAPH_CAPTURE=1")
    assert harness.served_model(cell, _args()) == Path("/m/mtp")
    assert harness.speculative_args(cell, _args()) == [
        "--draft-model-path", "/m/assistant", "--speculative-method", "mtp", "--num-speculative-tokens", "3",
    ]  # fmt: skip
    assert harness.VARIANTS[cell.variant][1] == {"ATTNQUANT_QUANT": "nvfp4"}


def test_other_cells_serve_the_model_without_a_drafter() -> None:
    harness = bench_module("serve_benchmark")
    cell = harness.Cell.parse("attnquant-nvfp4:on")
    assert harness.served_model(cell, _args()) == Path("/m/target")
    assert harness.speculative_args(cell, _args()) == []


def test_greedy_note_names_the_tokens_behind_an_empty_text() -> None:
    greedy = bench_module("serve_benchmark").Greedy
    assert greedy("w1 w2", [5, 6], "length").note() == ""
    assert greedy("", [], "stop").note() == ""  # nothing generated: nothing to explain
    note = greedy("", [0] * 48, "length").note()
    assert note == f"empty text from 48 tokens (length): ids {[0] * 12}"
