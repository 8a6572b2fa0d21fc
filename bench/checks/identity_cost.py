"""What the checkpoint identity (the cache key's hash of every checkpoint byte) costs at load.

For each MODEL_DIR: the seconds of ``attnquant.load.checkpoint.checkpoint_identity``
the first time (every file hashed; the page cache warmed first, so this is the
hash, not the disk), and again with its fingerprints stored (a later load of
unchanged files), in seconds and GB/s of safetensors bytes.

    python bench/checks/identity_cost.py MODEL_DIR [MODEL_DIR ...] [--repeat 3]

``--sized GB`` adds a checkpoint-shaped file of that many GB of random bytes
(a stand-in for one shard of a large checkpoint: the hash reads bytes, not
tensors). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from attnquant.load.checkpoint import checkpoint_identity, safetensors_files  # noqa: E402


def shard(directory: Path, gigabytes: float) -> Path:
    """A safetensors file of one uint8 tensor of ``gigabytes`` random bytes."""
    size = int(gigabytes * 1e9)
    header = json.dumps({"w": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    path = directory / "model.safetensors"
    block = os.urandom(64 * 2**20)
    with path.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for start in range(0, size, len(block)):
            f.write(block[: min(len(block), size - start)])
    (directory / "config.json").write_text("{}")
    time.sleep(2.1)  # fingerprints are stored only for files that had settled
    return directory


def warm(model_dir: Path) -> int:
    """Reads every file once (into the page cache); returns the bytes."""
    total = 0
    for path in safetensors_files(model_dir):
        with path.open("rb") as f:
            while chunk := f.read(64 * 2**20):
                total += len(chunk)
    return total


def measure(model_dir: Path, repeat: int) -> tuple[int, float, float]:
    """(bytes, first-hash seconds (median), reuse seconds (median))."""
    size = warm(model_dir)
    first, reuse = [], []
    for _ in range(repeat):
        with tempfile.TemporaryDirectory() as store:
            started = time.perf_counter()
            identity = checkpoint_identity(model_dir, Path(store))
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            assert checkpoint_identity(model_dir, Path(store)) == identity
            reuse.append(time.perf_counter() - started)
    return size, statistics.median(first), statistics.median(reuse)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dirs", type=Path, nargs="*")
    parser.add_argument("--sized", type=float, nargs="*", default=[], help="random shards of these GB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; median of {args.repeat}\n")
    print("| checkpoint | GB | first load s | GB/s | later load s |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        dirs = [(str(d), d) for d in args.model_dirs]
        for i, gigabytes in enumerate(args.sized):
            directory = Path(scratch) / f"shard{i}"
            directory.mkdir()
            dirs.append((f"random shard, {gigabytes:g} GB", shard(directory, gigabytes)))
        for label, directory in dirs:
            size, first, reuse = measure(directory, args.repeat)
            print(f"| {label} | {size / 1e9:.2f} | {first:.2f} | {size / 1e9 / first:.2f} | {reuse:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
