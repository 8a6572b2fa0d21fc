"""``max benchmark`` with its tokenizer work done in this process.

    python bench/harness/max_benchmark_inprocess.py [--repeat N] [max benchmark arguments...]
    python bench/harness/max_benchmark_inprocess.py --plan FILE [max benchmark arguments...]

Runs MAX's own ``max benchmark`` entry point unchanged (requests, timing,
metrics and the result file are all MAX's) except for one thing: the dataset
code's tokenizer process pool. MAX spawns up to 16 worker processes, each
importing MAX and loading the tokenizer, twice per invocation, to decode a
few random prompts. On the H200 host with servers resident that cost 60-70 s
per trial against ~3 s of requests (2026-12-01), and it made one lease too
short for the trials a comparison needs. Here the pool's ``map`` runs in this
process with the parent's tokenizer: the same calls on the same tokenizer, so
the prompts are the same.

``--repeat N`` (default 1) runs the benchmark N times in this process (one
import of MAX for N trials); run i writes ``--result-filename``'s stem + ``-i``
(``r.json`` → ``r-0.json``, ``r-1.json``, ...). It stops at the first failed
run.

``--plan FILE`` instead runs a list of benchmarks in this process, one after
the other: FILE holds a JSON list of ``{"args": [max benchmark arguments...],
"result": path, "repeat": N}``, each run as above. Importing MAX costs ~20 s on
the H200's host, so cells measured in turn (serve_benchmark.py ``--rounds``)
share one import. A failed entry is reported and the next one runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # MAX is imported by main(): the harness imports trial_results cheaply
    from max.benchmark.benchmark_shared.datasets._tokenizer_pool import TokenizerPool


class _InProcessPool:
    """The part of ``multiprocessing.Pool`` that ``TokenizerPool`` uses."""

    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any], chunksize: int = 1) -> Iterator[Any]:
        return map(fn, items)

    def close(self) -> None:
        pass

    def join(self) -> None:
        pass


def _in_process(pool: TokenizerPool) -> _InProcessPool:
    from max.benchmark.benchmark_shared.datasets import _tokenizer_pool

    # The pool's worker callables read the module-level tokenizer a spawned
    # worker would have loaded; this process's own tokenizer is the same one.
    _tokenizer_pool._WORKER_TOK = pool.tokenizer
    return _InProcessPool()


def trial_results(result: Path, repeat: int) -> list[Path]:
    """Where run i of ``--repeat`` writes its result."""
    return [result.with_name(f"{result.stem}-{i}{result.suffix}") for i in range(repeat)]


def _run_repeated(max_main: Callable[[], Any], passthrough: list[str], result: Path | None, repeat: int) -> int:
    results = trial_results(result, repeat) if result else [None] * repeat
    for path in results:
        sys.argv = ["max", "benchmark", *passthrough, *(["--result-filename", str(path)] if path else [])]
        try:
            code = max_main()
        except SystemExit as done:  # the CLI may exit instead of returning
            code = done.code
        if code:
            return int(code)
    return 0


def main() -> int:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--repeat", type=int, default=1)
    ours.add_argument("--result-filename", type=Path)
    ours.add_argument("--plan", type=Path)
    args, passthrough = ours.parse_known_args()
    from max._entrypoints.pipelines import main as max_main
    from max.benchmark.benchmark_shared.datasets._tokenizer_pool import TokenizerPool

    TokenizerPool._ensure_pool = _in_process  # type: ignore[method-assign]

    if args.plan is None:
        return _run_repeated(max_main, passthrough, args.result_filename, args.repeat)
    failed = 0
    for entry in json.loads(args.plan.read_text()):
        code = _run_repeated(max_main, [*passthrough, *entry["args"]], Path(entry["result"]), entry["repeat"])
        if code:
            print(f"FAILED plan entry {entry['result']} ({code})", file=sys.stderr, flush=True)
            failed = code
    return failed


if __name__ == "__main__":
    sys.exit(main())
