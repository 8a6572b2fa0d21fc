"""What the oracle drafter would have logged, had the target accepted exactly
the drafts that match its own tokens: to compare with a GPU run's totals
(``batch_invariance.py``'s last line) or, with ``--rows``, with its rows.

    python bench/checks/oracle_replay.py RESULTS.json --cell ORACLE_CELL --reference REFERENCE_CELL [--rows VERIFIED.jsonl]

RESULTS.json is ``batch_invariance.py --oracle-drafts``'s ``--out``. The
drafts were the reference cell's ids alone; each request's served ids (alone,
and at each concurrency) replay ``oracle_drafter.rows_of_a_correct_target``.
A run's totals equal to these say its target accepted as a correct one would
have, given what it served; they cannot say which rows differ when they do.
Prints one line per concurrency and their sum, in the drafter's words, each
with every row's count by accepted drafts (what the run's totals count).

``--rows`` (the drafter's JSONL, as the lease collects it) compares, request by
request, the rows of the requests sent alone (the first to appear, one per
prompt, in prompt order) with the replay's: equal rows are what a correct
target logs, not merely the same totals. The bonus token of a step past the
completion's end is not in the results, so it is not compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
import oracle_drafter  # noqa: E402


def replayed(served: list[list[int]], reference: list[list[int]]) -> list[dict]:
    """Every request's rows; request i drafted from reference i (the drafts file's order)."""
    n = len(reference)
    rows = []
    for request, ids in enumerate(served):
        index = request % n  # batch_invariance repeats the prompts in order
        for row in oracle_drafter.rows_of_a_correct_target(ids, reference[index], index):
            rows.append({**row, "request": str(request)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--cell", required=True, help="the oracle-drafted cell (its spec, or a unique part of it)")
    parser.add_argument("--reference", required=True, help="the cell whose ids alone were the drafts")
    parser.add_argument("--rows", type=Path, help="the drafter's verified rows (JSONL): compare the alone ones")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    [cell] = [spec for spec in results if args.cell in spec and spec != args.reference]
    reference = results[args.reference]["alone"]
    runs = {"c1": results[cell]["alone"], **{f"c{c}": ids for c, ids in results[cell]["batched_ids"].items()}}
    replays = {
        name: [{**row, "request": f"{name}/{row['request']}"} for row in replayed(served, reference)]
        for name, served in runs.items()
    }
    for name, rows in replays.items():
        print(f"{name}: {line(rows)}")
    print(f"in all: {line([row for rows in replays.values() for row in rows])}")
    if args.rows:
        print(compare_alone(oracle_drafter.read_rows(args.rows), replays["c1"]))


def by_request(rows: list[dict]) -> list[list[dict]]:
    """Each request's rows, requests in the order they first appear."""
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(row["request"], []).append(row)
    return list(grouped.values())


def compare_alone(logged: list[dict], replayed_alone: list[dict]) -> str:
    """How many requests sent alone logged exactly a correct target's rows."""
    def comparable(row: dict) -> dict:
        known = row["bonus_expected"] is not None  # None: the step past the completion's end
        return {key: value for key, value in row.items() if key != "request" and (key != "bonus" or known)}

    wanted = by_request(replayed_alone)
    got = by_request(logged)[: len(wanted)]  # the requests sent alone come first
    differing = [str(index) for index, (g, w) in enumerate(zip(got, wanted))
                 if [comparable(r) for r in g] != [comparable(r) for r in w]]  # fmt: skip
    differing += [str(index) for index in range(len(got), len(wanted))]  # no rows at all
    tail = f"; differing: requests {', '.join(differing)}" if differing else ""
    return f"rows of the requests sent alone equal to a correct target's: {len(wanted) - len(differing)}/{len(wanted)}{tail}"


def line(rows: list[dict]) -> str:
    counts = Counter(row["accepted"] for row in rows)
    every = ", ".join(f"{n}: {counts[n]}" for n in sorted(counts))
    return f"{oracle_drafter.summarize(rows)[0]}; every row by accepted drafts: {every}"


if __name__ == "__main__":
    main()
