"""Prices each batch-invariance difference with a float32 host reference.

Capturing servers cannot return log probabilities (MAX refuses them under the
overlap scheduler), so ``bench/harness/batch_invariance.py`` prints ``(-)``
for their margins. This script takes its ``--out`` file from the GPU and, for
every request whose batched ids left its ids alone, replays the shared prefix
through transformers in float32 with the weights that cell serves
(``attnquant.tools.verify.transformers_model``: NVFP4 dequantized on the host)
and prints, at the first diverging position, the log-probability gap between
the token chosen alone and float32's best other token (and the token chosen
batched, where the results record it). A gap far below the bf16
resolution of the logits (about 0.125 at |logit| 16–32) is a near-tie that
any change of summation order can flip; a large gap means a corrupted
computation. Where the logits are flat by construction (random weights:
the whole vocabulary within a nat) every gap is small, so it also prints
each token's float32 rank (how many tokens float32 puts above it): rounding
picks among float32's first few, a corrupted buffer anywhere in the
vocabulary. As a check of the replay itself it prints how many requests'
first token alone is float32's greedy token, the worst float32 rank of
those first tokens (how far rounding alone reaches on this model), and the
ranks of another prompt's first token (where a token computed from the wrong
sequence's context lands: what a mixed-up batch would look like).

    python bench/checks/invariance_margins.py RESULTS.json --model ~/.cache/attnquant/models/gemma3-270m

With ``--reference CELL`` (the MTP check: ``batch_invariance.py --reference``) each
other cell's departures from the reference's ids are priced the same way, at
the reference's ids.

RESULTS.json may hold several JSON objects one after another (the lease's
collected file); cells are matched by name.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from batch_invariance import prompt_texts  # noqa: E402
from serve_benchmark import VARIANTS, Cell  # noqa: E402

from attnquant.tools.verify import transformers_model  # noqa: E402


def read_results(path: Path) -> dict:
    """Every cell of every JSON object in ``path`` (objects written back to back)."""
    text, decoder, cells, at = path.read_text(), json.JSONDecoder(), {}, 0
    while at < len(text.rstrip()):
        while text[at].isspace():
            at += 1
        obj, at = decoder.raw_decode(text, at)
        cells.update(obj)
    return cells


def cell_env(spec: str) -> dict[str, str]:
    """The ATTNQUANT_* settings a cell served with (its weights)."""
    cell = Cell.parse(spec)
    env = {**VARIANTS[cell.variant][1], **cell.env}
    return {**{k: v for k, v in env.items() if k.startswith("ATTNQUANT_")}, "ATTNQUANT_CACHE": "0"}


@torch.no_grad()
def log_probs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)


def differences(result: dict) -> list[tuple[int, int, str, int | None]]:
    """(prompt, first diverging position, concurrency, token batched if recorded)."""
    alone, seen = result["alone"], set()
    for concurrency, rows in result["batched"].items():
        for row in rows:
            pos = row["first_difference"]
            if row["identical"] or pos is None or pos >= len(alone[row["prompt"]]):
                continue
            seen.add((row["prompt"], pos, str(concurrency), row.get("got")))
    return sorted(seen)


def reference_differences(result: dict, reference: dict) -> list[tuple[int, int, str, list[int], int | None]]:
    """A cell's departures from the reference cell: (prompt, position, what it is
    compared with, the reference's ids there, this cell's token there). Alone against
    the reference alone; batched against the reference batched at the same concurrency."""
    found = []
    for row in result.get("vs_reference", {}).get("1", []):
        expected = reference["alone"][row["prompt"]]
        if not row["identical"] and row["first_difference"] < len(expected):
            found.append((row["prompt"], row["first_difference"], "reference alone", expected, row["got"]))
    for concurrency, rows in result.get("vs_reference_batched", {}).items():
        for expected, row in zip(reference["batched_ids"][concurrency], rows):
            if not row["identical"] and row["first_difference"] < len(expected):
                found.append((row["prompt"], row["first_difference"], f"reference c={concurrency}", expected, row["got"]))
    return found


def rank(lp: torch.Tensor, token: int) -> int:
    """How many tokens float32 puts above ``token`` (0: its greedy choice)."""
    return int((lp > lp[token]).sum())


def price(model: torch.nn.Module, prompt: list[int], expected: list[int], pos: int, got: int | None) -> str:
    """``| expected − best other | expected − got | ranks |`` at ``pos`` after ``expected[:pos]``, float32."""
    lp = log_probs(model, prompt + expected[:pos])
    others = lp.clone()
    others[expected[pos]] = -torch.inf
    gap = float(lp[expected[pos]] - others.max())
    to_got = f"{float(lp[expected[pos]] - lp[got]):+.4f}" if got is not None else "-"
    ranks = f"{rank(lp, expected[pos])}, {rank(lp, got) if got is not None else '-'}"
    return f"{gap:+.4f} | {to_got} | {ranks}"


def first_token_control(model: torch.nn.Module, prompts: list[list[int]], alone: list[list[int]]) -> str:
    """How far rounding reaches, and how far a wrong context lands, in float32 ranks.

    Each prompt's first token alone is ranked under its own prompt (what bf16
    rounding alone does) and under the next prompt (what a token computed from
    another sequence's context would look like): a departure that ranks like
    the first is rounding, one that ranks like the second is a mixed-up batch.
    """
    lps = [log_probs(model, prompt) for prompt in prompts]
    own = [rank(lp, ids[0]) for lp, ids in zip(lps, alone)]
    wrong = sorted(rank(lps[i], alone[(i + 1) % len(alone)][0]) for i in range(len(alone)))
    return (
        f"float32 greedy first token = GPU's alone for {own.count(0)}/{len(own)} prompts; the GPU's first"
        f" tokens alone rank at most {max(own)} in float32; the next prompt's first token ranks"
        f" {wrong[0]} at least, {wrong[len(wrong) // 2]} at the median"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--cells", nargs="*", help="cells to price (default: every attnquant cell)")
    parser.add_argument("--reference", help="also price each cell's departures from this cell (the MTP check's)")
    parser.add_argument("--prompt-words", action="store_true", help="the run used batch_invariance.py --prompt-words")
    parser.add_argument("--long-prompts", action="store_true", help="the run used batch_invariance.py --long-prompts")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    results = read_results(args.results)
    specs = args.cells or [s for s in results if s.startswith("attnquant")]
    print(
        "| cell | prompt | position | against | float32: expected token − best other (nats) | expected − got"
        " | float32 rank of expected, got |"
    )
    print("|---|---|---|---|---|---|---|")
    for spec in specs:
        result = results[spec]
        model = transformers_model(args.model, cell_env(spec))
        prompts = [tokenizer(text).input_ids for text in prompt_texts(len(result["alone"]), args.prompt_words, args.long_prompts)]
        print(f"<!-- {spec}: {first_token_control(model, prompts, result['alone'])} -->")
        by_place: dict[tuple[int, int], list[str]] = {}
        got: dict[tuple[int, int], int | None] = {}
        for prompt, pos, concurrency, token in differences(result):
            by_place.setdefault((prompt, pos), []).append(concurrency)
            got[(prompt, pos)] = token
        name = Cell.parse(spec).label
        for (prompt, pos), concurrencies in sorted(by_place.items()):
            against = "alone, batched c=" + ",".join(concurrencies)
            priced = price(model, prompts[prompt], result["alone"][prompt], pos, got[(prompt, pos)])
            print(f"| {name} | {prompt} | {pos} | {against} | {priced} |")
        if args.reference and spec != args.reference:
            for prompt, pos, against, expected, token in reference_differences(result, results[args.reference]):
                print(f"| {name} | {prompt} | {pos} | {against} | {price(model, prompts[prompt], expected, pos, token)} |")
        del model


if __name__ == "__main__":
    main()
