"""The H200 lease script: its Python calls (and those of the decode
experiment's h200_session.sh) use only options their scripts accept, and its
phases run in the order and with the prompts they should (the script run with
stub commands).

A lease is the one chance a session has to run these commands, and an option
a script no longer takes ends that phase at its first line (argparse exits
with code 2), minutes into a lease and unseen until the files come back.
"""

from __future__ import annotations

import gzip
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEASE = ROOT / "bench" / "harness" / "h200_lease.sh"
SESSION = LEASE.parent / "h200_session.sh"  # the decode experiment's script, same rules
HERE = LEASE.parent

# Where a command's own arguments end (redirections, pipes, the next command).
_END = re.compile(r"^(\d?>|>|<|\||;|&|&&|\|\||\))")


def _logical_lines(text: str) -> list[str]:
    return text.replace("\\\n", " ").splitlines()


def python_calls(text: str) -> list[tuple[list[str], list[str]]]:
    """(how to ask for --help, options passed) for every python3 call."""
    calls = []
    for line in _logical_lines(text):
        for match in re.finditer(r"python3 (\"\$HERE/[^\"]+\.py\"|-m attnquant \w[\w-]*)", line):
            target = match.group(1)
            if target.startswith("-m"):
                command = [sys.executable, "-m", "attnquant", target.split()[-1]]
            else:
                command = [sys.executable, str((HERE / target.strip('"').removeprefix("$HERE/")).resolve())]
            options = []
            for token in shlex.split(line[match.end():], posix=False):
                if _END.match(token):
                    break
                if token.startswith("--"):
                    options.append(token.split("=", 1)[0])
            calls.append((command, options))
    return calls


def test_the_script_has_python_calls() -> None:
    calls = python_calls(LEASE.read_text())
    scripts = {Path(c[1]).name if len(c) == 2 else " ".join(c[2:]) for c, _ in calls}
    assert {"batch_invariance.py", "serve_benchmark.py", "make_random_gemma3.py", "kernels_h200.py"} <= scripts
    assert sum(len(options) for _, options in calls) > 40


def test_a_removed_option_is_caught() -> None:
    calls = python_calls('  python3 "$HERE/../checkpoints/make_random_gemma3.py" "$W/x" --layers 2 \\\n'
                         '    --device cuda:0 2>&1 | tail -1\n')
    assert calls[0][1] == ["--layers", "--device"]
    assert calls[0][0][-1].endswith("bench/checkpoints/make_random_gemma3.py")


@pytest.mark.parametrize("command, options", python_calls(LEASE.read_text()) + python_calls(SESSION.read_text()),
                         ids=lambda v: Path(v[-1]).name if isinstance(v, list) and v and v[0] == sys.executable else "")
def test_every_option_is_accepted(command: list[str], options: list[str]) -> None:
    assert Path(command[1]).exists() or command[1] == "-m", command
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    accepted = set(re.findall(r"--[\w-]+", done.stdout))
    unknown = [o for o in options if o not in accepted]
    assert not unknown, f"{' '.join(command[1:])} does not accept {unknown}"


def _run_with_stubs(tmp_path: Path, phases: str, **env: str) -> tuple[list[str], list[str]]:
    """Runs the lease script with python3 and nvidia-smi replaced by stubs
    that log their arguments: (progress lines, python3 calls), in order; its
    output goes to work/session.log, as with `start`. A call
    whose arguments hold STUB_SLOW takes 12 s (the script polls every 5 s)."""
    stubs, work = tmp_path / "stubs", tmp_path / "work"
    stubs.mkdir(parents=True)
    work.mkdir()
    calls = work / "calls.log"
    (stubs / "python3").write_text(f'#!/bin/bash\necho "python3 $* [cache ${{XDG_CACHE_HOME:-}}]" >> {calls}\n'
                                    '[[ -n "${STUB_SLOW:-}" && "$*" == *"$STUB_SLOW"* ]] && sleep 12\nsleep 0.3\n')
    (stubs / "nvidia-smi").write_text("#!/bin/bash\necho gpu\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "PHASES": phases,
           "WORK": str(work), "OUT": str(tmp_path / "out"), **env}  # fmt: skip
    ran = subprocess.run(["bash", str(LEASE), "run"], env=env, check=True, timeout=120, capture_output=True, text=True)
    (work / "session.log").write_text(ran.stdout)  # where `start` sends it
    progress = [line.split(" ", 1)[1] for line in (work / "progress.log").read_text().splitlines()]
    return progress, calls.read_text().splitlines() if calls.exists() else []


def test_phases_after_mtp_wait_for_it_and_random_models_get_word_prompts(tmp_path: Path) -> None:
    """Servers compiling beside MTP's slow both; a random checkpoint's word
    tokenizer reads English prompts as <unk> (every completion then alike)."""
    progress, calls = _run_with_stubs(tmp_path, "mtp invariance padding big4b")
    assert progress.index("mtp done") < progress.index("padding") < progress.index("padding done")
    assert progress.index("padding done") < progress.index("invariance") < progress.index("invariance done")
    assert progress.index("invariance done") < progress.index("big4b") and progress[-1] == "all done"
    invariance = {c.split("--model ")[1].split()[0].rsplit("/", 1)[-1]: c for c in calls if "batch_invariance.py" in c}
    assert set(invariance) == {"g4", "g3-1b", "g3-270m"}
    assert "--prompt-words" in invariance["g4"] and "--prompt-words" in invariance["g3-1b"]
    assert "--prompt-words" not in invariance["g3-270m"]  # the real 270M's own tokenizer
    padding = next(c for c in calls if "serve_benchmark.py" in c and "g3-1b" in c)
    assert "ATTNQUANT_LM_HEAD=nvfp4" in padding


def test_the_4b_geometry_waits_for_mtp(tmp_path: Path) -> None:
    """Its servers compiling beside MTP's outlasted the machine twice: it starts after."""
    progress, _ = _run_with_stubs(tmp_path, "mtp big4b", STUB_SLOW="batch_invariance.py")
    assert progress.index("mtp done") < progress.index("big4b") < progress.index("big4b done"), progress


def test_mtp_phase_drafts_from_the_oracle_with_capture_and_keeps_maxs_path(tmp_path: Path) -> None:
    """The oracle cell runs as users serve (capture on; its drafter wraps the replay too),
    reads the file batch_invariance writes, and keeps the device's PYTHONPATH (MAX lives there)."""
    from tests.bench_modules import bench_module

    _, calls = _run_with_stubs(tmp_path, "mtp", PYTHONPATH="/tmp/site")
    mtp = next(c for c in calls if "batch_invariance.py" in c)
    drafts = mtp.split("--oracle-drafts ")[1].split()[0]
    [spec] = [token for token in mtp.split() if "MTP_ORACLE_DRAFTS=" in token]
    cell = bench_module("serve_benchmark").Cell.parse(spec)
    assert cell.capture and cell.drafted_tokens == 3
    assert cell.env[bench_module("oracle_drafter").ENV_DRAFTS] == drafts
    path = cell.env["PYTHONPATH"].split(":")
    assert (Path(path[0]) / "sitecustomize.py").is_file() and "/tmp/site" in path


def test_invariance_models_picks_the_checkpoints(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "invariance", INVARIANCE_MODELS="1b")
    models = [c.split("--model ")[1].split()[0].rsplit("/", 1)[-1] for c in calls if "batch_invariance.py" in c]
    assert models == ["g3-1b"]


def test_invariance_gated_adds_the_gated_cell_to_each_model(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "invariance", INVARIANCE_GATED="1")
    runs = [c for c in calls if "batch_invariance.py" in c]
    assert len(runs) == 2
    for run in runs:
        cells = run.split("--cells ")[1].split(" --")[0].split()
        assert [c.split("+MODULAR")[0] for c in cells] == [
            "attnquant-bf16:on", "attnquant-nvfp4:on", "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1"]


def test_invariance_pdl_adds_the_pdl_cell_after_the_gated_one(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "invariance", INVARIANCE_GATED="1", INVARIANCE_PDL="1")
    runs = [c for c in calls if "batch_invariance.py" in c]
    assert len(runs) == 2
    for run in runs:
        cells = run.split("--cells ")[1].split(" --")[0].split()
        assert [c.split("+MODULAR")[0] for c in cells] == [
            "attnquant-bf16:on", "attnquant-nvfp4:on", "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1",
            "attnquant-nvfp4:on+ATTNQUANT_PDL=1"]


def test_invariance_long_gives_the_270m_long_prompts_and_the_random_model_its_words(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "invariance", INVARIANCE_LONG="1")
    runs = {c.split("--model ")[1].split()[0].rsplit("/", 1)[-1]: c for c in calls if "batch_invariance.py" in c}
    assert "--long-prompts" in runs["g3-270m"] and "--prompt-words" not in runs["g3-270m"]
    assert "--prompt-words" in runs["g3-1b"] and "--long-prompts" not in runs["g3-1b"]


def test_sm90_cell_adds_a_forced_variant_to_the_padding_phase(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "padding", SM90_CELL="3:8:1:1")
    padding = next(c for c in calls if "serve_benchmark.py" in c)
    assert "attnquant-nvfp4:on+ATTNQUANT_SM90_VARIANT=3:8:1:1+MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT=8" in padding


def test_tuned_phase_times_nvfp4_without_and_with_the_gated_epilogue_at_1_and_16(tmp_path: Path) -> None:
    """Beside the servers, every entry (and TUNED_ALSO's candidate) is checked through MAX."""
    progress, calls = _run_with_stubs(tmp_path, "tuned", TUNED_ALSO="640x1024:wide=2:8", SM90_CELL="3:8:1:1")
    check = next(c for c in calls if "sm90_tuned_h200.py" in c)
    assert check.split("sm90_tuned_h200.py ")[1].startswith("--also 640x1024:wide=2:8")
    assert progress.index("checkpoints") < progress.index("tuned") < progress.index("tuned done")
    tuned = next(c for c in calls if "serve_benchmark.py" in c)
    assert "--concurrency 1 16" in tuned and "--max-batch-size 16" in tuned and "g3-1b" in tuned
    cells = tuned.split("--cells ")[1].split(" --")[0].split()
    assert [c.split("+MODULAR")[0] for c in cells] == [
        "attnquant-bf16:on", "attnquant-nvfp4:on", "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1",
        "attnquant-nvfp4:on+ATTNQUANT_SM90_VARIANT=3:8:1:1",
    ]


def test_tuned_head_and_rounds_add_the_nvfp4_head_cell_measured_in_turn(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "tuned", TUNED_HEAD="1", ROUNDS="5", TRIALS="1")
    tuned = next(c for c in calls if "serve_benchmark.py" in c)
    assert "--trials 1 --rounds 5" in tuned
    cells = tuned.split("--cells ")[1].split(" --")[0].split()
    assert [c.split("+MODULAR")[0] for c in cells] == [
        "attnquant-bf16:on", "attnquant-nvfp4:on", "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1",
        "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4",
    ]


def test_tuned_no_bf16_leaves_the_bf16_cell_out(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "tuned", TUNED_NO_BF16="1")
    tuned = next(c for c in calls if "serve_benchmark.py" in c)
    cells = tuned.split("--cells ")[1].split(" --")[0].split()
    assert [c.split("+MODULAR")[0] for c in cells] == [
        "attnquant-nvfp4:on", "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1"]


def test_g4tpot_times_the_31b_geometry_against_ours_bf16_uncaptured_at_one_request(tmp_path: Path) -> None:
    """The 31B TPOT target's comparison: 30 layers, one session, c=1; the NVFP4
    head beside it; every arena together fits the card (~139 GiB)."""
    progress, calls = _run_with_stubs(tmp_path, "g4tpot")
    assert progress == ["g4tpot", "g4tpot done", "all done"]  # no 1B checkpoints written for it
    assert "make_random_gemma4.py" in calls[1] and calls[1].split("--layers ")[1].startswith("30")
    bench = next(c for c in calls if "serve_benchmark.py" in c)
    assert "--concurrency 1 " in bench and "--sessions 1" in bench and "g4-tpot" in bench
    cells = bench.split("--cells ")[1].split(" --")[0].split()
    assert [c.split("+ARENA_GIB")[0] for c in cells] == [
        "attnquant-nvfp4:on", "attnquant-bf16:off", "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4"]
    assert sum(int(c.split("+ARENA_GIB=")[1]) for c in cells) <= 130


def test_g4tpot_head_only_fits_beside_the_tuned_phase_and_the_gated_kernels_go_first(tmp_path: Path) -> None:
    """G4_TPOT_HEAD_ONLY drops the bf16-head NVFP4 cell: its two arenas and the
    tuned phase's three 1B servers (8 % of the card each) fit the card together;
    the gated-kernel check takes the card before any server times."""
    progress, calls = _run_with_stubs(tmp_path, "gatedkernels g4tpot tuned", G4_TPOT_HEAD_ONLY="1")
    assert "import max.nn.kv_cache" in calls[0], "MAX's import cache is built before any server starts"
    assert "gated_h200.py" in calls[1] and progress[0] == "gatedkernels"
    bench = next(c for c in calls if "serve_benchmark.py" in c and "g4-tpot" in c)
    cells = bench.split("--cells ")[1].split(" --")[0].split()
    assert [c.split("+ARENA_GIB")[0] for c in cells] == ["attnquant-bf16:off", "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4"]
    assert sum(int(c.split("+ARENA_GIB=")[1]) for c in cells) + 3 * 0.08 * 139 <= 130
    assert "tuned done" in progress and "g4tpot done" in progress


def test_g4tpot_ungated_adds_the_default_without_the_gated_epilogue_measured_in_turn(tmp_path: Path) -> None:
    """At the 31B size ATTNQUANT_GATED_GEMV=auto gates gate|up: the comparison
    cell turns it off; all three arenas still fit the card (~139 GiB)."""
    _, calls = _run_with_stubs(tmp_path, "g4tpot", G4_TPOT_HEAD_ONLY="1", G4_TPOT_UNGATED="1", ROUNDS="4", TRIALS="1")
    bench = next(c for c in calls if "serve_benchmark.py" in c)
    assert "--trials 1 --rounds 4" in bench
    cells = bench.split("--cells ")[1].split(" --")[0].split()
    assert [c.split("+ARENA_GIB")[0] for c in cells] == [
        "attnquant-bf16:off", "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4",
        "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ATTNQUANT_GATED_GEMV=0"]
    assert sum(int(c.split("+ARENA_GIB=")[1]) for c in cells) <= 130


def test_cachecheck_times_the_carried_cache_then_a_cold_one_before_anything_else(tmp_path: Path) -> None:
    carried = tmp_path / "xcache"
    (carried / "modular").mkdir(parents=True)
    progress, calls = _run_with_stubs(tmp_path, "mtp cachecheck", CARRIED_CACHE=str(carried))
    assert progress[:2] == ["cachecheck", "cachecheck done"] and progress.index("cachecheck done") < progress.index("mtp")
    checks = [c for c in calls if "sm90_matmul_shapes.py" in c]
    assert len(checks) == 3 and all("--device gpu" in c for c in checks)
    caches = [c.rsplit("[cache ", 1)[1].rstrip("]") for c in checks]
    assert caches[0].endswith("cache-carried") and caches[1] == caches[2] and caches[1].endswith("cache-cold")
    assert (tmp_path / "work" / "cache-carried" / "modular").is_dir()  # a copy: the carried one stays as it came


def test_cachecheck_without_a_carried_cache_says_so(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "cachecheck", CARRIED_CACHE=str(tmp_path / "absent"))
    assert not [c for c in calls if "sm90_matmul_shapes.py" in c]
    assert "no carried cache at" in (tmp_path / "work" / "cachecheck.txt").read_text()


def test_collect_brings_back_the_oracle_drafters_verified_rows(tmp_path: Path) -> None:
    """Without its rows a GPU oracle run says only totals, mixing the rows its
    requests verified on the reference with those after they left it."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "mtp").mkdir(parents=True)
    (work / "progress.log").write_text("09:53:17 mtp done\n")
    (work / "mtp.txt").write_text("oracle drafter: 2 verified rows\n")
    (work / "mtp" / "oracle-drafts-verified.jsonl").write_text('{"request": "r0", "accepted": 3}\n')
    env = {**os.environ, "WORK": str(work), "OUT": str(out)}
    subprocess.run(["bash", str(LEASE), "collect"], env=env, check=True, timeout=60, capture_output=True)
    assert (out / "invariance.txt").read_text().splitlines() == [
        "oracle drafter: 2 verified rows", '{"request": "r0", "accepted": 3}']


def test_stepprofile_compiles_both_side_by_side_then_profiles_each_alone(tmp_path: Path) -> None:
    """Gemma 4's memory plan (weights + 15 GiB) must fit each cap; both caps fit the card."""
    progress, calls = _run_with_stubs(tmp_path, "stepprofile", PROFILE_CELLS="nvfp4 bf16")
    assert progress[0] == "stepprofile" and "stepprofile done" in progress
    made = next(i for i, c in enumerate(calls) if "make_random_gemma4.py" in c and "profile-model --layers 6" in c)
    runs = [c for c in calls if "step_profile.py" in c]
    assert calls.index(runs[0]) > made
    stages = [c.split("--stage ")[1].split()[0] for c in runs]
    assert stages == ["compile", "compile", "profile", "profile"]
    settings = {c.split("--env ")[1].split(" [cache")[0] for c in runs}
    assert settings == {
        f"MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT={pct} ATTNQUANT_QUANT={quant} ATTNQUANT_LM_HEAD={head}"
        for pct, quant, head in ((31, "nvfp4", "nvfp4"), (38, "none", "bf16"), (60, "nvfp4", "nvfp4"),
                                 (60, "none", "bf16"))
    }
    assert all("--gpu-lock" in c and "--layers 6" in c for c in runs)


def test_collect_returns_at_most_8_files_with_the_profiles_raw_tables(tmp_path: Path) -> None:
    """The device brings back 8 files at most: a ninth would be left there."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "profile-nvfp4").mkdir(parents=True)
    (work / "progress.log").write_text("10:00:00 stepprofile done\n")
    (work / "profile-nvfp4.txt").write_text("the decode step is 11 kernels\n")
    with gzip.open(work / "profile-nvfp4" / "kernels.csv.gz", "wt") as f:
        f.write('"ID","Kernel Name"\n"0","k"\n')
    env = {**os.environ, "WORK": str(work), "OUT": str(out)}
    subprocess.run(["bash", str(LEASE), "collect"], env=env, check=True, timeout=60, capture_output=True)
    assert len(list(out.iterdir())) <= 8
    assert "the decode step is 11 kernels" in (out / "kernels.txt").read_text()
    with gzip.open(out / "profile-kernels.csv.gz", "rt") as f:
        assert f.read().splitlines()[1:] == ['"ID","Kernel Name"', '"0","k"']


def test_three_profile_cells_compile_in_shares_that_leave_room_beside_them(tmp_path: Path) -> None:
    """At 31 + 31 + 38 % of the card the third compile's capture warmup found no
    memory outside the caps: three or more cells share 80 % of it."""
    _, calls = _run_with_stubs(tmp_path, "stepprofile", PROFILE_GEOMETRY="1b", PROFILE_LAYERS="26",
                               PROFILE_CELLS="bf16 nvfp4-served nvfp4-pdl")  # fmt: skip
    compiles = [c for c in calls if "step_profile.py" in c and "--stage compile" in c]
    assert len(compiles) == 3
    assert all("MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT=26 " in c for c in compiles)


def test_stepprofile_at_a_gemma3_geometry_and_an_unknown_one(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path / "1b", "stepprofile", PROFILE_GEOMETRY="1b", PROFILE_LAYERS="4")
    made = [c for c in calls if "make_random_" in c]
    assert len(made) == 1 and "make_random_gemma3.py" in made[0] and "--geometry 1b --layers 4" in made[0]
    runs = [c for c in calls if "step_profile.py" in c]
    assert len(runs) == 2 and all("profile-model" in c and "--layers 4" in c for c in runs)

    progress, calls = _run_with_stubs(tmp_path / "27b", "stepprofile", PROFILE_GEOMETRY="27b")
    assert "stepprofile done" in progress  # no checkpoint, nothing compiled or profiled
    assert not [c for c in calls if "make_random_" in c or "step_profile.py" in c]
    assert "unknown PROFILE_GEOMETRY 27b" in (tmp_path / "27b" / "work" / "session.log").read_text()


def test_stepprofile_inlined_cell_inlines_every_layer_and_a_bad_cell_is_named(tmp_path: Path) -> None:
    _, calls = _run_with_stubs(tmp_path, "stepprofile", PROFILE_CELLS="nvfp4-inlined typo")
    runs = [c for c in calls if "step_profile.py" in c]
    assert len(runs) == 2 and all("ATTNQUANT_LAYER_SUBGRAPHS=cpu" in c for c in runs)
    assert "unknown profile cell typo" in (tmp_path / "work" / "profile-typo.txt").read_text()


def test_stepprofile_capture_and_the_served_cells(tmp_path: Path) -> None:
    """PROFILE_CAPTURE times each cell's captured step whole; nvfp4-served and
    nvfp4-pdl keep the served default's bf16 head, the second with PDL."""
    _, calls = _run_with_stubs(tmp_path, "stepprofile", PROFILE_GEOMETRY="1b", PROFILE_LAYERS="26",
                               PROFILE_CELLS="nvfp4-served nvfp4-pdl", PROFILE_CAPTURE="1")  # fmt: skip
    runs = [c for c in calls if "step_profile.py" in c]
    assert len(runs) == 4 and all("--capture" in c and "--layers 26" in c for c in runs)
    served = [c for c in runs if "profile-nvfp4-served" in c]
    pdl = [c for c in runs if "profile-nvfp4-pdl" in c]
    assert len(served) == len(pdl) == 2
    assert all("ATTNQUANT_QUANT=nvfp4 ATTNQUANT_LM_HEAD=bf16" in c and "ATTNQUANT_PDL" not in c for c in served)
    assert all("ATTNQUANT_QUANT=nvfp4 ATTNQUANT_LM_HEAD=bf16 ATTNQUANT_PDL=1" in c for c in pdl)
    _, calls = _run_with_stubs(tmp_path / "eager", "stepprofile", PROFILE_CELLS="nvfp4")
    assert not [c for c in calls if "step_profile.py" in c and "--capture" in c]


def test_g4tpot_control_adds_a_second_server_of_the_same_cell(tmp_path: Path) -> None:
    """G4_TPOT_CONTROL: the NVFP4-head cell twice, the second differing only in
    its arena (memory), so that two servers of one configuration can be seen
    to give the same greedy text beside a cell whose text differs."""
    _, calls = _run_with_stubs(tmp_path, "g4tpot", G4_TPOT_CONTROL="1", G4_TPOT_PDL="1")
    bench = next(c for c in calls if "serve_benchmark.py" in c)
    cells = bench.split("--cells ")[1].split(" --")[0].split()
    head = "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ARENA_GIB="
    assert [c for c in cells if c.startswith(head)] == [head + "35", head + "36"], cells
    _, calls = _run_with_stubs(tmp_path / "off", "g4tpot")
    assert head + "36" not in next(c for c in calls if "serve_benchmark.py" in c)


@pytest.mark.parametrize(
    "phase, flag, cell",
    [
        ("g4tpot", "G4_TPOT_PDL", "attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+ATTNQUANT_PDL=1+ARENA_GIB=35"),
        ("tuned", "TUNED_PDL", "attnquant-nvfp4:on+ATTNQUANT_PDL=1+MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT=8"),
    ],
)
def test_pdl_flags_add_the_nvfp4_cell_with_programmatic_dependent_launch(
    tmp_path: Path, phase: str, flag: str, cell: str
) -> None:
    """ATTNQUANT_PDL is off by default until measured end to end: each flag adds
    the NVFP4 cell with it beside the default, measured in the same session."""
    _, calls = _run_with_stubs(tmp_path, phase, **{flag: "1"})
    bench = next(c for c in calls if "serve_benchmark.py" in c)
    cells = bench.split("--cells ")[1].split(" --")[0].split()
    assert cell in cells and len(cells) == len(set(cells)), cells
    _, calls = _run_with_stubs(tmp_path / "off", phase)
    assert "ATTNQUANT_PDL" not in next(c for c in calls if "serve_benchmark.py" in c)
