"""The theta dial, priced: what ATTNQUANT_BLOCKS below the layer count does to a model.

For every G dividing the layer count and every rank R in ``--ranks`` (the
largest projection's ``min(N, K)``, rebuilds every layer exactly),
with and without NVFP4: mean KL(checkpoint || served), top-1 agreement and
perplexity over ``--tokens`` tokens of a text (``attnquant verify
--reference transformers``'s measurement, float32 on the CPU), the mean and
worst per-layer relative reconstruction error (what the load line reports),
and the bytes of the theta bundle (W0 per band, s, U, V) against the
checkpoint's projections.

    python bench/quality/theta_dial.py [MODEL_DIR] [--tokens 2048] [--out rows.jsonl] [--nvfp4-below 1.0]

``--out`` also resumes: settings already in it are not measured again.
``--nvfp4-below KL`` skips NVFP4 on top of a theta setting whose KL alone is
at least KL (a model theta has already destroyed).

MODEL_DIR defaults to the embedded Gemma 3 270M. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from attnquant.config import AttnQuantConfig  # noqa: E402
from attnquant.formats.names import find_projections  # noqa: E402
from attnquant.formats.theta import build_theta  # noqa: E402
from attnquant.load.checkpoint import load_state_dict  # noqa: E402
from attnquant.load.precompute import num_layers_of, precompute_outside  # noqa: E402
from attnquant.load.report import unique_nbytes  # noqa: E402
from attnquant.tools.corpus import load_text  # noqa: E402
from attnquant.tools.verify import compare, text_windows, transformers_source  # noqa: E402


def theta_bytes(state: dict[str, torch.Tensor], blocks: int, rank: int, num_layers: int) -> int:
    """Bytes of the theta bundle as served in-graph: each band's W0 once, s, U, V."""
    keys = find_projections(state)
    theta = build_theta({k: state[k.weight_name] for k in keys}, blocks=blocks, rank=rank, num_layers=num_layers)
    factors = [t for layer in theta.layers.values() for t in (layer.scale, layer.u, layer.v)]
    return unique_nbytes([*theta.shared.values(), *factors])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, nargs="?")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--ranks", type=int, nargs="+", default=[0, 16, 64, -1], help="-1: the largest, min(N, K)")
    parser.add_argument("--text", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="one JSON row per setting")
    parser.add_argument("--nvfp4-below", type=float, default=math.inf,
                        help="measure NVFP4 on top of theta only where theta alone gives a KL below this")  # fmt: skip
    args = parser.parse_args()
    if args.model_dir is None:
        from attnquant.tools.demo_model import ensure_demo_model

        args.model_dir = ensure_demo_model()
    state = load_state_dict(args.model_dir)
    keys = find_projections(state)
    layers = num_layers_of(keys)
    full_rank = max(min(state[k.weight_name].shape) for k in keys)
    checkpoint_bytes = sum(state[k.weight_name].numel() * state[k.weight_name].element_size() for k in keys)
    windows = text_windows(args.model_dir, load_text(args.text), window=args.window, tokens=args.tokens)
    reference = transformers_source(args.model_dir, {})
    ref_cache = [reference(w) for w in windows]
    rows = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out and args.out.exists() else []
    done = {(r["blocks"], r["rank"], r["quant"]) for r in rows}  # --out resumes an interrupted run
    settings = [(g, r) for g in sorted((g for g in range(1, layers + 1) if layers % g == 0), reverse=True)
                for r in ([0] if g == layers else [full_rank if r < 0 else r for r in args.ranks])]  # fmt: skip
    print(f"{args.model_dir}: {layers} layers, projections {checkpoint_bytes / 2**20:.1f} MiB; {len(windows)} windows, "
          f"{args.tokens} tokens", flush=True)  # fmt: skip
    for blocks, rank in settings:
        theta_env = {"ATTNQUANT_BLOCKS": str(blocks), "ATTNQUANT_RANK": str(rank)}
        errors = None  # theta's reconstruction error: the same with or without NVFP4
        for quant in ("none", "nvfp4"):
            if (blocks, rank, quant) in done:
                continue
            theta_kl = next((r["kl_mean"] for r in rows if (r["blocks"], r["rank"], r["quant"]) == (blocks, rank, "none")), 0.0)
            if quant == "nvfp4" and theta_kl >= args.nvfp4_below:
                continue  # theta alone has destroyed the model already
            started = time.monotonic()
            env = {**theta_env, "ATTNQUANT_QUANT": quant}
            if errors is None:
                theta_only = AttnQuantConfig.from_env({**theta_env, "ATTNQUANT_QUANT": "none"})
                errors = precompute_outside(state, theta_only, keys=keys, progress=False).layer_errors
            candidate = transformers_source(args.model_dir, env)
            cached = iter(ref_cache)
            report = compare(lambda window: next(cached), candidate, windows)
            row = {
                "blocks": blocks, "rank": rank, "quant": quant, "kl_mean": report.kl_mean, "top1": report.top1_agreement,
                "ppl_ref": report.ppl_ref, "ppl": report.ppl_quant,
                "error_mean": sum(errors.values()) / len(errors), "error_max": max(errors.values()),
                "theta_mib": theta_bytes(state, blocks, rank, layers) / 2**20, "seconds": time.monotonic() - started,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n| G | R | quant | KL mean | top-1 % | ppl (ref {rows[0]['ppl_ref']:.2f}) | layer error mean / max "
          f"| theta MiB (checkpoint {checkpoint_bytes / 2**20:.1f}) |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        ppl = f"{r['ppl']:.3g}" if math.isfinite(r["ppl"]) else "inf"
        print(f"| {r['blocks']} | {r['rank']} | {r['quant']} | {r['kl_mean']:.4f} | {r['top1']:.1f} | {ppl} "
              f"| {r['error_mean']:.3f} / {r['error_max']:.3f} | {r['theta_mib']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
