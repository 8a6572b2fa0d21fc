"""bf16 noise: what running a model in bfloat16 instead of float32 does to its predictions.

``attnquant verify --device gpu`` runs both models in bfloat16 (the served
dtype), ``--device cpu`` in float32. Their figures for the same setting
differ by what bfloat16 rounding does; this measures that yardstick on the
CPU with transformers: the checkpoint's own weights in float32 against the
same weights in bfloat16, over the same windows and with the same metrics
as ``attnquant verify`` (``attnquant.tools.verify.compare``).

    python bench/quality/bf16_noise.py [MODEL_DIR] [--tokens 20000] [--text FILE]

MODEL_DIR defaults to the embedded Gemma 3 270M. Prints verify's report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from attnquant.tools.corpus import load_text  # noqa: E402
from attnquant.tools.verify import compare, text_windows, transformers_source  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, nargs="?")
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--text", type=Path, default=None)
    args = parser.parse_args()
    if args.model_dir is None:
        from attnquant.tools.demo_model import ensure_demo_model

        args.model_dir = ensure_demo_model()
    windows = text_windows(args.model_dir, load_text(args.text), window=args.window, tokens=args.tokens)
    float32 = transformers_source(args.model_dir, {}, dtype=torch.float32)
    bfloat16 = transformers_source(args.model_dir, {}, dtype=torch.bfloat16)
    report = compare(float32, bfloat16, windows, progress=True)
    print(f"{args.model_dir}: unquantized, transformers bfloat16 vs float32 on the CPU; {len(windows)} windows")
    for line in report.lines():
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
