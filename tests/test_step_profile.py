"""The decode-step profiler's analysis (bench/harness/step_profile.py): ncu's
table in, one decode step's kernels and their time by kind out."""

from __future__ import annotations

import gzip
import subprocess
from pathlib import Path

import pytest

from tests.bench_modules import bench_module

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","gpu__time_duration.sum"')  # fmt: skip


def _table(kernels: list[tuple[str, float]], unit: str = "nsecond", first_id: int = 0) -> list[str]:
    rows = [HEADER, '"","","","","","","","","","","",' + f'"{unit}"']
    for i, (name, value) in enumerate(kernels, first_id):
        rows.append(f'"{i}","7","python3","h","{name}","1","13","(128, 1, 1)","(66, 1, 1)","0","9.0","{value}"')
    return rows


def _decode(steps: int, context: int = 9) -> list[tuple[str, float]]:
    """A prefill, then ``steps`` decode steps of two layers; attention's name
    carries the context length, as a kernel's template number may."""
    kernels = [("sm90_matmul_prefill", 50_000.0), ("mha_prefill", 9_000.0)]
    for step in range(steps):
        kernels.append(("gather_r2_w8_b256", 2_000.0))
        for layer in range(2):
            kernels += [("algorithm_gpu_rowwise__BlockK_f525", 2_500.0),
                        (f"mojo_pkg_99_9a9c{layer}", 18_000.0 + 100 * step),
                        (f"sm90_mha_depth256_ctx{context + step}", 6_000.0),
                        ("mogg_foreach_r1_w2", 1_500.0)]  # fmt: skip
        kernels += [("mojo_pkg_99_head", 190_000.0), ("topk_topp_sampling_from_prob", 9_000.0)]
    return kernels


def test_the_step_is_found_and_its_time_split_by_kind() -> None:
    profile = bench_module("step_profile")
    text = "\n".join(["==PROF== Connected to process 7", *_table(_decode(6)), "==PROF== Disconnected"])
    kernels = profile.read_kernels(text)
    assert len(kernels) == 2 + 6 * 11
    assert profile.decode_period(kernels) == 11
    assert len(profile.steps(kernels, 11)) == 6
    out = profile.report(kernels, layers=2)
    assert "the decode step is 11 kernels, found 6 times" in out
    assert "| ours (attnquant's Mojo ops) | 3 | 226.5 |" in out  # 2 x 18.25 (the median over steps) + 190
    assert "| attention | 2 | 12.0 |" in out and "| row-wise (norms) | 2 | 5.0 |" in out
    assert "| sampling | 1 | 9.0 |" in out
    assert "| copy / gather | 1 | 2.0 |" in out and "| elementwise / other | 2 | 3.0 |" in out
    assert "| all | 11 | 257.5 |" in out
    assert "5.5 kernels, 128.8 µs" in out


def test_a_captured_step_of_one_graph_is_found_and_its_spread_reported() -> None:
    """--capture: ncu times each captured graph whole, so a decode step may be
    one workload (the graph) repeating; the spread over the steps is what a
    difference between two builds must exceed."""
    profile = bench_module("step_profile")
    eager = [("sm90_matmul_prefill", 50_000.0), ("mha_prefill", 9_000.0)]
    graphs = [("graph_exec_1", 1_500_000.0 + 10_000.0 * (step % 10)) for step in range(40)]
    kernels = profile.read_kernels("\n".join(_table(eager + graphs)))
    out = profile.report(kernels, layers=26, captured=True)
    assert "the decode step is 1 workloads (a captured graph is one), found 40 times" in out
    assert "the step over its 40 occurrences: median 1545.0 µs, 10th-90th percentile 1510.0-1580.0 µs" in out
    assert "the captured graph(s) of the step over its 40 occurrences: median 1545.0 µs" in out
    assert "per layer (the step / 26, the head and sampling included): 59.4 µs" in out
    assert "| captured graph (--capture) | 1 | 1545.0 | 100 % |" in out


def test_a_captured_graphs_time_is_reported_apart_from_the_kernels_beside_it() -> None:
    """Outside its graph a captured step still launches kernels (the sampler,
    the overlap pipeline's copies), which ncu's graph mode times with an
    overhead: the graph's own spread is printed beside the step's."""
    profile = bench_module("step_profile")
    workloads = []
    for step in range(20):
        workloads += [("scatter_nd_r2", 130_000.0 + 1_000.0 * (step % 5)), ("graph", 1_200_000.0 + 2_000.0 * step),
                      ("topk_topp_sampling_from_prob", 150_000.0)]  # fmt: skip
    out = profile.report(profile.read_kernels("\n".join(_table(workloads))), layers=None, captured=True)
    assert "the decode step is 3 workloads (a captured graph is one), found 20 times" in out
    assert "the step over its 20 occurrences: median 1501.0 µs" in out
    assert "the captured graph(s) of the step over its 20 occurrences: median 1219.0 µs, " \
           "10th-90th percentile 1204.0-1234.0 µs" in out
    assert "captured graph(s)" not in profile.report(profile.read_kernels("\n".join(_table(_decode(6)))), layers=2)


def test_capture_turns_capture_on_and_times_each_graph_whole(tmp_path: Path) -> None:
    profile = bench_module("step_profile")
    ran: list[list[str]] = []

    def run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        ran.append(command)
        (tmp_path / "ncu.csv").write_text("\n".join(_table([("graph_exec_1", 1_000.0)] * 8)))
        return subprocess.CompletedProcess(command, 0)

    for capture, tokens in ((True, 64), (False, 24)):
        args = profile.argparse.Namespace(model=tmp_path, out=tmp_path, prompt="p", memory_fraction=0.5,
                                          capture=capture, tokens=tokens, gpu_lock=None, layers=None)  # fmt: skip
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(profile.subprocess, "run", run)
            profile.profile_once(args, {})
    with_capture, without = ran
    assert "--device-graph-capture" in with_capture and "--no-device-graph-capture" not in with_capture
    assert with_capture[with_capture.index("--graph-profiling") + 1] == "graph"
    assert with_capture[with_capture.index("--max-new-tokens") + 1] == "64"
    assert "--no-device-graph-capture" in without and "--graph-profiling" not in without


def test_microsecond_units_are_scaled_and_the_largest_process_table_is_read(tmp_path: Path) -> None:
    profile = bench_module("step_profile")
    small = _table([("warmup", 1.0)])
    big = _table([(name, ns / 1e3) for name, ns in _decode(4)], unit="usecond")
    path = tmp_path / "kernels.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join([*small, "==PROF== other process", *big]))
    kernels = profile.read_kernels(profile.load_text(path))
    assert len(kernels) == 2 + 4 * 11 and kernels[0].ns == pytest.approx(50_000.0)


def test_a_run_with_no_repeating_step_says_what_to_do() -> None:
    profile = bench_module("step_profile")
    kernels = profile.read_kernels("\n".join(_table([(f"k{i}x", 1.0) for i in range(3)] + [("a", 1.0), ("b", 2.0)])))
    with pytest.raises(SystemExit, match="generate more tokens"):
        profile.decode_period(kernels)


def test_no_table_is_an_error_naming_ncu() -> None:
    with pytest.raises(SystemExit, match="did ncu profile anything"):
        bench_module("step_profile").read_kernels("==PROF== ERROR: no kernels were profiled\n")


def test_a_cell_of_a_leases_collected_tables_is_read_by_name(tmp_path: Path) -> None:
    """The lease's collect puts every cell's table in one file under ``== .../profile-CELL/``."""
    profile = bench_module("step_profile")
    path = tmp_path / "profile-kernels.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(["== /tmp/h200-lease/profile-nvfp4/", *_table(_decode(4)),
                           "== /tmp/h200-lease/profile-bf16/", *_table(_decode(5))]))  # fmt: skip
    assert len(profile.read_kernels(profile.load_text(path, "nvfp4"))) == 2 + 4 * 11
    assert len(profile.read_kernels(profile.load_text(path, "bf16"))) == 2 + 5 * 11
    with pytest.raises(SystemExit, match=r"no cell 'nvfp4-inlined' .* \['bf16', 'nvfp4'\]"):
        profile.load_text(path, "nvfp4-inlined")
