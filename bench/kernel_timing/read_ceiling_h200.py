"""How fast can one kernel launch read a projection's bytes on this GPU?

The kernels issue asks each Gemma 4 31B projection's GEMV to reach 85 % of
copy bandwidth in one launch at one row. Our own load-only kernel (ld0) does
not on q|k|v, o or down. This script asks whether any kernel does: for the
NVFP4 byte count of each shape it times, each in one launch per weight,

  sum     torch.sum over the bytes (as bf16): a read-only reduction;
  copy    Tensor.copy_ of half the bytes (reads half, writes half);
  cublas  torch.matmul of one bf16 row by a bf16 weight of the same bytes
          ([n', k], n' = bytes / 2k): cuBLAS's GEMV;
  tsum    a Triton kernel that reads the bytes with 16-byte loads, one tile
          per program, and adds its tile's sum into one float (atomics);
  tsump   the same, persistent: 4 programs per SM, each striding over tiles;
  ld0     our load-only diagnostic (nvfp4_ptx_harness.mojo), kw 4 and 8;
  gv0     our GEMV, kw 4 and 8,

each with CUDA-graph replay over copies rotated past L2 (kernels_h200.time_graph),
so every launch reads from HBM. For each kernel it prints us and % of copy
bandwidth per shape, and a fit t = bytes / stream + fixed over the shapes: the
fixed cost per launch is what keeps a short kernel under a given fraction.

HERE (no GPU): MOJO=.venv/bin/mojo bash bench/kernel_timing/build_ptx.sh
ON THE DEVICE: python3 bench/kernel_timing/read_ceiling_h200.py --out $OUT
(carry bench/ptx, no MAX; under a minute). --dry-run checks the flow on the CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_h200 as kh  # noqa: E402  (this folder: the loader, weights and timing)

from kernels.sm90_layout import prepare_weights  # noqa: E402  (kernels_h200 put the root on sys.path)

TILE_BYTES = 16384  # per Triton program: 1024 16-byte loads


def triton_kernels():
    """(one tile per program, persistent) Triton read-and-sum kernels, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def tile_sum(src, out, n_words, WORDS: tl.constexpr):
        offs = tl.program_id(0) * WORDS + tl.arange(0, WORDS)
        v = tl.load(src + offs, mask=offs < n_words, other=0)
        tl.atomic_add(out, tl.sum(v.to(tl.float32), axis=0))

    @triton.jit
    def tile_sum_persistent(src, out, n_words, n_tiles, WORDS: tl.constexpr):
        acc = tl.zeros((WORDS,), dtype=tl.float32)
        for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
            offs = t * WORDS + tl.arange(0, WORDS)
            acc += tl.load(src + offs, mask=offs < n_words, other=0).to(tl.float32)
        tl.atomic_add(out, tl.sum(acc, axis=0))

    return tile_sum, tile_sum_persistent


class Readers:
    """Every reader of one byte count, over `copies` buffers rotated past L2."""

    def __init__(self, n: int, k: int, copies: int, dev: torch.device, gen: torch.Generator) -> None:
        self.n, self.k = n, k
        self.nbytes = int(n * k * kh.FP4_BYTES_PER_WEIGHT)
        words = self.nbytes // 4  # int32 words: Triton's 16-byte loads are 4 of them
        self.flat = [torch.randint(-2**30, 2**30, (words,), dtype=torch.int32, device=dev, generator=gen)
                     for _ in range(copies)]
        self.out = torch.zeros(1, dtype=torch.float32, device=dev)
        rows16 = max(1, self.nbytes // (2 * k))
        self.w16 = [f.view(torch.bfloat16)[: rows16 * k].view(rows16, k) for f in self.flat]
        self.x16 = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        self.y16 = torch.empty(1, rows16, dtype=torch.bfloat16, device=dev)
        self.half = [torch.empty(words // 2, dtype=torch.int32, device=dev) for _ in range(copies)]

    def sum(self) -> None:
        for f in self.flat:
            torch.sum(f.view(torch.bfloat16).view(1, -1), dim=1, out=self.out)

    def copy(self) -> None:
        for f, h in zip(self.flat, self.half):
            h.copy_(f[: h.numel()])

    def cublas(self) -> None:
        for w in self.w16:
            torch.matmul(self.x16, w.T, out=self.y16)

    def triton(self, kernel, persistent: bool, sms: int) -> None:
        words = TILE_BYTES // 4
        for f in self.flat:
            tiles = -(-f.numel() // words)
            if persistent:
                kernel[(min(tiles, 4 * sms),)](f, self.out, f.numel(), tiles, WORDS=words)
            else:
                kernel[(tiles,)](f, self.out, f.numel(), WORDS=words)


class OurKernels:
    """ld0 and gv0 on prepared NVFP4 weights of the same shape (the bytes they read)."""

    def __init__(self, ks, n: int, k: int, copies: int, dev: torch.device, gen: torch.Generator) -> None:
        self.ks, self.n, self.k = ks, n, k
        self.sets = [prepare_weights(*kh.random_weights(n, k, gen)) for _ in range(copies)]
        self.x = torch.randn(1, k, dtype=torch.bfloat16, device=dev, generator=gen)
        self.y = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
        self.gs = torch.tensor([0.0123], dtype=torch.float32, device=dev)

    def run(self, name: str, kw: int) -> None:
        for codes, scales in self.sets:
            self.ks.gemv(name, self.y, self.x, codes, scales, self.gs, 1, self.n, self.k, kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--shapes", default="31b,4b", help="31b, 4b, 1b, head (the 31B's NVFP4 output head)")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    kh.DRY = args.dry_run
    dev = torch.device("cpu" if kh.DRY else "cuda")
    table = {"31b": kh.SHAPES_31B, "4b": kh.SHAPES_4B, "1b": kh.SHAPES_1B, "head": [(262144, 5376)]}
    shapes = [s for key in args.shapes.split(",") for s in table[key]]
    if kh.DRY:
        shapes = [(48, 320), (96, 320)]
    args.out.mkdir(parents=True, exist_ok=True)
    out = (args.out / "read_ceiling_h200.jsonl").open("w")
    log = functools.partial(print, flush=True)

    ks = kh.FakeKernels() if kh.DRY else kh.Kernels()
    tri = None if kh.DRY else triton_kernels()
    sms, copy_tbs = 132, 4.0
    if not kh.DRY:
        p = torch.cuda.get_device_properties(0)
        sms = p.multi_processor_count
        copy_tbs, read_tbs = kh.bandwidth()
        log(f"device: {p.name}, {sms} SMs, L2 {p.L2_cache_size >> 20} MB; "
            f"copy {copy_tbs:.2f} TB/s (read + write), read-only {read_tbs:.2f} TB/s (2 GiB)")
    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    best: dict[tuple[str, float], float] = {}  # (reader family, MB) -> us at its best kw
    rows = []
    for n, k in shapes:
        nbytes = n * k * kh.FP4_BYTES_PER_WEIGHT
        copies = max(3, min(32, int(np.ceil(3 * kh.L2_BYTES / nbytes))))
        rd = Readers(n, k, copies, dev, gen)
        ours = OurKernels(ks, n, k, copies, dev, gen)
        fns = {"sum": rd.sum, "copy": rd.copy, "cublas": rd.cublas}
        if tri is not None:
            fns["tsum"] = functools.partial(rd.triton, tri[0], False, sms)
            fns["tsump"] = functools.partial(rd.triton, tri[1], True, sms)
        for name in ("ld0", "gv0"):
            if name in ks.funcs:
                for kw in (4, 8):
                    fns[f"{name} kw{kw}"] = functools.partial(ours.run, name, kw)
        line = []
        for name, fn in fns.items():
            us = float(np.median(kh.time_graph(fn))) * 1e3 / copies
            pct = 100.0 * nbytes / 1e6 / us / copy_tbs
            key = (name.split()[0], nbytes / 1e6)
            best[key] = min(best.get(key, us), us)
            row = dict(shape=kh.NAMES.get((n, k), "head" if n == 262144 else "cell"), n=n, k=k, mb=nbytes / 1e6,
                       reader=name, us=us, pct_copy=pct)
            rows.append(row)
            out.write(json.dumps(row) + "\n")
            line.append(f"{name} {us:.2f} us {pct:.0f}%")
        log(f"{kh.NAMES.get((n, k), (n, k))} {nbytes / 1e6:.1f} MB: " + ", ".join(line))
        del rd, ours
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    readers = list(dict.fromkeys(r["reader"] for r in rows))
    log("\n| shape | MB | " + " | ".join(readers) + " |")
    log("|---|---|" + "---|" * len(readers))
    for n, k in shapes:
        cells = {r["reader"]: r for r in rows if (r["n"], r["k"]) == (n, k)}
        first = next(iter(cells.values()))
        log(f"| {first['shape']} | {first['mb']:.1f} | "
            + " | ".join(f"{cells[r]['us']:.2f} ({cells[r]['pct_copy']:.0f}%)" for r in readers) + " |")
    log("\nfit t = MB / stream + fixed over the shapes (best kw per shape):")
    for family in dict.fromkeys(f for f, _ in best):
        f = kh.stream_fit([(mb, us) for (fam, mb), us in best.items() if fam == family])
        if f:
            log(f"  {family}: stream {f[0]:.2f} TB/s, fixed {f[1]:.2f} us per launch")


if __name__ == "__main__":
    main()
