"""The benchmark harness's cells (bench/harness/serve_benchmark.py): what each server is given."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench_modules import bench_module


def _args(**overrides) -> argparse.Namespace:
    values = dict(model=Path("/m/target"), mtp_target=Path("/m/mtp"), draft_model=Path("/m/assistant"))
    return argparse.Namespace(**(values | overrides))


def test_mtp_cell_serves_the_mtp_twin_with_the_assistant_drafting_3() -> None:
    harness = bench_module("serve_benchmark")
    cell = harness.Cell.parse("attnquant-nvfp4-mtp3:on+ATTNQUANT_LM_HEAD=nvfp4")
    assert harness.served_model(cell, _args()) == Path("/m/mtp")
    assert harness.speculative_args(cell, _args()) == [
        "--draft-model-path", "/m/assistant", "--speculative-method", "mtp", "--num-speculative-tokens", "3",
    ]  # fmt: skip
    assert harness.VARIANTS[cell.variant] == harness.VARIANTS["attnquant-nvfp4"]  # the same server otherwise


def test_other_cells_serve_the_model_without_a_drafter() -> None:
    harness = bench_module("serve_benchmark")
    cell = harness.Cell.parse("attnquant-nvfp4:on")
    assert harness.served_model(cell, _args()) == Path("/m/target")
    assert harness.speculative_args(cell, _args()) == []


def test_flag_items_reach_the_command_line_and_tell_capture_twins_apart(monkeypatch) -> None:
    harness = bench_module("serve_benchmark")
    cell = harness.Cell.parse("attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+--no-use-subgraphs")
    assert cell.env == {"ATTNQUANT_LM_HEAD": "nvfp4"} and cell.flags == ("--no-use-subgraphs",)
    launched: list[list[str]] = []
    monkeypatch.setattr(harness.subprocess, "Popen", lambda command, **_: launched.append(command))
    args = _args(max_batch_size=16, memory_fraction=0.9, threads=2)
    harness._start_server(cell, args, 8000, Path("/dev/null"))
    assert launched[0][-1] == "--no-use-subgraphs" and "--device-graph-capture" in launched[0]
    off = harness.Cell.parse("attnquant-nvfp4:off+ATTNQUANT_LM_HEAD=nvfp4")
    assert harness.capture_twin(cell, [off]) is None  # same settings, one flag more: not its twin
    assert harness.capture_twin(off, [harness.Cell.parse("attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4")]) is not None
    with pytest.raises(SystemExit, match="FLAG"):
        harness.Cell.parse("attnquant-nvfp4:on+no-equals-sign")


def test_a_cell_compiled_otherwise_is_compared_with_the_same_cell_compiled_plainly(capsys) -> None:
    harness = bench_module("serve_benchmark")
    parse = harness.Cell.parse
    plain = parse("attnquant-nvfp4:on+MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT=8")
    flagged = parse("attnquant-nvfp4:on+--no-use-subgraphs")
    shared = parse("attnquant-nvfp4:on+ATTNQUANT_LAYER_SUBGRAPHS=always")
    other = parse("attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+--no-use-subgraphs")
    bf16 = parse("attnquant-bf16:on")
    cells = [bf16, plain, flagged, shared, other]
    assert harness.compile_twin(flagged, cells) is plain  # arena placement aside
    assert harness.compile_twin(shared, cells) is plain
    assert harness.compile_twin(other, cells) is None  # computes with another head
    assert harness.compile_twin(plain, cells) is None  # compiled plainly: nothing to compare
    texts = {bf16.spec: ["a"], plain.spec: ["b"], flagged.spec: ["b"], shared.spec: ["x"], other.spec: ["c"]}
    harness.print_greedy_identity(cells, texts)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith(", same as compiled plainly=True")
    assert lines[3].endswith(", same as compiled plainly=False")
    assert "plainly" not in lines[1] and "plainly" not in lines[4]


def test_greedy_note_names_the_tokens_behind_an_empty_text() -> None:
    greedy = bench_module("serve_benchmark").Greedy
    assert greedy("w1 w2", [5, 6], "length").note() == ""
    assert greedy("", [], "stop").note() == ""  # nothing generated: nothing to explain
    note = greedy("", [0] * 48, "length").note()
    assert note == f"empty text from 48 tokens (length): ids {[0] * 12}"


def test_invariance_rows_price_the_first_difference_with_the_expected_margin() -> None:
    invariance = bench_module("batch_invariance")
    expected = invariance.Greedy([1, 2, 3, 4], [0.5, 0.25, 0.125, 2.0])
    assert invariance.compare(7, expected, [1, 2, 3, 4]) == {
        "prompt": 7, "identical": True, "first_difference": None, "margin": None, "got": None,
    }  # fmt: skip
    assert invariance.compare(7, expected, [1, 2, 9, 4])["first_difference"] == 2
    assert invariance.compare(7, expected, [1, 2, 9, 4])["got"] == 9  # the batched token there
    assert invariance.compare(7, expected, [1, 2, 9, 4])["margin"] == 0.125
    shorter = invariance.compare(0, expected, [1, 2])
    assert (shorter["identical"], shorter["first_difference"], shorter["margin"]) == (False, 2, 0.125)


def test_a_cell_is_compared_alone_batched_and_with_the_reference(monkeypatch) -> None:
    invariance = bench_module("batch_invariance")
    # Prompt 1 batched gives another token at position 1; the reference
    # differs from this cell's alone ids at position 0 of prompt 0.
    served = {"p0": [10, 11], "p1": [20, 21]}
    calls = []

    def complete(port: int, model: str, prompt: str, tokens: int, margins: bool):
        assert margins is False
        calls.append(prompt)
        ids = list(served[prompt])
        if prompt == "p1" and calls.count("p1") > 1:
            ids[1] = 99
        return invariance.Greedy(ids, [1.0, 0.5])

    monkeypatch.setattr(invariance, "complete", complete)
    # The reference batched: prompt 0 as this cell batched, prompt 1 departing at position 0.
    reference = invariance.Completions(
        [invariance.Greedy([12, 11], [0.03, 1.0]), invariance.Greedy([20, 21], [1.0, 1.0])],
        {2: [invariance.Greedy([10, 11], [1.0, 1.0]), invariance.Greedy([30, 99], [0.2, 1.0])]},
    )
    result, mine = invariance.check_cell(0, "m", ["p0", "p1"], 2, [2], reference, False)
    assert [g.ids for g in mine.alone] == [[10, 11], [20, 21]]
    assert [g.ids for g in mine.batched[2]] == result["batched_ids"][2] == [[10, 11], [20, 99]]
    assert [r["identical"] for r in result["batched"][2]] == [True, False]
    assert result["batched"][2][1]["first_difference"] == 1
    assert [(r["first_difference"], r["margin"]) for r in result["vs_reference"][1]] == [(0, 0.03), (None, None)]
    assert [r["first_difference"] for r in result["vs_reference"][2]] == [0, 1]
    batched_vs = result["vs_reference_batched"][2]
    assert [(r["first_difference"], r["margin"], r["got"]) for r in batched_vs] == [(None, None, None), (0, 0.2, 20)]


@pytest.mark.parametrize("margins", [True, False])
def test_log_probabilities_are_asked_only_for_margins(monkeypatch, margins: bool) -> None:
    """MAX answers HTTP 400 to logprobs under its overlap scheduler (capture, MTP)."""
    import io
    import json

    invariance = bench_module("batch_invariance")
    sent = []
    reply = {"choices": [{"token_ids": [5, 6], "logprobs": {"top_logprobs": [{"a": -0.1, "b": -0.6}, {"c": 0.0}]}}]}

    def urlopen(request, timeout):
        sent.append(json.loads(request.data))
        return io.BytesIO(json.dumps(reply).encode())

    monkeypatch.setattr(invariance.urllib.request, "urlopen", urlopen)
    greedy = invariance.complete(1, "m", "p", 2, margins)
    assert ("logprobs" in sent[0]) is margins and sent[0]["max_tokens"] == 2
    assert greedy.ids == [5, 6] and greedy.margins == [pytest.approx(0.5), float("inf")]


def test_modelopt_cell_serves_the_export_with_no_attnquant_setting() -> None:
    harness = bench_module("serve_benchmark")
    cell = harness.Cell.parse("attnquant-modelopt:on")
    assert harness.served_model(cell, _args(export=Path("/m/export"))) == Path("/m/export")
    assert harness.VARIANTS[cell.variant][1] == {}
    assert harness.speculative_args(cell, _args()) == []


def test_image_request_sends_a_decodable_png_and_reports_maxs_answer(monkeypatch) -> None:
    import base64
    import io
    import json

    from PIL import Image

    harness = bench_module("serve_benchmark")
    assert Image.open(io.BytesIO(harness.solid_png((200, 30, 30), 8))).convert("RGB").getpixel((3, 5)) == (200, 30, 30)
    sent = []

    def urlopen(request, timeout):
        sent.append(json.loads(request.data))
        return io.BytesIO(json.dumps({"choices": [{"message": {"content": "red"}}]}).encode())

    monkeypatch.setattr(harness.urllib.request, "urlopen", urlopen)
    assert harness.image_chat(1, Path("/m/mm")) == "HTTP 200: 'red'"
    image, text = sent[0]["messages"][0]["content"]
    png = base64.b64decode(image["image_url"]["url"].removeprefix("data:image/png;base64,"))
    assert Image.open(io.BytesIO(png)).size == (64, 64) and text["type"] == "text"


def test_arena_in_gib_becomes_maxs_percentage_of_the_free_memory() -> None:
    harness = bench_module("serve_benchmark")
    free = 100 * 2**30
    assert harness.arena_env({"ARENA_GIB": "24", "X": "1"}, free) == {"X": "1", harness.ARENA: "24"}
    assert harness.arena_env({"ARENA_GIB": "24"}, 50 * 2**30) == {harness.ARENA: "48"}
    assert harness.arena_env({"ARENA_GIB": "24.5"}, free) == {harness.ARENA: "25"}  # rounded up
    assert harness.arena_env({"ARENA_GIB": "200"}, free) == {harness.ARENA: "95"}  # MAX's check then names the sizes
    assert harness.arena_env({harness.ARENA: "5"}) == {harness.ARENA: "5"}  # a percentage passes as given


def test_margin_pricing_reads_every_cell_and_each_departure_once(tmp_path: Path) -> None:
    """bench/checks/invariance_margins.py: the lease's file holds several
    results objects back to back; a request departing at one place under
    several concurrencies is priced once."""
    import json

    margins = bench_module("invariance_margins")
    row = {"prompt": 1, "identical": False, "first_difference": 3, "margin": None, "got": 7}
    same = {"prompt": 0, "identical": True, "first_difference": None, "margin": None, "got": None}
    first = {"attnquant-bf16:on": {"alone": [[1, 2], [4, 5, 6, 8]], "batched": {"8": [same, row], "32": [row]}}}
    second = {"builtin-bf16:off": {"alone": [], "batched": {}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(first, indent=1) + json.dumps(second))
    cells = margins.read_results(path)
    assert sorted(cells) == ["attnquant-bf16:on", "builtin-bf16:off"]
    assert margins.differences(cells["attnquant-bf16:on"]) == [(1, 3, "32", 7), (1, 3, "8", 7)]
    assert margins.cell_env("attnquant-nvfp4:on+ATTNQUANT_LM_HEAD=nvfp4+MODULAR_X=5") == {
        "ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_LM_HEAD": "nvfp4", "ATTNQUANT_CACHE": "0",
    }  # fmt: skip


def test_margin_pricing_finds_departures_from_the_reference_alone_and_batched() -> None:
    """The MTP check: alone against the reference alone; batched against the
    reference batched at the same concurrency, request by request."""
    margins = bench_module("invariance_margins")
    same = {"prompt": 0, "identical": True, "first_difference": None, "margin": None, "got": None}
    reference = {"alone": [[1, 2, 3], [4, 5, 6]], "batched_ids": {"8": [[1, 2, 3], [4, 7, 6]]}}
    drafted = {
        "alone": [[1, 2, 3], [4, 5, 9]],
        "vs_reference": {"1": [same, {**same, "prompt": 1, "identical": False, "first_difference": 2, "got": 9}]},
        "vs_reference_batched": {"8": [{**same, "identical": False, "first_difference": 1, "got": 8}, same]},
    }
    assert margins.reference_differences(drafted, reference) == [
        (1, 2, "reference alone", [4, 5, 6], 9),
        (0, 1, "reference c=8", [1, 2, 3], 8),
    ]
    assert margins.reference_differences({"alone": []}, reference) == []  # results from before the comparison


def test_margin_pricing_prices_gaps_and_float32_ranks() -> None:
    """At the departing position: the expected token's gap to the best other,
    its gap to the token served, and both tokens' float32 ranks (how many
    tokens lie above each), computed after the expected prefix."""
    from types import SimpleNamespace

    import torch

    margins = bench_module("invariance_margins")
    logits = torch.tensor([0.0, 3.0, 2.0, 2.5, -1.0])
    seen = []

    def model(ids: torch.Tensor) -> SimpleNamespace:
        seen.append(ids.tolist())
        return SimpleNamespace(logits=logits.expand(1, ids.shape[1], -1))

    assert [margins.rank(logits, t) for t in (1, 3, 2, 0, 4)] == [0, 1, 2, 3, 4]
    assert margins.price(model, [9, 9], [1, 2, 0], 1, 3) == "-1.0000 | -0.5000 | 2, 1"
    assert seen == [[[9, 9, 1]]]  # the prompt and the expected ids before the position
    assert margins.price(model, [9], [1], 0, None) == "+0.5000 | - | 0, -"


def test_first_token_control_ranks_each_first_token_under_its_own_and_the_next_prompt() -> None:
    from types import SimpleNamespace

    import torch

    margins = bench_module("invariance_margins")
    # The logits depend on the prompt's last id: prompt [0] prefers 0 > 1 > 2 > 3, prompt [1] the reverse.
    table = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])

    def model(ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=table[ids[0, -1]].expand(1, ids.shape[1], -1))

    line = margins.first_token_control(model, [[0], [1]], [[1, 5], [3, 5]])
    # own ranks: token 1 under [0] is 1, token 3 under [1] is 0; wrong: token 3 under [0] is 3, token 1 under [1] is 2
    assert line == (
        "float32 greedy first token = GPU's alone for 1/2 prompts; the GPU's first tokens alone rank at most 1"
        " in float32; the next prompt's first token ranks 2 at least, 3 at the median"
    )


def test_starts_sharing_a_launch_lock_come_one_at_a_time_each_settled(monkeypatch, tmp_path: Path) -> None:
    """Each start computes its arena from the memory free after the previous
    server took its own: starts never overlap, and each holds the lock while it settles."""
    import threading
    import time

    harness = bench_module("serve_benchmark")
    spans = []

    def start(cell, args, port, log):
        began = time.monotonic()
        time.sleep(0.05)
        spans.append((began, time.monotonic()))

    monkeypatch.setattr(harness, "_start_server", start)
    args = argparse.Namespace(launch_lock=tmp_path / "launch.lock", settle=0.2)
    threads = [threading.Thread(target=harness.launch, args=(None, args, 0, None)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans.sort()
    assert len(spans) == 3
    for (_, end), (next_begin, _) in zip(spans, spans[1:]):
        assert next_begin - end >= 0.2  # the settling, under the lock


def test_word_prompts_are_distinct_words_the_random_tokenizers_know(tmp_path) -> None:
    """English prompts are all <unk> to the random checkpoints' word tokenizers; word prompts are not."""
    from tests.gemma4_fixtures import SPECIAL_TOKENS

    invariance = bench_module("batch_invariance")
    random_checkpoint = bench_module("random_checkpoint")
    tokenizer = random_checkpoint.write_word_tokenizer(tmp_path, 262144, SPECIAL_TOKENS, "", random_checkpoint.GEMMA_ROLES)
    unk = tokenizer.unk_token_id
    prompts = invariance.prompt_texts(32, words=True)
    encoded = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    assert len({tuple(ids) for ids in encoded}) == 32
    assert all(len(ids) == invariance.WORDS_PER_PROMPT and unk not in ids for ids in encoded)
    assert min(min(ids) for ids in encoded) > len(SPECIAL_TOKENS)  # no special token, no bare "▁"
    english = tokenizer(invariance.prompt_texts(1)[0], add_special_tokens=False).input_ids
    assert set(english) == {unk}  # what made every completion <pad>


def test_completions_that_ignore_their_prompts_are_flagged() -> None:
    invariance = bench_module("batch_invariance")
    assert "ignores the prompts" in invariance.uninformative([[0] * 48] * 16)
    assert invariance.uninformative([[0] * 48, [0] * 47 + [5]]) is None
    assert invariance.uninformative([[7, 8]]) is None  # one prompt: nothing to tell from


@pytest.mark.parametrize(
    ("cells", "extra", "why"),
    [
        (["attnquant-nvfp4:on"], ["--oracle-drafts", "d.json"], "needs --reference"),
        (["attnquant-nvfp4:on", "attnquant-nvfp4:off+MTP_ORACLE_DRAFTS=d.json"],
         ["--reference", "attnquant-nvfp4:on", "--oracle-drafts", "d.json"], "name a *-mtp3 cell"),
    ],
)  # fmt: skip
def test_an_oracle_drafted_cell_that_cannot_work_is_refused_before_any_server(
    monkeypatch, capsys, cells: list[str], extra: list[str], why: str
) -> None:
    invariance = bench_module("batch_invariance")
    monkeypatch.setattr(invariance, "launch", lambda *a: pytest.fail("a server was started"))
    monkeypatch.setattr("sys.argv", ["batch_invariance.py", "--model", "m", "--out", "o.json", "--cells", *cells, *extra])
    with pytest.raises(SystemExit) as exit_:
        invariance.main()
    assert exit_.value.code == 2 and why in capsys.readouterr().err


def test_an_earlier_runs_oracle_drafts_are_gone_before_any_server_starts(monkeypatch, tmp_path: Path) -> None:
    invariance = bench_module("batch_invariance")
    drafts = tmp_path / "d.json"
    drafts.write_text("[]")
    invariance.oracle_drafter.verified_log(drafts).write_text('{"accepted": 3}\n')

    class Started(Exception):
        pass

    def launch(*args):
        assert not drafts.exists() and not invariance.oracle_drafter.verified_log(drafts).exists()
        raise Started

    monkeypatch.setattr(invariance, "launch", launch)
    monkeypatch.setattr("sys.argv", ["batch_invariance.py", "--model", "m", "--out", str(tmp_path / "o.json"),
                                     "--cells", "attnquant-nvfp4:on", "--reference", "attnquant-nvfp4:on",
                                     "--oracle-drafts", str(drafts)])  # fmt: skip
    with pytest.raises(Started):
        invariance.main()


def test_rounds_rotate_the_order_so_each_cell_goes_first_once_per_cycle() -> None:
    sb = bench_module("serve_benchmark")
    cells = [sb.Cell.parse(spec) for spec in ("attnquant-bf16:on", "attnquant-nvfp4:on", "builtin-bf16:off")]
    firsts = [sb.round_order(cells, rnd)[0].spec for rnd in range(3)]
    assert firsts == [c.spec for c in cells]
    assert all(sorted(c.spec for c in sb.round_order(cells, rnd)) == sorted(c.spec for c in cells) for rnd in range(5))


def test_paired_compares_rounds_of_one_session_and_counts_the_faster_ones() -> None:
    sb = bench_module("serve_benchmark")
    def row(cell: str, rnd: int, tpot: float, concurrency: int = 1) -> dict:
        return {"cell": cell, "session": 0, "round": rnd, "concurrency": concurrency, "mean_tpot_ms": tpot}

    a, b = "attnquant-nvfp4:on+ARENA_GIB=8", "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1+ARENA_GIB=8"
    rows = [row(a, 0, 2.0), row(b, 0, 2.5), row(a, 1, 3.0), row(b, 1, 2.9), row(a, 2, 2.0),
            row(b, 2, 2.1), row(b, 3, 1.0), row(a, 0, 9.0, concurrency=16)]  # fmt: skip
    line = sb.paired(rows, a, b)
    assert line.startswith("attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1 - attnquant-nvfp4:on: ")
    assert "+0.10 ms median over 3 rounds" in line and "(+0.50 -0.10 +0.10)" in line
    assert line.endswith("faster in 1 of 3")
    assert "no common rounds" in sb.paired(rows, a, b, concurrency=16)


def test_a_session_is_measured_in_one_benchmark_process_rounds_in_turn(monkeypatch, tmp_path: Path) -> None:
    """One plan for every round, cell and concurrency; stale result files of an
    earlier run are gone before it runs, and a missing trial is not invented."""
    sb = bench_module("serve_benchmark")
    cells = [sb.Cell.parse("attnquant-bf16:on"), sb.Cell.parse("attnquant-nvfp4:on")]
    args = _args(rounds=2, trials=2, concurrency=[1, 16], num_prompts=8, out=tmp_path / "results.jsonl")
    plan = sb.measurement_plan(cells, 0, args)
    assert [(m.round, m.cell.spec, m.concurrency) for m in plan] == [
        (0, "attnquant-bf16:on", 1), (0, "attnquant-bf16:on", 16), (0, "attnquant-nvfp4:on", 1),
        (0, "attnquant-nvfp4:on", 16), (1, "attnquant-nvfp4:on", 1), (1, "attnquant-nvfp4:on", 16),
        (1, "attnquant-bf16:on", 1), (1, "attnquant-bf16:on", 16),
    ]  # fmt: skip
    assert len({m.result for m in plan}) == len(plan)
    stale = sb.trial_results(plan[0].result, 2)[1]
    stale.write_text("{}")
    calls = []

    def fake_run(command: list[str], **_: object):
        calls.append(command)
        entries = json.loads(Path(command[command.index("--plan") + 1]).read_text())
        for entry in entries[1:]:  # the first entry's runs fail
            for i, path in enumerate(sb.trial_results(Path(entry["result"]), entry["repeat"])):
                path.write_text(json.dumps({"mean_tpot_ms": 2.0 + i, "args": entry["args"]}))
        return subprocess.CompletedProcess(command, 1, "", "boom")

    monkeypatch.setattr(sb.subprocess, "run", fake_run)
    results = sb.run_plan(plan, {"attnquant-bf16:on": 8000, "attnquant-nvfp4:on": 8001}, args)
    assert len(calls) == 1 and not stale.exists() and results[0] == []
    second = results[1]
    assert [t["mean_tpot_ms"] for t in second] == [2.0, 3.0]
    passed = second[0]["args"]
    assert passed[passed.index("--port") + 1] == "8000" and passed[passed.index("--num-prompts") + 1] == "128"
    assert passed[passed.index("--max-concurrency") + 1] == "16"


def test_the_inprocess_benchmark_runs_every_plan_entry_after_a_failed_one(monkeypatch, tmp_path: Path) -> None:
    inprocess = bench_module("max_benchmark_inprocess")
    import max._entrypoints.pipelines as pipelines

    seen = []

    def fake_main() -> int:
        seen.append(list(sys.argv))
        return 3 if "8000" in sys.argv else 0

    monkeypatch.setattr(pipelines, "main", fake_main)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([
        {"args": ["--port", "8000"], "result": str(tmp_path / "a.json"), "repeat": 2},
        {"args": ["--port", "8001"], "result": str(tmp_path / "b.json"), "repeat": 2},
    ]))  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["x", "--plan", str(plan), "--backend", "modular-chat"])
    assert inprocess.main() == 3
    # the failed entry stops its own repeats, not the plan
    assert [a[a.index("--result-filename") + 1].rsplit("/", 1)[1] for a in seen] == ["a-0.json", "b-0.json", "b-1.json"]
    assert all(a[:4] == ["max", "benchmark", "--backend", "modular-chat"] for a in seen)


def test_a_label_leaves_out_only_where_the_memory_goes() -> None:
    sb = bench_module("serve_benchmark")
    cell = sb.Cell.parse("attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1+MODULAR_DEVICE_CONTEXT_MEMORY_MANAGER_SIZE_PERCENT=8")
    assert cell.label == "attnquant-nvfp4:on+ATTNQUANT_GATED_GEMV=1"
    assert sb.Cell.parse("attnquant-bf16:off+ARENA_GIB=53+--no-use-subgraphs").label == "attnquant-bf16:off+--no-use-subgraphs"
