"""An oracle drafter: MAX's MTP drafts replaced by a reference completion's next tokens.

For ``bench/checks/mtp_cpu_check.py --oracle`` (CPU) and the MTP cells of
``bench/harness/batch_invariance.py --oracle-drafts`` (GPU, capture on or off:
a captured decode step is a replay of MAX's graph-capture runner, wrapped
too); attnquant never installs it. It rides in
with ``bench/checks/mtp_cpu/site/sitecustomize.py`` on the server's
PYTHONPATH, whose CPU patches change nothing on a GPU.
A random assistant's drafts are never accepted, so every step of such a check
rejects them: the verify pass's accepting half (several committed tokens per
step, the KV cache kept for accepted drafts, the bonus token after them) goes
untested. Here the drafts come from what ours generated without a drafter
(the reference), so they are accepted exactly as far as the target agrees
with the reference.

After each step of MAX's fused MTP graph this overwrites the graph's next
drafts, row by row, with the reference's next tokens, the first few right and
the rest wrong, cycling through ``SCHEDULE`` (so 0, 1, 2 and 3 accepted drafts
all occur). Before each verify step it reads the drafts the graph is about to
verify, and after it, how many the graph accepted; one JSON line per verified
row goes to ``verified_log(drafts file)``. A correct target accepts exactly
the drafts that match the reference and emits the reference's token after
them; ``judge`` reads each row so, ``summarize`` counts the verdicts.

``MTP_ORACLE_DRAFTS`` names the drafts file, a JSON list of
``{"prompt_ids": [...], "completion_ids": [...]}`` (``write_drafts``); it may
be written after the server starts (read at the first request that finds
it). A request is matched to the entry whose prompt ids end its own (the
server may prepend a BOS); unmatched requests (MAX's warmup) keep the
assistant's drafts.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ENV_DRAFTS = "MTP_ORACLE_DRAFTS"  # not ATTNQUANT_*: attnquant refuses an ATTNQUANT_ name it does not know
# Drafts planned right per step, in turn (offset per request): every count of
# accepted drafts from 0 to 3 occurs for each request.
SCHEDULE = (3, 1, 0, 2)
_MARK = "_attnquant_oracle_installed"


def verified_log(drafts: Path) -> Path:
    """Where the verified rows of a run drafting from ``drafts`` are logged (one JSON line each)."""
    return drafts.with_name(f"{drafts.stem}-verified.jsonl")


def clear(drafts: Path) -> None:
    """Removes an earlier run's drafts file and verified rows (a server would read them)."""
    drafts.unlink(missing_ok=True)
    verified_log(drafts).unlink(missing_ok=True)


def write_entries(drafts: Path, prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> None:
    """The drafts file: each prompt's ids (no special tokens) and its reference completion."""
    assert len(prompt_ids) == len(completions), (len(prompt_ids), len(completions))
    entries = [{"prompt_ids": list(p), "completion_ids": list(c)} for p, c in zip(prompt_ids, completions)]
    clear(drafts)
    partial = drafts.with_name(f"{drafts.name}.partial")
    partial.write_text(json.dumps(entries))
    partial.replace(drafts)  # a server reads it whole or not at all


def write_drafts(drafts: Path, model: Path, prompts: Sequence[str], completions: Sequence[Sequence[int]]) -> None:
    """The drafts file for ``prompts`` as ``model``'s tokenizer reads them, and their reference ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
    write_entries(drafts, prompt_ids, completions)


def read_verified(drafts: Path) -> list[dict[str, Any]]:
    """The verified rows logged for ``drafts`` (none when nothing verified)."""
    log = verified_log(drafts)
    return read_rows(log) if log.exists() else []


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The verified rows in ``path``: its JSON lines (a collected file's other lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def matching_entry(prompt_ids: Sequence[int], entries: Sequence[dict[str, list[int]]]) -> int | None:
    """The index of the entry whose prompt ids end ``prompt_ids`` (the longest such), or None."""
    best: int | None = None
    for i, entry in enumerate(entries):
        key = entry["prompt_ids"]
        if key and len(key) <= len(prompt_ids) and list(prompt_ids[-len(key):]) == key:
            if best is None or len(key) > len(entries[best]["prompt_ids"]):
                best = i
    return best


def leading_matches(drafts: Sequence[int], reference: Sequence[int], start: int) -> int:
    """How many of ``drafts`` equal ``reference[start:]``, counted from the first."""
    count = 0
    for draft, expected in zip(drafts, reference[start:]):
        if int(draft) != expected:
            break
        count += 1
    return count


def planned_drafts(reference: Sequence[int], start: int, width: int, right: int) -> list[int]:
    """``width`` drafts after ``start`` tokens: the reference's next ``right``, then a wrong one.

    Past the reference's end any token serves (the server stops there).
    """
    assert 0 <= right <= width, (right, width)
    drafts = list(reference[start:start + right])
    position = start + len(drafts)
    if len(drafts) < width and position < len(reference):
        expected = reference[position]
        drafts.append(expected + 1 if expected == 0 else expected - 1)  # any other token
    return drafts + [0] * (width - len(drafts))


@dataclass
class Request:
    """One matched request: its reference and how many of its tokens are committed."""

    reference: list[int]
    offset: int
    committed: int = 0
    verify_steps: int = 0


class Oracle:
    """Per-request bookkeeping across steps of the fused graph."""

    def __init__(self, drafts: Path | None, entries: Sequence[dict[str, list[int]]] = ()) -> None:
        self.drafts = drafts
        self.entries = list(entries)
        self.log = None if drafts is None else verified_log(drafts)
        self.requests: dict[Any, Request | None] = {}

    def _request(self, context: Any) -> Request | None:
        key = context.request_id
        if key not in self.requests:
            if not self.entries and self.drafts is not None and self.drafts.exists():
                self.entries = json.loads(self.drafts.read_text())
            index = matching_entry([int(t) for t in context.tokens.prompt], self.entries)
            self.requests[key] = (
                None if index is None else Request(list(self.entries[index]["completion_ids"]), index)
            )
        return self.requests[key]

    def step(
        self, contexts: Sequence[Any], verified: np.ndarray, accepted: np.ndarray,
        next_tokens: np.ndarray, next_drafts: np.ndarray,
    ) -> tuple[np.ndarray, list[dict[str, Any]]]:  # fmt: skip
        """Records one step's rows; returns the next drafts with matched rows replaced, and the rows."""
        assert verified.shape[0] == len(contexts) == next_drafts.shape[0], (verified.shape, len(contexts))
        out = next_drafts.copy()
        lines = []
        for row, context in enumerate(contexts):
            request = self._request(context)
            if request is None:
                continue
            line = self._record(request, verified[row], int(accepted[row]), int(next_tokens[row]))
            if line is not None:
                lines.append({"request": str(context.request_id), **line})
            right = SCHEDULE[(request.verify_steps + request.offset) % len(SCHEDULE)]
            width = out.shape[1]
            out[row] = planned_drafts(request.reference, request.committed, width, min(right, width))
        if lines and self.log is not None:
            with self.log.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)
        return out, lines

    @staticmethod
    def _record(request: Request, verified: np.ndarray, accepted: int, bonus: int) -> dict[str, Any] | None:
        """Advances ``request`` past one step; the verified row's line (None: nothing verified)."""
        before = request.committed
        if verified.size == 0:  # a prefill or mixed step: one token, no drafts
            request.committed += 1
            return None
        request.verify_steps += 1
        request.committed += accepted + 1
        reference = request.reference
        return {
            "committed": before, "drafts": [int(t) for t in verified],
            "expected": leading_matches(verified, reference, before), "accepted": accepted,
            "bonus": bonus, "bonus_expected": reference[before + accepted] if before + accepted < len(reference) else None,
        }  # fmt: skip


def judge(lines: Sequence[dict[str, Any]]) -> list[str]:
    """Each verified row's verdict, read per request in step order.

    "right": accepted exactly the drafts matching the reference, then the
    reference's token. "fault": accepted a draft the reference did not choose,
    or rejected one and then emitted that very token. "departure": accepted
    only drafts matching the reference, then chose another token than the
    reference (on a GPU, rounding can do that: the completions are priced).
    "off": a row after its request's departure or fault, whose drafts come
    from a reference the request no longer follows (batched on a GPU, where
    the target itself is not batch invariant, most rows are these).
    """
    left: set[Any] = set()
    verdicts = []
    for line in lines:
        request = line.get("request")
        if request in left:
            verdicts.append("off")
            continue
        accepted, expected = line["accepted"], line["expected"]
        bonus_right = line["bonus_expected"] is None or line["bonus"] == line["bonus_expected"]
        if accepted > expected or (accepted < expected and bonus_right):
            verdicts.append("fault")
        elif not bonus_right:
            verdicts.append("departure")
        else:
            verdicts.append("right")
        if verdicts[-1] != "right":
            left.add(request)
    return verdicts


def summarize(lines: Sequence[dict[str, Any]]) -> tuple[str, bool]:
    """One sentence on the verified rows, and whether none was a fault and every
    count of accepted drafts occurred among the right ones."""
    verdicts = judge(lines)
    kinds = Counter(verdicts)
    counts = Counter(line["accepted"] for line, verdict in zip(lines, verdicts) if verdict == "right")
    widths = {len(line["drafts"]) for line in lines}
    covered = bool(lines) and all(counts[n] for n in range(max(widths, default=0) + 1))
    histogram = ", ".join(f"{n} accepted: {counts[n]}" for n in sorted(counts))
    departures = [f"{line.get('request', '?')[-6:]}@{line['committed'] + line['accepted']}"
                  for line, verdict in zip(lines, verdicts) if verdict == "departure"]  # fmt: skip
    text = (
        f"oracle drafter: {len(lines)} verified rows; right: {kinds['right']} ({histogram}); "
        f"faults: {kinds['fault']}; departures from the reference: {kinds['departure']}"
        f"{' (request@position: ' + ', '.join(departures) + ')' if departures else ''}; "
        f"after a departure, not judged: {kinds['off']}"
    )
    if not covered:
        text += "; UNINFORMATIVE: not every count of accepted drafts occurred among the right rows"
    return text, covered and not kinds["fault"]


def rows_of_a_correct_target(
    served: Sequence[int], reference: Sequence[int], offset: int, width: int = 3
) -> list[dict[str, Any]]:
    """The rows the drafter logs for one request alone when the target accepts
    exactly the drafts that match its own greedy tokens (``served``: the
    completion it returned; ``offset``: the request's entry index).

    Drives ``Oracle`` as the server does: a prefill verifies nothing, each
    step after it verifies the drafts planned at the last, and one step runs
    past the completion's end (the server stops the request after it). For
    totals that came back without their rows: compare their histogram with
    these rows'.
    """
    oracle = Oracle(None)
    request = SimpleNamespace(request_id="r")
    oracle.requests[request.request_id] = Request(list(reference), offset)
    drafts = np.zeros((1, 0), dtype=np.int64)
    rows: list[dict[str, Any]] = []
    while True:
        committed = oracle.requests[request.request_id].committed
        accepted = leading_matches(drafts[0], served, committed)
        bonus = served[committed + accepted] if committed + accepted < len(served) else 0  # past the end: any
        drafts, lines = oracle.step(
            [request], drafts, np.array([accepted]), np.array([bonus]), np.zeros((1, width), dtype=np.int64)
        )
        rows += lines
        if committed >= len(served):
            return rows


def _host(buffer: Any) -> np.ndarray:
    from max.driver import CPU

    return np.array(buffer.to(CPU()).to_numpy(), copy=True)


def _drafting(oracle: Oracle, batch: Sequence[Any], model_inputs: Any, run: Callable[[], Any]) -> Any:
    """Runs one step (``run``), then swaps the next drafts of ``batch``'s matched rows."""
    from max.driver import Buffer

    if getattr(model_inputs, "draft_tokens", None) is None:  # not the MTP model's step
        return run()
    verified = _host(model_inputs.draft_tokens)  # before the graph writes the accepted ones back
    outputs = run()
    if len(batch) != verified.shape[0]:  # a warmup step, prepared for no request
        return outputs
    next_drafts, _ = oracle.step(
        batch, verified, _host(outputs.num_accepted_draft_tokens),
        _host(outputs.next_tokens), _host(outputs.next_draft_tokens),
    )  # fmt: skip
    source = Buffer.from_numpy(np.ascontiguousarray(next_drafts))
    outputs.next_draft_tokens.inplace_copy_from(source)
    # On a GPU the copy is queued: the host array must outlive it.
    outputs.next_draft_tokens.device.synchronize()
    return outputs


def install(model_class: type, runner_class: type | None = None) -> None:
    """Wraps ``model_class``'s input preparation (to see the batch) and its
    ``execute``, and ``runner_class.replay`` (default: MAX's graph-capture
    runner; a captured decode step replays without calling ``execute``), so
    that every step's next drafts are swapped, captured or not."""
    if getattr(model_class, _MARK, False):
        return
    if runner_class is None:
        from max.pipelines.lib.graph_capture import ServeGraphCaptureRunner as runner_class
    oracle = Oracle(Path(os.environ[ENV_DRAFTS]))
    batch: list[Any] = []  # the contexts of the step the model last prepared
    prepare = model_class.prepare_initial_token_inputs
    execute = model_class.execute
    replay = runner_class.replay

    def prepare_initial_token_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        batches = kwargs["replica_batches"] if "replica_batches" in kwargs else args[0]
        batch[:] = [context for replica in batches for context in replica]
        return prepare(self, *args, **kwargs)

    def execute_with_oracle(self: Any, model_inputs: Any) -> Any:
        return _drafting(oracle, batch, model_inputs, lambda: execute(self, model_inputs))

    def replay_with_oracle(self: Any, *args: Any, **kwargs: Any) -> Any:
        model_inputs = kwargs["model_inputs"] if "model_inputs" in kwargs else args[0]
        return _drafting(oracle, batch, model_inputs, lambda: replay(self, *args, **kwargs))

    model_class.prepare_initial_token_inputs = prepare_initial_token_inputs
    model_class.execute = execute_with_oracle
    runner_class.replay = replay_with_oracle
    setattr(model_class, _MARK, True)
    print(f"mtp_cpu: oracle drafter installed (captured steps too), drafting from {oracle.drafts}", flush=True)
