"""Every in-graph path against precompute-outside and torch, through our MAX architecture, at a real geometry.

    python bench/checks/ingraph_paths_max.py CHECKPOINT [--gpu] [--cells 13:4 26:0]
        [--paths precompute-outside gemm graph-fold generated ...]
        [--save DIR] [--load DIR] [--prompts "w100" "w100 w200 w300" ...]

``tests/test_reconstruction_paths.py`` checks the paths on a two-layer stack
of toy widths, on CPU. This runs a whole checkpoint (e.g.
``make_random_gemma3.py``'s Gemma 3 1B) for a few prompts (1, 3 and 12
tokens by default: on sm_90 MAX runs one row as a GEMV, more with its
tensor-core kernel) and prints, per theta cell (G:R) and prompt, each
source's full-vocabulary logits at every position against a baseline: max
and mean |delta logit|, whether every position keeps the baseline's top-1,
and the next token's margin (top-1 minus top-2). Sources:

- our architecture with the projections served each way (``PATHS``): on CPU
  in float32, or with ``--gpu`` on the accelerator in bfloat16;
- ``builtin``: MAX's own architecture for the checkpoint. It serves the
  checkpoint's weights, so it belongs in a passthrough cell (G = layers,
  e.g. ``26:0``); it is built first, before ours is registered, and only
  with ``--gpu`` (on CPU MAX 26.7 refuses it float32);
- ``torch-float32`` / ``torch-bfloat16``: transformers on the same device
  with precompute-outside's W_eff (``attnquant.tools.verify.transformers_source``).
  torch-float32 is the baseline when present; torch-bfloat16's distance
  from it is what bf16 rounding alone costs this model.

Why it exists (H200, 2026-12-01 and 12-02; docs/dev/lab-log.md): there the
GEMM and fold paths gave other greedy texts than torch's bf16 emulation of
every path, and precompute-outside's logits were 5.2 away from
``generated``'s; MAX's own Gemma 3 was as far from torch-float32 as
precompute-outside (4.8 at 3 and 12 tokens, 7.4e-2 at 1), ``generated`` was
within bf16 rounding, and precompute-outside came within it too once
``attnquant.graph.matmul`` padded its rows
(``bench/results/2026-12-02-h200-run12.txt``). On CPU,
agreement says the paths' graphs are right at this geometry; on the GPU, a source much
further from torch-float32 than torch-bfloat16 is says the device computes
it differently. One compile per MAX source (about ten minutes each on 2 CPU
cores, three on the H200), so a device lease splits the sources over
several calls: ``--save DIR`` writes each source's logits, ``--load DIR``
brings earlier calls' logits into the comparison.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attnquant.tools.verify import MaxSource, transformers_source  # noqa: E402

PATHS = {
    "precompute-outside": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "1"},
    # Every projection its own matmul: no q|k|v or gate|up output to split.
    "precompute-unfused": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "1", "ATTNQUANT_QKV_FUSE": "0"},
    "gemm": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "1"},
    "graph-fold": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_PRECOMPUTE": "1"},
    "generated": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "0"},
    # generated_linear projections, with MAX's activation and multiply between them.
    "generated-unfused-mlp": {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "0",
                              "ATTNQUANT_FUSED_MLP": "0"},  # fmt: skip
}
TORCH = {"torch-float32": torch.float32, "torch-bfloat16": torch.bfloat16}
SOURCES = ("builtin", *TORCH, *PATHS)
# 1, 3 and 12 tokens: MAX on sm_90 runs a 1-row matmul as a GEMV and more
# rows with its tensor-core kernel (modular/modular#6883 saw rows from 8 on wrong).
DEFAULT_PROMPTS = ["w100", "w100 w200 w300", " ".join(f"w{100 * i}" for i in range(1, 13))]


def cell_env(cell: tuple[int, int], path: str | None) -> dict[str, str]:
    blocks, rank = cell
    env = {**os.environ, "ATTNQUANT_BLOCKS": str(blocks), "ATTNQUANT_RANK": str(rank), "ATTNQUANT_CACHE": "0"}
    return {**env, **PATHS[path]} if path else env


def source_logits(
    checkpoint: Path, windows: dict[str, list[int]], cell: tuple[int, int], name: str, gpu: bool
) -> dict[str, torch.Tensor]:
    """Prompt -> the logits at every position of its window, from source ``name``
    (one model build for every window)."""
    if name in TORCH:
        device = "cuda" if gpu else "cpu"
        source = transformers_source(checkpoint, cell_env(cell, None), device=device, dtype=TORCH[name])
    elif name == "builtin":
        source = MaxSource(checkpoint, cell_env(cell, None), gpu=gpu, builtin=True)
    else:
        source = MaxSource(checkpoint, cell_env(cell, name), gpu=gpu)
    logits = {prompt: source(window) for prompt, window in windows.items()}
    del source
    gc.collect()  # one model in memory at a time
    if gpu:
        torch.cuda.empty_cache()  # MAX sizes its KV cache from the free device memory
    return logits


def compare(label: str, logits: dict[str, torch.Tensor], baseline: str) -> None:
    """One line per source: its distance from ``baseline``'s logits."""
    base = logits[baseline]
    print(f"{label}: every source against {baseline} (max |logit| {float(base.abs().max()):.2f})")
    print("| source | max abs delta | mean abs delta | same top-1 everywhere | next-token margin | next token |")
    print("|---|---|---|---|---|---|")
    for name, values in logits.items():
        delta = (values - base).abs()
        same = bool((values.argmax(-1) == base.argmax(-1)).all())
        top = torch.topk(values[-1], 2)
        margin = float(top.values[0] - top.values[1])
        print(f"| {name} | {float(delta.max()):.2e} | {float(delta.mean()):.2e} | {same} | "
              f"{margin:.4f} | {int(top.indices[0])} |", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--gpu", action="store_true", help="bfloat16 on the accelerator (default: float32 on CPU)")
    parser.add_argument("--cells", nargs="+", default=["13:4"], help="G:R per theta")
    parser.add_argument("--paths", nargs="+", default=["precompute-outside", "gemm", "graph-fold", "generated"],
                        choices=SOURCES, help="sources to run in this call")  # fmt: skip
    parser.add_argument("--save", type=Path, help="write each source's logits here")
    parser.add_argument("--load", type=Path, help="compare with logits an earlier call saved here")
    parser.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS,
                        help="one window each (the random checkpoint's tokenizer: one token per word)")  # fmt: skip
    args = parser.parse_args()
    if "builtin" in args.paths and not args.gpu:
        parser.error("builtin needs --gpu: MAX 26.7's own Gemma 3 refuses float32, and bfloat16 on CPU")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    windows = {prompt: tokenizer(prompt).input_ids for prompt in args.prompts}
    # torch first (it hands its memory back), then MAX's own architecture
    # before ours registers over its name.
    names = sorted(dict.fromkeys(args.paths), key=lambda name: (name not in TORCH, name != "builtin"))
    for text in args.cells:
        cell = tuple(int(part) for part in text.split(":"))
        stem = f"G{cell[0]}R{cell[1]}"
        logits: dict[str, dict[str, torch.Tensor]] = {}
        if args.load:
            for file in sorted(args.load.glob(f"{stem}-*.pt")):
                logits[file.stem.removeprefix(f"{stem}-")] = torch.load(file)
        for name in names:
            logits[name] = source_logits(args.checkpoint, windows, cell, name, args.gpu)
            if args.save:
                args.save.mkdir(parents=True, exist_ok=True)
                torch.save(logits[name], args.save / f"{stem}-{name}.pt")
        baseline = "torch-float32" if "torch-float32" in logits else next(iter(logits))
        for prompt, window in windows.items():
            label = f"G={cell[0]} R={cell[1]}, {'GPU bfloat16' if args.gpu else 'CPU float32'}, {len(window)} tokens"
            compare(label, {name: by_prompt[prompt] for name, by_prompt in logits.items() if prompt in by_prompt},
                    baseline)  # fmt: skip


if __name__ == "__main__":
    main()
