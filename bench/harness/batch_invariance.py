"""Batch invariance: does a request get the same greedy tokens alone and batched?

Measures, per server cell (the harness's ``VARIANT:on|off[+ENV=VALUE]`` cells,
bench/harness/serve_benchmark.py): ``--prompts`` distinct prompts, greedy,
``--tokens`` new tokens, each sent alone, then all together at each
``--concurrency`` (a concurrency above the prompt count sends the prompts
several times). Per request, the token ids at each concurrency are compared
with its ids alone; where they differ, the first diverging position and the
margin there (top-1 minus top-2 log probability of the request alone, so a
difference at a near-tie is told from a corrupted buffer) are printed. Margins
come only from cells with capture off and no drafter: MAX refuses log
probabilities (HTTP 400) under the overlap scheduler that capture and
speculative decoding run, so there a difference prints ``(-)``. A cell whose
requests are refused is reported with MAX's reason; the other cells go on.

    python bench/harness/batch_invariance.py --model DIR --cells builtin-bf16:off \\
        attnquant-bf16:on attnquant-nvfp4:on --out results.json

With ``--reference CELL`` every other cell's ids (alone and batched) are
also compared with the reference cell's ids alone, the margin taken from the
reference, and its batched ids with the reference's batched at the same
concurrency (a model that is not batch invariant by itself is judged there).
That is the MTP check: ours with the Gemma 4 assistant drafting
(``attnquant-nvfp4-mtp3:on``, served from ``--mtp-target`` with
``--draft-model``) must give the ids of ours without a drafter:

    python bench/harness/batch_invariance.py --model TARGET --mtp-target MTP_TWIN --draft-model ASSISTANT \\
        --cells attnquant-nvfp4:on attnquant-nvfp4-mtp3:on attnquant-nvfp4-mtp3:off \\
        --reference attnquant-nvfp4:on --concurrency 8 --out mtp.json

A random assistant's drafts are never accepted; to check steps that accept
them, ``--oracle-drafts FILE`` writes the reference's ids alone there once
the reference cell is done, and an MTP cell (capture on or off) with
``+PYTHONPATH=bench/checks/mtp_cpu/site:$PYTHONPATH+MTP_ORACLE_DRAFTS=FILE`` drafts
them instead (``oracle_drafter.py``: 3, 1, 0 or 2 right in turn); a line under
the tables counts its verified rows by verdict (right, fault, departure from
the reference, not judged after one).

On the H200 (after staging MAX): bench/harness/h200_lease.sh runs it; on CPU it runs
against CPU servers the same way (slowly). Prints one table; writes every
request's ids and margins to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import oracle_drafter  # this directory
from serve_benchmark import Cell, add_launch_args, launch, served_model, stop, wait_ready  # this directory

PROMPT_TOPICS = (
    "the sea", "a mountain village", "bread", "trains", "the moon", "a library", "rain", "chess",
    "an old clock", "winter", "a bridge", "music", "a garden", "the desert", "paper", "a lighthouse",
    "coffee", "a river", "snow", "a market", "glass", "a forest", "the wind", "a violin",
    "salt", "a harbour", "thunder", "a bicycle", "ink", "a castle", "honey", "the stars",
)


WORDS_PER_PROMPT = 8


LONG_PROMPT_TAIL = ", for a reader who has never seen one, in plain words, without lists, in the present tense"


def prompt_texts(n: int, words: bool = False, long: bool = False) -> list[str]:
    """The ``n`` distinct prompts a run sends (bench/checks/invariance_margins.py replays them).

    ``words``: prompts of the words ``w<id>`` that the random checkpoints'
    word tokenizers know (bench/checkpoints/random_checkpoint.py). English
    text is all ``<unk>`` to them, whose embedding row is zero: every
    prompt then reads as the same zeros and every completion is ``<pad>``.
    ``long``: English prompts of more than 16 tokens (Gemma's tokenizer).
    The short ones (8-10 tokens) prefill alone on the NVFP4 GEMV, which
    takes up to 16 rows, and batched on the dequantize + matmul route; long
    ones take that route both ways.
    """
    if words:  # ids spread over the vocabulary, clear of the specials (< 21)
        return [" ".join(f"w{1000 + (7919 * (i * WORDS_PER_PROMPT + j)) % 200_000}" for j in range(WORDS_PER_PROMPT))
                for i in range(n)]  # fmt: skip
    tail = LONG_PROMPT_TAIL if long else ""
    return [f"Write a few sentences about {topic}{tail}." for topic in PROMPT_TOPICS[:n]]


def uninformative(alone: list[list[int]]) -> str | None:
    """Why comparisons against these completions cannot fail, or None.

    Distinct prompts that all complete to the same ids mean the model ignores
    them (a random checkpoint fed words its tokenizer lacks): any two cells
    then agree whether or not they compute the same thing.
    """
    if len(alone) > 1 and all(ids == alone[0] for ids in alone):
        return f"all {len(alone)} prompts complete to the same ids {alone[0][:6]}...: the model ignores the prompts"
    return None


@dataclass
class Greedy:
    ids: list[int]
    margins: list[float]
    """Per generated position: top-1 minus top-2 log probability (inf: one candidate)."""


def complete(port: int, model: str, prompt: str, tokens: int, margins: bool) -> Greedy:
    """One greedy completion; ``margins``: ask for the top-2 log probabilities."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "return_token_ids": True}
    if margins:
        body["logprobs"] = 2
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    choice = json.loads(urllib.request.urlopen(request, timeout=600).read())["choices"][0]
    margins = []
    for top in (choice.get("logprobs") or {}).get("top_logprobs") or []:
        best = sorted((top or {}).values(), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return Greedy(choice.get("token_ids") or [], margins)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(prompt: int, expected: Greedy, got: list[int]) -> dict:
    """One request's row: ``got`` against ``expected`` (whose margins price a difference)."""
    diverges = first_difference(expected.ids, got)
    margin = expected.margins[diverges] if diverges is not None and diverges < len(expected.margins) else None
    got_there = got[diverges] if diverges is not None and diverges < len(got) else None
    return {"prompt": prompt, "identical": diverges is None, "first_difference": diverges, "margin": margin,
            "got": got_there}  # fmt: skip


@dataclass
class Completions:
    """A cell's completions: alone, and batched at each concurrency."""

    alone: list[Greedy]
    batched: dict[int, list[Greedy]] = field(default_factory=dict)


def check_cell(
    port: int, model: str, prompts: list[str], tokens: int, concurrencies: list[int],
    reference: Completions | None, margins: bool,
) -> tuple[dict, Completions]:
    """(the cell's result, its completions). With ``reference`` (another cell's
    completions), every completion is also compared with the reference's alone
    and, batched, with the reference's at the same concurrency: where a model is
    not batch invariant by itself, only the second can tell a drafter's fault."""
    alone = [complete(port, model, p, tokens, margins) for p in prompts]
    mine = Completions(alone)
    result: dict = {"alone": [g.ids for g in alone], "batched": {}, "batched_ids": {}, "vs_reference": {},
                    "vs_reference_batched": {}}  # fmt: skip
    if reference is not None:
        result["vs_reference"][1] = [compare(i, reference.alone[i], g.ids) for i, g in enumerate(alone)]
    for concurrency in concurrencies:
        repeats = -(-concurrency // len(prompts))
        requests = [i for _ in range(repeats) for i in range(len(prompts))]
        with ThreadPoolExecutor(concurrency) as pool:
            batched = list(pool.map(lambda i: complete(port, model, prompts[i], tokens, margins), requests))
        mine.batched[concurrency] = batched
        result["batched_ids"][concurrency] = [g.ids for g in batched]
        result["batched"][concurrency] = [compare(i, alone[i], g.ids) for i, g in zip(requests, batched)]
        if reference is not None:
            result["vs_reference"][concurrency] = [compare(i, reference.alone[i], g.ids) for i, g in zip(requests, batched)]
            theirs = reference.batched.get(concurrency)
            if theirs is not None:
                result["vs_reference_batched"][concurrency] = [
                    compare(i, expected, g.ids) for i, expected, g in zip(requests, theirs, batched)
                ]
    return result, mine


def summary_row(spec: str, concurrency: int, rows: list[dict]) -> str:
    same = sum(r["identical"] for r in rows)
    diffs = sorted((r["first_difference"], r["margin"]) for r in rows if not r["identical"])
    shown = ", ".join(f"{p} ({m:.3f})" if m is not None else f"{p} (-)" for p, m in diffs[:6])
    return f"| {spec} | {concurrency} | {same}/{len(rows)} | {shown or '-'} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--cells", nargs="+", required=True)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-words", action="store_true",
                        help="prompts of w<id> words (the random checkpoints' word tokenizers know nothing else)")
    parser.add_argument("--long-prompts", action="store_true",
                        help="English prompts of more than 16 tokens: their prefill takes one NVFP4 route alone and batched")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--memory-fraction", type=float, default=0.3)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--port-base", type=int, default=8300)
    parser.add_argument("--ready-timeout", type=float, default=1500)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", help="a cell (one of --cells) every other cell is also compared with")
    parser.add_argument("--draft-model", type=Path, help="the Gemma 4 assistant of *-mtp3 cells")
    parser.add_argument("--mtp-target", type=Path, help="what *-mtp3 cells serve (default: --model)")
    parser.add_argument("--oracle-drafts", type=Path, help="write the reference's ids here for an oracle-drafted MTP cell")
    add_launch_args(parser)
    args = parser.parse_args()
    args.mtp_target = args.mtp_target or args.model
    if args.reference is not None and args.reference not in args.cells:
        parser.error(f"--reference {args.reference} is not one of --cells")
    if args.oracle_drafts is not None and args.reference is None:
        parser.error("--oracle-drafts writes the reference cell's ids: it needs --reference")
    # SIGTERM (h200_lease.sh stop) unwinds through the finally below, which stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.prompt_words and args.long_prompts:
        parser.error("--prompt-words and --long-prompts: choose one (word prompts are for the random checkpoints)")
    prompts = prompt_texts(args.prompts, args.prompt_words, args.long_prompts)
    cells = sorted((Cell.parse(spec) for spec in args.cells), key=lambda c: c.spec != args.reference)
    if any(cell.drafted_tokens for cell in cells) and not args.draft_model:
        parser.error("a *-mtp3 cell needs --draft-model (bench/checkpoints/make_random_gemma4_assistant.py writes one)")
    for cell in cells:
        if oracle_drafter.ENV_DRAFTS in cell.env and not cell.drafted_tokens:
            parser.error(f"{cell.spec}: the oracle replaces an MTP drafter's drafts: name a *-mtp3 cell")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.oracle_drafts is not None:
        oracle_drafter.clear(args.oracle_drafts)  # before any server could read it
    servers = {}
    results: dict = {}
    reference: Completions | None = None
    try:
        for i, cell in enumerate(cells):
            log = args.out.parent / f"serve-invariance-{cell.slug}.log"
            servers[cell.spec] = (launch(cell, args, args.port_base + i, log), args.port_base + i, log)
        for cell in cells:
            server, port, log = servers[cell.spec]
            try:
                wait_ready(server, port, log, args.ready_timeout)
            except (RuntimeError, TimeoutError) as error:
                print(f"FAILED to start {cell.spec}: {error}", flush=True)
                continue
            against = None if cell.spec == args.reference else reference
            overlap = cell.capture or cell.drafted_tokens > 0  # MAX refuses logprobs there
            try:
                results[cell.spec], completions = check_cell(
                    port, str(served_model(cell, args)), prompts, args.tokens, args.concurrency, against, not overlap
                )
            except urllib.error.HTTPError as error:
                print(f"FAILED {cell.spec}: HTTP {error.code}: {error.read().decode(errors='replace')[:500]}", flush=True)
                continue
            if cell.spec == args.reference:
                reference = completions
                if args.oracle_drafts is not None:
                    oracle_drafter.write_drafts(args.oracle_drafts, args.model, prompts, [g.ids for g in completions.alone])
            why = uninformative(results[cell.spec]["alone"])
            if why:
                results[cell.spec]["uninformative"] = why
                print(f"WARNING {cell.spec}: {why}; its comparisons cannot fail (--prompt-words?)", flush=True)
            args.out.write_text(json.dumps(results, indent=1))
            for concurrency, rows in results[cell.spec]["batched"].items():
                print(summary_row(cell.spec, concurrency, rows), flush=True)
    finally:
        for server, _, _ in servers.values():
            stop(server)
    print(f"\n{args.prompts} prompts, {args.tokens} greedy tokens, each alone then batched; model {args.model}")
    print("| cell | concurrency | identical to alone | first differences (position, margin nats) |\n|---|---|---|---|")
    for spec, result in results.items():
        for concurrency, rows in result["batched"].items():
            print(summary_row(spec, concurrency, rows))
    for spec, result in results.items():
        if "uninformative" in result:
            print(f"UNINFORMATIVE {spec}: {result['uninformative']}")
    if args.reference is not None:
        print(f"\nagainst {args.reference} alone (concurrency 1 = each request alone)")
        print("| cell | concurrency | identical to the reference | first differences (position, margin nats) |\n|---|---|---|---|")
        for spec, result in results.items():
            for concurrency, rows in result["vs_reference"].items():
                print(summary_row(spec, concurrency, rows))
        print(f"\nagainst {args.reference} batched at the same concurrency")
        print("| cell | concurrency | identical to the reference | first differences (position, margin nats) |\n|---|---|---|---|")
        for spec, result in results.items():
            for concurrency, rows in result["vs_reference_batched"].items():
                print(summary_row(spec, concurrency, rows))
    if args.oracle_drafts is not None:
        print(f"\n{oracle_drafter.summarize(oracle_drafter.read_verified(args.oracle_drafts))[0]}")


if __name__ == "__main__":
    sys.exit(main())
