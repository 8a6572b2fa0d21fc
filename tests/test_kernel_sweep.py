"""bench/kernel_timing/kernels_h200.py's pieces that run without a GPU."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.bench_modules import bench_module
from tests.mojo_ptx import sm90a_ptx

ROOT = Path(__file__).resolve().parents[1]


def test_load_only_fit_recovers_stream_and_fixed_cost() -> None:
    """kernels_h200.py's fit of the load-only diagnostics (what its table's
    last line reports): exact on rows made from a known line, blind to the
    GEMV variants' rows and to other row counts."""
    sweep = bench_module("kernels_h200")
    shapes = [(16384, 5376), (5376, 8192), (1536, 1152)]
    rows = []
    for n, k in shapes:
        mb = n * k * sweep.FP4_BYTES_PER_WEIGHT / 1e6
        rows.append(dict(n=n, k=k, m=1, variant="ld0", us=mb / 4.0 + 2.5))
        rows.append(dict(n=n, k=k, m=1, variant="ld8", us=mb / 4.0 + 3.5))  # slower: not the best
        rows.append(dict(n=n, k=k, m=1, variant="gv0", us=mb / 9.0))  # a GEMV row: ignored
        rows.append(dict(n=n, k=k, m=4, variant="ld0", us=1.0))  # another M: ignored
    stream, fixed, count = sweep.load_only_fit(rows)
    assert count == 3 and abs(stream - 4.0) < 1e-9 and abs(fixed - 2.5) < 1e-9
    assert sweep.load_only_fit(rows[:4]) is None  # one shape: no fit


def test_range_choice_adopts_only_what_is_faster_at_every_row_count() -> None:
    """A candidate replaces a range's original kernel only when it was timed
    at every M of the range, passed the float64 check, and took at most 0.96x
    the original's time at each; it is named by its op variant and kw."""
    rc = bench_module("range_choice")
    op_variants = {"gv0": 0, "a5": 1, "g4": 2, "b3s1": 3}
    rows = []

    def timed(variant: str, kw: int, us: dict[int, float], err: float = 1e-3, used: int | None = None) -> None:
        rows.extend(dict(n=64, k=128, m=m, variant=variant, kw_arg=kw, kw=used or kw, us=t, err=err)
                    for m, t in us.items())

    timed("gv0", 0, {1: 10.0, 2: 10.0, 4: 10.0, 8: 10.0})
    timed("gv0", 10, {1: 9.0, 2: 9.0, 4: 9.5, 8: 9.0})  # 0.95 at worst: adopted
    timed("b3s1", 2, {1: 5.0, 2: 5.0, 4: 5.0})  # fastest, but not timed at M=8: not eligible
    timed("a5", 0, {9: 10.0, 12: 10.0, 16: 10.0})
    timed("g4", 16, {9: 8.0, 12: 8.0, 16: 9.7})  # 0.97 at M=16: within the noise, not adopted
    timed("b3s1", 4, {9: 1.0, 12: 1.0, 16: 1.0}, err=0.5)  # wrong: never a candidate
    timed("ld0", 0, {9: 1.0, 12: 1.0, 16: 1.0})  # not a kernel the op can run
    choices = {c["range"]: c for c in rc.range_choices([rows], op_variants)}
    narrow, wide = choices["narrow"], choices["wide"]
    assert narrow["best"] == ("gv0", 10) and narrow["adopt"] and narrow["entry"] == (0, 10)
    assert abs(narrow["worst"] - 0.95) < 1e-12
    # a second sweep where the candidate is slower at one M: the worst over both decides
    again = [dict(r, us=r["us"] * (1.02 if r["variant"] == "gv0" and r["kw_arg"] == 10 and r["m"] == 4 else 1.0))
             for r in rows]
    both = {c["range"]: c for c in rc.range_choices([rows, again], op_variants)}
    assert not both["narrow"]["adopt"] and abs(both["narrow"]["worst"] - 0.95 * 1.02) < 1e-12
    assert wide["best"] == ("g4", 16) and not wide["adopt"] and wide["entry"] is None
    assert rc.tuned_entries(list(choices.values())) == {(64, 128): {"narrow": (0, 10)}}
    # an entry names the kw the harness launched, also where the kernel picked it
    timed("b3s1", 0, {9: 5.0, 12: 5.0, 16: 5.0}, used=4)
    wide = {c["range"]: c for c in rc.range_choices([rows], op_variants)}["wide"]
    assert wide["best"] == ("b3s1", 0) and wide["entry"] == (3, 4)
    lines = rc.choices_table(list(choices.values()), {(64, 128): "tiny"})
    assert "| tiny 64x128 | M 1-8 | 10.00 / 10.00 / 10.00 / 10.00 | gv0 (10) |" in lines[2]
    assert lines[3].endswith("| 0.97 | no |")


def test_sm90_tuned_is_what_the_stored_sweeps_justify() -> None:
    """The shipped table is the one range_choice.py derives from the two
    stored H200 sweeps, among the variants whose launch has run on a GPU: an
    entry edited by hand, or a sweep replaced without the table, fails here."""
    from dataclasses import asdict

    from attnquant.graph.nvfp4 import sm90

    rc, sweep = bench_module("range_choice"), bench_module("kernels_h200")
    results = ROOT / "bench" / "results"
    sweeps = [rc.read_sweep(results / f"2026-12-04-h200-run30-kernels-{s}.jsonl.gz") for s in "ab"]
    choices = rc.range_choices(sweeps, sweep.tunable_variants())
    shipped = {shape: {r: v for r, v in asdict(t).items() if v} for shape, t in sm90.SM90_TUNED.items()}
    assert rc.tuned_entries(choices, sm90.SM90_GPU_CHECKED) == shipped
    # every variant the sweeps would adopt has run through the op
    assert rc.tuned_entries(choices) == shipped


def test_gated_kernel_check_flow_runs_on_cpu() -> None:
    """bench/kernel_timing/gated_h200.py --dry-run: a reference in place of the
    gated kernels (it reads the interleaved, prepared bytes the way a kernel
    must), checked against gelu_tanh(x Wg^T) * (x Wu^T) in float64, then
    timed; its table names every kernel each range of M runs. A dry run
    checks the script's flow and the layout, not the kernels (the H200 does)."""
    import subprocess
    import sys

    from attnquant.max_compat import child_environment

    script = ROOT / "bench" / "kernel_timing" / "gated_h200.py"
    r = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=300,
                       env=child_environment(), cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "RESULT OK" in r.stdout
    table = [line for line in r.stdout.splitlines() if line.startswith("| dry")]
    gated = bench_module("gated_h200")
    assert len(table) == sum(len(gated.kernels_for(m)) for m in gated.TIME_MS)
    checks = [line for line in r.stdout.splitlines() if line.startswith("check dry")]
    assert len(checks) == sum(len(gated.kernels_for(m)) for m in gated.CHECK_MS)


@pytest.mark.max
def test_the_sweep_harness_builds_every_kernel_it_names_and_gh0_loads_the_scale_first(tmp_path: Path) -> None:
    """bench/kernel_timing/nvfp4_ptx_harness.mojo compiles for sm_90a (as
    build_ptx.sh does) into one PTX file per kernel, and every kernel the sweep
    can launch is among them; gh0 (EARLY_SCALE) loads the global scale before
    its weight loads, gv0 after them."""
    sweep = bench_module("kernels_h200")
    ptx = {}
    for path in sm90a_ptx(ROOT / "bench" / "kernel_timing" / "nvfp4_ptx_harness.mojo", tmp_path):
        match = re.match(r"h_nvfp4_ptx_harness_([a-z]+[0-9]*([a-z][0-9])?)_", path.name)
        assert match, path.name
        ptx[match.group(1)] = path.read_text()
    assert (set(sweep.VARIANTS) | set(sweep.GATED)) - set(sweep.ASSEMBLED_FROM) <= set(ptx)
    assert set(sweep.ASSEMBLED_FROM.values()) <= set(ptx)

    def scale_before_weights(text: str) -> bool:
        return text.index("ld.global.nc.b32") < text.index("ld.global.nc.L1::no_allocate.v4.u32")

    assert scale_before_weights(ptx["gh0"]) and not scale_before_weights(ptx["gv0"])
    # Programmatic dependent launch (pdl_chain_h200.py): gd0/zd0 let the next kernel start and
    # load nothing before griddepcontrol.wait; rd0 loads only its two gammas (weights) first;
    # the kernels launched without PDL have neither instruction.
    # ge0/ze0 (the form the op does not take) issue their first batch's weight loads before it.
    # gl0/zl0/rl0 (nor this one) let the next kernel start only after their last store.
    late = ("gl0", "zl0", "rl0")
    for name, loads_before in (("gd0", 0), ("zd0", 0), ("rd0", 2), ("ge0", None), ("ze0", None),
                               ("gl0", 0), ("zl0", 0), ("rl0", 2)):  # fmt: skip
        text = ptx[name]
        assert text.count("griddepcontrol.launch_dependents") == 1, name
        trigger = text.index("griddepcontrol.launch_dependents")
        if name in late:
            assert trigger > text.rindex("st.global"), name
        else:
            assert trigger < text.index("griddepcontrol.wait") and trigger < text.index("ld.global"), name
        if loads_before is None:  # a wait after a batch of weight words (and one for a slice too short for it)
            before, after = text.rsplit("griddepcontrol.wait", 1)
            assert before.count("ld.global.nc.L1::no_allocate.v4.u32") >= 4 and after.count("ld.global") > 0, name
        else:
            assert text.count("griddepcontrol.wait") == 1, name
            before, after = text.split("griddepcontrol.wait", 1)
            assert before.count("ld.global") == loads_before and after.count("ld.global") > 0, name
    assert not any("griddepcontrol" in ptx[name] for name in ("gv0", "zv0", "rn0"))
    # What the previous kernel wrote is loaded coherently after the wait (pdl.mojo): never
    # through the read-only path, whose loads ptxas may move above griddepcontrol.wait. The
    # kernels launched without PDL keep that path. readonly_loads.sed (build_ptx.sh's controls
    # gdx, zdx, rdx) puts exactly those loads back on it.
    sed = ROOT / "bench" / "kernel_timing" / "readonly_loads.sed"
    for name in ("gd0", "zd0", "rd0", "ge0", "ze0", "gl0", "zl0", "rl0", "p3s1", "p3s2", "p4s4"):
        after = ptx[name].split("griddepcontrol.wait", 1)[1]
        assert "ld.global.nc.v4.b32" not in after and "ld.global.v4.b32" in after, name
    for name in ("gv0", "zv0", "rn0"):
        assert "ld.global.nc.v4.b32" in ptx[name] and "ld.global.v4.b32" not in ptx[name], name
    for name in ("gd0", "zd0", "rd0"):
        made = subprocess.run(["sed", "-E", "-f", str(sed)], input=ptx[name], capture_output=True, text=True, check=True).stdout
        assert "ld.global.v4.b32" not in made and made.count("ld.global.nc.v4.b32") > ptx[name].count("ld.global.nc.v4.b32"), name
    # l2_prefetch_h200.py's gap kernel: L2 prefetches, then a timed wait, and no load of its own.
    assert "cp.async.bulk.prefetch.L2.global" in ptx["pfw"] and "%globaltimer" in ptx["pfw"]
    assert "ld.global" not in ptx["pfw"]
    # gvn (nvfp4_gemv_sm90_next_kernel) is gv0 plus the tail prefetch; gv0 itself prefetches nothing.
    assert ptx["gvn"].count("cp.async.bulk.prefetch.L2.global") == 2 and "prefetch" not in ptx["gv0"]
    # The aligned kernels are built for K % 64 == 0 (ALIGNED_K): no activation clamp in
    # their k loop, which their guarded twins (what the op runs for other K) keep.
    for aligned, guarded in sweep.ALIGNED_ONLY.items():
        if guarded is not None and aligned not in sweep.ASSEMBLED_FROM:
            assert ptx[aligned].count("min.s64") < ptx[guarded].count("min.s64"), aligned


def test_an_aligned_only_kernel_gives_way_to_its_guarded_twin_when_k_is_not_a_multiple_of_64() -> None:
    """kernels_h200.Kernels.gemv launches what the op's _launch_gemv would:
    gv0 / g4 for K % 64 == 0, gvg / gwg otherwise; a gated kernel with no
    guarded twin refuses such a K instead of reading activations past it."""
    import torch

    sweep = bench_module("kernels_h200")
    launched = []
    ks = object.__new__(sweep.Kernels)  # no CuPy: only the launch decision is under test
    ks.raw = lambda name, grid, block, args, smem=0: launched.append(name)
    y, x = torch.empty(1, 48), torch.empty(1, 80)
    codes, scales = torch.empty(48, 2 * 32, dtype=torch.uint8), torch.empty(48, 2 * 4, dtype=torch.uint8)
    for name, k, want in (("gv0", 128, "gv0"), ("gv0", 80, "gvg"), ("g4", 80, "gwg"), ("a5", 80, "a5"),
                          ("r7s2", 128, "r7s2"), ("r7s2", 80, "r7g2")):
        ks.gemv(name, y, x, codes, scales, None, 1, 48, k)
        assert launched[-1] == want, (name, k, launched[-1])
    with pytest.raises(ValueError, match="zv0 needs K % 64 == 0, got K=80"):
        ks.gemv("zv0", y, x, codes, scales, None, 1, 24, 80)


def test_split_k_and_pdl_kernels_launch_with_their_cluster_and_pdl_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness's split-K kernels carry no .reqnctapercluster (their entry is a
    wrapper), so Kernels.raw launches them through cuLaunchKernelEx with the
    cluster shape (1, 1, SK), PDL kernels with programmatic serialization, and
    the attribute array is laid out as the driver's CUlaunchAttribute."""
    import ctypes
    import struct
    from types import SimpleNamespace

    sweep = bench_module("kernels_h200")
    assert sweep.launch_attrs(False, 1) == []
    assert sweep.launch_attrs(False, 4) == [(4, (1, 1, 4))]
    assert sweep.launch_attrs(True, 2) == [(6, (1,)), (4, (1, 1, 2))]
    arr = sweep.attr_array(sweep.launch_attrs(True, 2))
    assert ctypes.sizeof(sweep._LaunchAttr) == 72  # id, 4 bytes of padding, a 64-byte union
    assert [a.id for a in arr] == [6, 4]
    assert bytes(arr[1].value[:12]) == struct.pack("<3I", 1, 1, 2) and bytes(arr[0].value[:4]) == struct.pack("<I", 1)

    launched = []
    monkeypatch.setattr(sweep, "launch_ex", lambda fn, stream, grid, block, smem, args, attrs: launched.append((fn, attrs)))
    monkeypatch.setattr(sweep.torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    ks = object.__new__(sweep.Kernels)  # no CuPy: only the launch path is under test
    ks.funcs = {"r7s2": SimpleNamespace(ptr=11), "p4s4": SimpleNamespace(ptr=12)}
    for name in ks.funcs:
        ks.raw(name, (1, 1, 2), (32, 1, 1), (0,))
    assert launched == [(11, [(4, (1, 1, 2))]), (12, [(6, (1,)), (4, (1, 1, 4))])]


def test_the_sweep_times_only_the_cells_asked_for_and_refuses_a_bad_one(tmp_path: Path) -> None:
    """--cells N:K:M,...: a shape outside the sweep's lists (e.g. the 31B's
    NVFP4 output head) is checked and timed at each M given, nothing else."""
    import subprocess
    import sys

    from attnquant.max_compat import child_environment

    script = ROOT / "bench" / "kernel_timing" / "kernels_h200.py"

    def sweep(cells: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--dry-run", "--ncu", "off", "--budget", "100",
                               "--out", str(tmp_path), "--cells", cells],
                              capture_output=True, text=True, timeout=300, env=child_environment(), cwd=ROOT)  # fmt: skip

    r = sweep("64:320:1,64:320:3")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    best = [line.split(": ")[0] for line in r.stdout.splitlines() if line.startswith("BEST")]
    assert best == ["BEST cell [64,320] M=1", "BEST cell [64,320] M=3"]
    bad = sweep("64:321:1")
    assert bad.returncode != 0 and "'64:321:1'" in bad.stderr and "multiple of 16" in bad.stderr


def test_l2_prefetch_prefix_and_flow_run_on_cpu(tmp_path: Path) -> None:
    """bench/kernel_timing/l2_prefetch_h200.py: a gap prefetches the first
    n-tiles' share of codes and scales alike, in whole 16-byte pieces, never
    past the weight; --dry-run goes through both parts and records them."""
    import json
    import subprocess
    import sys

    import torch

    from attnquant.max_compat import child_environment

    l2 = bench_module("l2_prefetch_h200")
    w = l2.Weight(64, 320, torch.Generator().manual_seed(0))
    assert w.nbytes == 64 * 320 // 2 + 64 * 320 // 16
    cb, sb = w.prefix(w.nbytes // 2)
    assert cb % 16 == 0 and sb % 16 == 0 and abs(cb / w.codes.numel() - 0.5) < 0.01 and abs(sb / w.scales.numel() - 0.5) < 0.02
    assert w.prefix(10 * w.nbytes) == (w.codes.numel(), w.scales.numel())
    assert w.prefix(0) == (0, 0)
    script = ROOT / "bench" / "kernel_timing" / "l2_prefetch_h200.py"
    r = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path), "--gaps", "0,5"],
                       capture_output=True, text=True, timeout=300, env=child_environment(), cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "l2_prefetch_h200.jsonl").read_text().splitlines()]
    assert [(x["gap_us"], x["cap_mb"]) for x in rows if x["part"] == "single"] == [(0, 24), (0, 40), (5, 24), (5, 40)]
    chain = [(x["policy"], x["cap_mb"]) for x in rows if x["part"] == "chain"]
    assert chain == [("none", 0), ("gap", 24), ("gap", 40), ("tail", 24), ("tail", 40)]
    bad = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path), "--layer-gaps", "1,2"],
                         capture_output=True, text=True, timeout=300, env=child_environment(), cwd=ROOT)  # fmt: skip
    assert bad.returncode != 0 and "'1,2'" in bad.stderr and "four values" in bad.stderr


def test_pdl_chain_checks_and_times_both_modes_on_cpu(tmp_path: Path) -> None:
    """bench/kernel_timing/pdl_chain_h200.py --dry-run: the reference norm
    (float64 with the graph's roundings), every check, the plain chain twice
    (is the baseline repeatable) and each mode's chain at each M and gap run,
    one row per (M, gap), and RESULT OK."""
    import json
    import subprocess
    import sys

    from attnquant.max_compat import child_environment

    script = ROOT / "bench" / "kernel_timing" / "pdl_chain_h200.py"
    r = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path), "--rows", "1", "3", "--geometry", "4b"],
                       capture_output=True, text=True, timeout=300, env=child_environment(), cwd=ROOT)  # fmt: skip
    assert r.returncode == 0 and "RESULT OK" in r.stdout, (r.stdout + r.stderr)[-3000:]
    for run in ("plain again", "pdl", "early", "late", "readonly"):
        assert r.stdout.count(f": {run} equal to plain in every buffer: True") == 2, (run, r.stdout[-3000:])
    for mode in ("plain", "pdl", "early", "late", "readonly"):
        assert r.stdout.count(f"replayed 2 times: {mode} equal to the eager plain chain in 2 of 2") == 2, (mode, r.stdout[-3000:])
    rows = [json.loads(line) for line in (tmp_path / "pdl_chain_h200.jsonl").read_text().splitlines()]
    assert [(x["geometry"], x["m"], x["gap_us"]) for x in rows] == [
        ("4b", 1, 12.0), ("4b", 1, 0.0), ("4b", 3, 12.0), ("4b", 3, 0.0)]


def test_read_ceiling_fits_a_line_and_its_flow_runs_on_cpu(tmp_path: Path) -> None:
    """bench/kernel_timing/read_ceiling_h200.py: the fit recovers a known
    stream rate and fixed cost; --dry-run times every reader on each shape
    and prints one table row per shape and one fit per reader family."""
    import json
    import subprocess
    import sys

    from attnquant.max_compat import child_environment

    kh = bench_module("kernels_h200")
    stream, fixed = kh.stream_fit([(mb, mb / 3.0 + 2.5) for mb in (10.0, 50.0, 130.0)])  # MB / (TB/s) = us
    assert abs(stream - 3.0) < 1e-9 and abs(fixed - 2.5) < 1e-9
    assert kh.stream_fit([(10.0, 5.0)]) is None
    script = ROOT / "bench" / "kernel_timing" / "read_ceiling_h200.py"
    r = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, env=child_environment(), cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "read_ceiling_h200.jsonl").read_text().splitlines()]
    readers = ["sum", "copy", "cublas", "ld0 kw4", "ld0 kw8", "gv0 kw4", "gv0 kw8"]
    assert [x["reader"] for x in rows] == readers * 2
    assert len([line for line in r.stdout.splitlines() if line.startswith("| cell |")]) == 2
    fits = [line.split(":")[0].strip() for line in r.stdout.splitlines() if "fixed" in line and "per launch" in line]
    assert fits == ["sum", "copy", "cublas", "ld0", "gv0"]
