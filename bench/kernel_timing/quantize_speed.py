"""NVFP4 quantization speed: attnquant vs MAX's host reference.

Prints MB/s of bfloat16 input (MB = 10**6 bytes) for an N x K bf16 tensor,
the median of several runs, for attnquant's RTN and MSE policies and for
``max.pipelines.weights.fp4_quantization.quantize_nvfp4`` measured in the same
run. The reference is slow, so it is timed on the first ``--reference-rows``
rows and its rate is computed from those rows' bytes (the output says so).

    .venv/bin/python bench/kernel_timing/quantize_speed.py                  # CPU, 8192 x 8192
    python3 bench/kernel_timing/quantize_speed.py --device cuda             # GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attnquant.formats import nvfp4  # noqa: E402


def load_reference(path: Path | None) -> ModuleType | None:
    """MAX's reference module from its file (it only needs numpy), or None.

    Without ``path``, it is looked up in the installed ``max`` package.
    """
    if path is None:
        spec = importlib.util.find_spec("max")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = (
            Path(list(spec.submodule_search_locations)[0]) / "pipelines/weights/fp4_quantization.py"
        )
    if not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location("max_fp4_reference", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def median_seconds(run: Callable[[], object], runs: int, device: torch.device) -> float:
    """Median wall time of ``runs`` calls after one warm-up call."""
    run()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reference-rows", type=int, default=128)
    parser.add_argument("--reference-runs", type=int, default=3)
    parser.add_argument(
        "--reference-file",
        type=Path,
        default=None,
        help="fp4_quantization.py, where MAX is not installed",
    )
    args = parser.parse_args()

    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    weight = (
        torch.randn(args.rows, args.cols, generator=generator, device=device) * 0.02
    ).bfloat16()
    megabytes = weight.numel() * weight.element_size() / 1e6

    rows: list[tuple[str, float, float]] = []  # (name, seconds, MB/s)
    for policy in nvfp4.ScalePolicy:
        seconds = median_seconds(
            lambda: nvfp4.quantize(weight, scale_policy=policy), args.runs, device
        )
        rows.append((f"attnquant {policy.value}", seconds, megabytes / seconds))

    reference = load_reference(args.reference_file)
    reference_rate = None
    if reference is not None:
        sample = weight[: args.reference_rows].float().cpu().numpy()
        sample_mb = sample.size * 2 / 1e6  # bytes of the bf16 input it stands for

        def run_reference() -> object:
            with np.errstate(all="ignore"):
                return reference.quantize_nvfp4(sample, reference.FP4Format.NVFP4)

        seconds = median_seconds(run_reference, args.reference_runs, torch.device("cpu"))
        reference_rate = sample_mb / seconds
        rows.append(
            (
                f"MAX reference ({args.reference_rows} rows, scaled)",
                seconds * args.rows / args.reference_rows,
                reference_rate,
            )
        )
        packed, scales, _ = run_reference()
        ours = nvfp4.quantize(weight[: args.reference_rows])
        identical = np.array_equal(ours.packed.cpu().numpy(), packed) and np.array_equal(
            ours.block_scale_bits().cpu().numpy(), scales.reshape(scales.shape[:-1])
        )

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"NVFP4 quantize, {args.rows}x{args.cols} bf16 ({megabytes:.0f} MB), device {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {load:.2f}, median of {args.runs} runs"
    )
    print(f"{'quantizer':<40} {'seconds':>9} {'MB/s':>9} {'x reference':>12}")
    for name, seconds, rate in rows:
        ratio = f"{rate / reference_rate:.1f}" if reference_rate else "n/a"
        print(f"{name:<40} {seconds:>9.3f} {rate:>9.1f} {ratio:>12}")
    if reference is None:
        print("MAX reference not installed here: no ratio")
    else:
        print(
            f"reference timed on the first {args.reference_rows} rows (median of {args.reference_runs}) "
            f"and scaled to {args.rows} rows; attnquant rtn output identical to it on those rows: "
            f"{'yes' if identical else 'NO'}"
        )


if __name__ == "__main__":
    main()
