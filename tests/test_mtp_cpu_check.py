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


# The oracle drafter (bench/harness/oracle_drafter.py): its bookkeeping, driven by a
# simulated target, so a fault in it cannot pass for a correct MTP path.
def _oracle_module():
    return bench_module("oracle_drafter")


class _Context:
    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.tokens = type("Tokens", (), {"prompt": prompt})()


def test_oracle_matches_a_request_by_the_end_of_its_prompt() -> None:
    oracle = _oracle_module()
    entries = [{"prompt_ids": [5, 6], "completion_ids": []}, {"prompt_ids": [4, 5, 6], "completion_ids": []}]
    assert oracle.matching_entry([2, 4, 5, 6], entries) == 1  # BOS prepended; the longest suffix wins
    assert oracle.matching_entry([2, 9, 5, 6], entries) == 0
    assert oracle.matching_entry([2, 6, 5], entries) is None


def test_oracle_plans_right_drafts_then_a_wrong_one() -> None:
    oracle = _oracle_module()
    reference = [10, 11, 12, 13, 0]
    assert oracle.planned_drafts(reference, 1, 3, 3) == [11, 12, 13]
    assert oracle.planned_drafts(reference, 1, 3, 1) == [11, 11, 0]  # 12 planned wrong: any other token
    assert oracle.planned_drafts(reference, 3, 3, 1) == [13, 1, 0]  # the reference's 0 → 1
    assert oracle.planned_drafts(reference, 4, 3, 3) == [0, 0, 0]  # past the end: any token
    assert oracle.leading_matches([11, 12, 9], reference, 1) == 2


def _simulate(oracle, reference: list[int], drafts_file: Path, extra_accept: int = 0) -> list[dict]:
    """A target that accepts the drafts matching ``reference`` (plus ``extra_accept``
    wrong ones, a faulty target) and emits the reference's next token; the logged rows."""
    import numpy as np

    state = oracle.Oracle(drafts_file, [{"prompt_ids": [7, 8], "completion_ids": reference}])
    context, committed = _Context("r0", [2, 7, 8]), 0
    drafts = np.zeros((1, 0), dtype=np.int64)  # prefill: nothing to verify
    while committed < len(reference):
        matches = oracle.leading_matches(drafts[0], reference, committed)
        accepted = min(matches + extra_accept, drafts.shape[1]) if drafts.shape[1] else 0
        committed += accepted + 1
        bonus = reference[committed - 1] if committed - 1 < len(reference) else 0
        drafts, _ = state.step([context], drafts, np.array([accepted]), np.array([bonus]), np.full((1, 3), 42))
    return oracle.read_verified(drafts_file)


def test_oracle_drives_every_count_of_accepted_drafts_and_sees_a_correct_target_right(tmp_path: Path) -> None:
    oracle = _oracle_module()
    reference = list(range(100, 140))
    summary, right = oracle.summarize(_simulate(oracle, reference, tmp_path / "d.json"))
    assert right, summary
    assert "faults: 0; departures from the reference: 0" in summary
    for count in range(4):
        assert f"{count} accepted: " in summary


def test_oracle_flags_a_target_that_accepts_a_wrong_draft(tmp_path: Path) -> None:
    oracle = _oracle_module()
    summary, right = oracle.summarize(_simulate(oracle, list(range(100, 140)), tmp_path / "d.json", extra_accept=1))
    assert not right and "faults: 1;" in summary  # the rest of that request is not judged
    verdicts = oracle.judge(_simulate(oracle, list(range(100, 140)), tmp_path / "e.json", extra_accept=1))
    fault = verdicts.index("fault")
    assert set(verdicts[:fault]) == {"right"} and set(verdicts[fault + 1:]) == {"off"}, verdicts


def _row(request: str, committed: int, expected: int, accepted: int, bonus: int, bonus_expected: int) -> dict:
    return {"request": request, "committed": committed, "drafts": [1, 2, 3], "expected": expected,
            "accepted": accepted, "bonus": bonus, "bonus_expected": bonus_expected}  # fmt: skip


def test_oracle_reads_rows_per_request_and_stops_judging_one_after_it_departs() -> None:
    """A GPU target departs from the reference at near-ties; what it is drafted after
    that comes from a reference it no longer follows."""
    oracle = _oracle_module()
    rows = [
        _row("a", 1, 3, 3, 7, 7), _row("b", 1, 1, 1, 5, 5),
        _row("a", 5, 2, 1, 9, 8),  # chose 9 where the reference has 8: a departure at 6
        _row("b", 3, 0, 0, 4, 4), _row("a", 7, 3, 0, 1, 2),  # a: off the reference now
        _row("b", 4, 2, 1, 6, 6),  # rejected a right draft, then emitted it: a fault
    ]
    assert oracle.judge(rows) == ["right", "right", "departure", "right", "off", "fault"]
    summary, right = oracle.summarize(rows)
    assert not right and "faults: 1; departures from the reference: 1 (request@position: a@6)" in summary


def test_oracle_flags_a_check_that_never_accepts() -> None:
    oracle = _oracle_module()
    line = {"drafts": [42, 42, 42], "expected": 0, "accepted": 0, "bonus": 1, "bonus_expected": 1}
    summary, right = oracle.summarize([line, line])
    assert not right and "UNINFORMATIVE" in summary


def test_oracle_installs_on_a_model_class_and_swaps_its_next_drafts(tmp_path: Path, monkeypatch) -> None:
    """install() on a stand-in for MAX's MTP model, with MAX's real host Buffers;
    the drafts file is written after install, as batch_invariance.py does."""
    import numpy as np
    from max.driver import Buffer

    oracle = _oracle_module()
    drafts = tmp_path / "drafts.json"
    verifying = np.array([[21, 22, 9]], dtype=np.int64)  # two right, one wrong

    class Outputs:
        def __init__(self, accepted: int, bonus: int) -> None:
            self.num_accepted_draft_tokens = Buffer.from_numpy(np.array([accepted], dtype=np.int64))
            self.next_tokens = Buffer.from_numpy(np.array([bonus], dtype=np.int64))
            self.next_draft_tokens = Buffer.from_numpy(np.full((1, 3), 42, dtype=np.int64))

    def graph(model_inputs):
        if model_inputs.draft_tokens.to_numpy().shape[1] == 0:
            return Outputs(0, 20)
        model_inputs.draft_tokens.to_numpy()[:] = -1  # the graph writes the accepted drafts back: read before
        return Outputs(2, 23)

    class Model:
        def prepare_initial_token_inputs(self, replica_batches, **kwargs):
            return type("Inputs", (), {"draft_tokens": kwargs["drafts"]})()

        def execute(self, model_inputs):
            return graph(model_inputs)

    class Runner:  # MAX's graph-capture runner: a captured step replays, calls no execute
        def replay(self, *, model_inputs, batch_characteristics):
            return graph(model_inputs)

    monkeypatch.setenv(oracle.ENV_DRAFTS, str(drafts))
    oracle.install(Model, Runner)
    oracle.install(Model, Runner)  # idempotent
    model = Model()
    context = _Context("r", [2, 7, 8])

    def step(batch: list, drafts_in: np.ndarray):
        return model.execute(model.prepare_initial_token_inputs(batch, drafts=Buffer.from_numpy(drafts_in)))

    nothing = np.zeros((1, 0), dtype=np.int64)
    warmup = step([[_Context("w", [2, 7, 8])]], nothing)
    assert warmup.next_draft_tokens.to_numpy().tolist() == [[42, 42, 42]]  # no drafts file yet: left alone
    oracle.write_entries(drafts, [[7, 8]], [list(range(20, 30))])
    prefill = step([[context]], nothing)
    # One token committed; the first schedule slot plans all 3 right.
    assert prefill.next_draft_tokens.to_numpy().tolist() == [[21, 22, 23]]
    assert oracle.read_verified(drafts) == []  # a prefill verifies nothing
    verify = model.execute(model.prepare_initial_token_inputs(replica_batches=[[context]], drafts=Buffer.from_numpy(verifying)))
    [row] = oracle.read_verified(drafts)
    assert row["drafts"] == [21, 22, 9] and row["expected"] == 2 and row["accepted"] == 2
    assert row["bonus"] == row["bonus_expected"] == 23
    # 1 + 3 committed; the next slot plans 1 right (24), then a wrong one.
    assert verify.next_draft_tokens.to_numpy().tolist() == [[24, 24, 0]]
    # A captured step, replayed by the runner: verified and its drafts swapped as well.
    inputs = model.prepare_initial_token_inputs([[context]], drafts=Buffer.from_numpy(np.array([[24, 9, 9]])))
    replayed = Runner().replay(model_inputs=inputs, batch_characteristics=None)
    rows = oracle.read_verified(drafts)
    assert len(rows) == 2 and rows[1]["committed"] == 4 and rows[1]["drafts"] == [24, 9, 9] and rows[1]["expected"] == 1
    # 4 + 3 committed; the next slot plans none right: the reference's 27 → 26.
    assert replayed.next_draft_tokens.to_numpy().tolist() == [[26, 0, 0]]


def test_oracle_setting_passes_attnquant_settings_check() -> None:
    """attnquant refuses ATTNQUANT_ names it does not know: the oracle's variable must not be one."""
    from attnquant.config import ENV_PREFIX

    assert not _oracle_module().ENV_DRAFTS.startswith(ENV_PREFIX)


def test_oracle_wraps_maxs_graph_capture_replay_which_takes_the_inputs_it_reads(monkeypatch, tmp_path: Path) -> None:
    """A captured decode step calls no execute: MAX's runner replays it."""
    import inspect

    from max.pipelines.lib.graph_capture import ServeGraphCaptureRunner

    parameters = inspect.signature(ServeGraphCaptureRunner.replay).parameters
    assert parameters["model_inputs"].kind is inspect.Parameter.KEYWORD_ONLY
    original = ServeGraphCaptureRunner.replay
    monkeypatch.setattr(ServeGraphCaptureRunner, "replay", original)  # put back after the test
    monkeypatch.setenv(_oracle_module().ENV_DRAFTS, str(tmp_path / "d.json"))
    model = type("Model", (), {"prepare_initial_token_inputs": lambda self, b: None, "execute": lambda self, i: None})
    _oracle_module().install(model)
    assert ServeGraphCaptureRunner.replay is not original


def test_a_correct_targets_rows_are_what_maxs_mtp_path_logged_on_cpu() -> None:
    """The replay that prices a GPU run's totals, against every row MAX's own MTP
    path verified on CPU (4 prompts alone and 4 at a time, all right): request by
    request, the same drafts, counts and steps, the one past the end included."""
    oracle = _oracle_module()
    log = BENCH / "results" / "2026-12-04-cpu-mtp-oracle.txt"
    rows: dict[str, list[dict]] = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            rows.setdefault(row.pop("request"), []).append(row)
    assert len(rows) == 8
    for logged in rows.values():
        served = [-1]  # the prefill's token: never drafted against
        for row in logged[:-1]:
            served += row["drafts"][: row["accepted"]] + [row["bonus"]]
        served = served[:24]  # the check's greedy tokens
        offset = oracle.SCHEDULE.index(logged[0]["expected"])
        replayed = oracle.rows_of_a_correct_target(served, served, offset)
        assert [{k: r[k] for k in ("committed", "drafts", "expected", "accepted")} for r in replayed] == [
            {k: r[k] for k in ("committed", "drafts", "expected", "accepted")} for r in logged
        ]


def test_oracle_replay_prices_a_results_file(tmp_path: Path) -> None:
    """A target that served its reference's ids accepts as planned; one that
    departs at a position has that request's later rows left unjudged."""
    reference = [list(range(100, 116)), list(range(200, 216))]
    served = [reference[0], reference[1][:5] + [9] * 11]
    results = {"ref": {"alone": reference}, "mtp+MTP_ORACLE_DRAFTS=d": {"alone": served, "batched_ids": {"2": served}}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    done = subprocess.run(
        [sys.executable, str(BENCH / "checks" / "oracle_replay.py"), str(tmp_path / "r.json"), "--cell", "MTP_ORACLE",
         "--reference", "ref"], capture_output=True, text=True, check=True,
    )  # fmt: skip
    c1, c2, total = done.stdout.splitlines()
    assert c1.startswith("c1: ") and "faults: 0; departures from the reference: 1 (request@position: c1/1@5)" in c1
    assert c2.replace("c2", "c1") == c1 and total.startswith("in all: ")


def test_oracle_replay_compares_the_rows_of_requests_sent_alone(tmp_path: Path) -> None:
    """With --rows, each request sent alone is compared row by row with a correct
    target's: the unknowable bonus past the end is not compared, one row that
    accepted a draft more than it matched makes its request differ."""
    oracle = _oracle_module()
    reference = [list(range(100, 116)), list(range(200, 216))]
    results = {"ref": {"alone": reference}, "mtp+MTP_ORACLE_DRAFTS=d": {"alone": reference, "batched_ids": {}}}
    (tmp_path / "r.json").write_text(json.dumps(results))
    logged = [oracle.rows_of_a_correct_target(ids, ids, index) for index, ids in enumerate(reference)]
    logged[0][-1]["bonus"] = 12345  # what the server drew past the completion's end
    wrong = next(row for row in logged[1] if row["expected"] == 1)
    wrong["accepted"] = 2
    lines = [json.dumps({**row, "request": f"r{index}"}) for index, rows in enumerate(logged) for row in rows]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    done = subprocess.run(
        [sys.executable, str(BENCH / "checks" / "oracle_replay.py"), str(tmp_path / "r.json"), "--cell", "MTP_ORACLE",
         "--reference", "ref", "--rows", str(tmp_path / "rows.jsonl")], capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.splitlines()[-1] == (
        "rows of the requests sent alone equal to a correct target's: 1/2; differing: requests 1"
    )
