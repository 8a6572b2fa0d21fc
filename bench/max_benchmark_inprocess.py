"""``max benchmark`` with its tokenizer work done in this process.

    python bench/max_benchmark_inprocess.py [max benchmark arguments...]

Runs MAX's own ``max benchmark`` entry point unchanged (requests, timing,
metrics and the result file are all MAX's) except for one thing: the dataset
code's tokenizer process pool. MAX spawns up to 16 worker processes, each
importing MAX and loading the tokenizer, twice per invocation, to decode a
few random prompts. On the H200 host with servers resident that cost 60-70 s
per trial against ~3 s of requests (2026-12-01), and it made one lease too
short for the trials an issue asks for. Here the pool's ``map`` runs in this
process with the parent's tokenizer: the same calls on the same tokenizer, so
the prompts are the same.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from max.benchmark.benchmark_shared.datasets import _tokenizer_pool


class _InProcessPool:
    """The part of ``multiprocessing.Pool`` that ``TokenizerPool`` uses."""

    def imap(self, fn: Callable[[Any], Any], items: Iterable[Any], chunksize: int = 1) -> Iterator[Any]:
        return map(fn, items)

    def close(self) -> None:
        pass

    def join(self) -> None:
        pass


def _in_process(pool: _tokenizer_pool.TokenizerPool) -> _InProcessPool:
    # The pool's worker callables read the module-level tokenizer a spawned
    # worker would have loaded; this process's own tokenizer is the same one.
    _tokenizer_pool._WORKER_TOK = pool.tokenizer
    return _InProcessPool()


def main() -> int:
    _tokenizer_pool.TokenizerPool._ensure_pool = _in_process  # type: ignore[method-assign]
    from max._entrypoints.pipelines import main as max_main

    sys.argv = ["max", "benchmark", *sys.argv[1:]]
    return max_main()


if __name__ == "__main__":
    sys.exit(main())
