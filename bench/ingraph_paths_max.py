"""Every in-graph path against precompute-outside, through our MAX architecture, at a real geometry.

    python bench/ingraph_paths_max.py CHECKPOINT [--gpu] [--cells 13:4 1:32]
        [--paths gemm graph-fold generated] [--prompt "w100 w200 w300"]

``tests/test_reconstruction_paths.py`` checks the paths on a two-layer stack
of toy widths, on CPU. This runs a whole checkpoint (e.g.
``make_random_gemma3.py``'s Gemma 3 1B) through our architecture with the
projections served each way (on CPU in float32, or with ``--gpu`` on the
accelerator in bfloat16) and prints, for one prompt, each path's
first-token margin (top-1 minus top-2 logit) and, for every pair of paths at
the same theta, the max |delta logit| over the full vocabulary and whether
every position keeps its top-1. precompute-outside serves W_eff rounded to
the checkpoint's bf16; the theta paths serve the same factors and should
agree with each other more closely than with it. Run 10
(docs/throughput.md) is why: on the H200 the GEMM and fold paths gave other
greedy texts than torch's bf16 emulation of every path. On CPU, agreement
says the paths' graphs are right at this geometry; with ``--gpu``, a delta
far above the CPU's says the device computes a path differently. One
compile per path (about ten minutes each on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnquant.verify import MaxSource  # noqa: E402

PATHS = {
    "precompute-outside": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "1"},
    "gemm": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "1"},
    "graph-fold": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_PRECOMPUTE": "1"},
    "generated": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "0"},
}


def path_logits(checkpoint: Path, window: list[int], cell: tuple[int, int], path: str, gpu: bool) -> torch.Tensor:
    """The logits at every position of ``window``, projections served by ``path``."""
    blocks, rank = cell
    env = {**os.environ, "ATTNQUANT_BLOCKS": str(blocks), "ATTNQUANT_RANK": str(rank),
           "ATTNQUANT_CACHE": "0", **PATHS[path]}  # fmt: skip
    source = MaxSource(checkpoint, env, gpu=gpu)
    logits = source(window)
    del source
    gc.collect()  # one model in memory at a time
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--gpu", action="store_true", help="bfloat16 on the accelerator (default: float32 on CPU)")
    parser.add_argument("--cells", nargs="+", default=["13:4"], help="G:R per theta")
    parser.add_argument("--paths", nargs="+", default=["gemm", "graph-fold", "generated"],
                        choices=[p for p in PATHS if p != "precompute-outside"])  # fmt: skip
    parser.add_argument("--prompt", default="w100 w200 w300")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    window = AutoTokenizer.from_pretrained(args.checkpoint)(args.prompt).input_ids
    for text in args.cells:
        cell = tuple(int(part) for part in text.split(":"))
        label = f"G={cell[0]} R={cell[1]}"
        logits = {}
        for path in ("precompute-outside", *args.paths):
            logits[path] = path_logits(args.checkpoint, window, cell, path, args.gpu)
            top = torch.topk(logits[path][-1], 2).values
            print(f"{label} {path:18s}: first-token margin {float(top[0] - top[1]):.4f}, "
                  f"max |logit| {float(logits[path].abs().max()):.2f}", flush=True)  # fmt: skip
        names = list(logits)
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                delta = float((logits[a] - logits[b]).abs().max())
                same = bool((logits[a].argmax(-1) == logits[b].argmax(-1)).all())
                print(f"{label} {a} vs {b}: max |delta logit| {delta:.2e}, same top-1 everywhere: {same}",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
