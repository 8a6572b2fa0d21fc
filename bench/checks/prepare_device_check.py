"""Load-time preparation on the GPU against the CPU: same bits, and how long each takes.

``python3 bench/checks/prepare_device_check.py MODEL_DIR [--layers 2] [--scale-search rtn]``
runs ``precompute_outside`` (theta passthrough, NVFP4 on every projection) on
the projections of the first ``--layers`` decoder layers of a safetensors
checkpoint, once with ``device=cpu`` and once on the first GPU torch sees,
checks that every served tensor is bitwise equal, and prints a table of
seconds and bf16 GB/s (projection bytes in over wall time, transfers
included). Needs a CUDA (or ROCm) build of torch; no MAX.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attnquant.load.checkpoint import safetensors_files  # noqa: E402
from attnquant.config import AttnQuantConfig  # noqa: E402
from attnquant.formats.names import find_projections  # noqa: E402
from attnquant.load.precompute import precompute_outside  # noqa: E402

LAYER = re.compile(r"\.layers\.(\d+)\.")


def first_layers(model_dir: Path, layers: int) -> dict[str, torch.Tensor]:
    """The projection weights of decoder layers 0 .. layers-1."""
    tensors = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                match = LAYER.search(name)
                if match and int(match.group(1)) < layers:
                    tensors[name] = f.get_tensor(name)
    names = sorted({key.weight_name for key in find_projections(tensors)})
    return {name: tensors[name] for name in names}


def warmup_slice(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """16 rows of each of layer 0's projections: enough to start CUDA and load
    its kernels. A whole layer 0, since preparation refuses a checkpoint whose
    layers do not start at 0: a slice of any other layer would be refused."""
    return {name: t[:16] for name, t in state.items() if LAYER.search(name).group(1) == "0"}


def timed(state: dict[str, torch.Tensor], config: AttnQuantConfig, device: torch.device):
    start = time.perf_counter()
    served = precompute_outside(state, config, progress=False, device=device).state_dict
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return served, time.perf_counter() - start


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.element_size() == 1:  # uint8 codes, float8 scales: compare the bytes
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--scale-search", choices=("rtn", "mse"), default="rtn")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU visible to torch: nothing to compare", file=sys.stderr)
        return 2
    state = first_layers(args.model_dir, args.layers)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    config = AttnQuantConfig(quant="nvfp4", scale_search=args.scale_search, cache=False)
    gpu = torch.device("cuda", 0)
    timed(warmup_slice(state), config, gpu)  # CUDA context, kernels
    cpu_served, cpu_s = timed(state, config, torch.device("cpu"))
    gpu_served, gpu_s = timed(state, config, gpu)
    differ = [name for name, t in cpu_served.items() if not same_bits(t, gpu_served[name])]
    print(f"{len(state)} projections of {args.layers} layers, {nbytes / 2**30:.2f} GiB bf16, scale search {args.scale_search}")
    print("| device | seconds | GB/s | served tensors equal to the CPU's |\n|---|---|---|---|")
    print(f"| cpu ({torch.get_num_threads()} threads) | {cpu_s:.1f} | {nbytes / cpu_s / 1e9:.2f} | - |")
    print(f"| {torch.cuda.get_device_name(gpu)} | {gpu_s:.2f} | {nbytes / gpu_s / 1e9:.1f} | "
          f"{len(cpu_served) - len(differ)}/{len(cpu_served)} |")
    for name in differ[:5]:
        print(f"differs: {name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
