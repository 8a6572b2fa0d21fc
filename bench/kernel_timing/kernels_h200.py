"""Every sm90 NVFP4 GEMV variant, checked and timed on the H200 in one call.

No MAX on the device: the kernels are compiled here (Mojo -> PTX -> sm_90a
cubin) and launched with CuPy; torch (already on the device image) draws the
inputs, computes the float64 references and times everything with CUDA-graph
replay.

HERE (no GPU), from the repository root, before the device call:

    MOJO=.venv/bin/mojo bash bench/kernel_timing/build_ptx.sh     # ~25 s; writes bench/ptx/ (git-ignored)

ON THE H200 (one call, ~4-5 minutes of device time incl. machine start), with
the device tool:

    run(kind="nvidia-h200", timeout_s=480, carry=["bench/ptx"],
        command="python3 bench/kernel_timing/kernels_h200.py --out $OUT --budget 330")

then read the table at the end of the output; $OUT/kernels_h200.jsonl has
every row, $OUT/kernels_h200.json the summary, $OUT/ncu_*.txt the optional
profile (--ncu, on by default when `ncu` is on PATH and budget is left).

What it does, in order (a budget guard skips what no longer fits and says so):
1. device facts, ptxas report (bench/ptx/ptxas.txt), copy bandwidth (SM copy
   kernel, read + write, and a read-only sum), launch floor (an empty kernel,
   64 launches in a CUDA graph);
2. correctness: every variant (old 0-2 and new 3-8, each cluster split) on
   CHECK_SHAPES (N % 16 != 0, K % 64 != 0, and aligned) and M = 1, 3, 9, 17
   against float64, output poisoned with NaN before every launch, fresh
   inputs each; the aligned-only kernels (ALIGNED_ONLY) also bit for bit
   against their guarded twins;
3. timing: Gemma 4 31B shapes at M = 1, 4, 16, Gemma 3 1B and 4B projection
   shapes at M = 1, 2, 4, 8, 16; every (variant, kw, splitk) candidate is
   checked against float64 on fresh inputs and then timed (weight sets rotated
   past the 60 MB L2, median of 20 graph replays); torch bf16 (cuBLAS) the same
   way; the best and the old default are timed a second time (noise);
   With --ranges instead: what one SM90_TUNED entry can name (op variants, no
   cluster split, no PDL) at every M of each range (1, 2, 4, 8 and 9, 12, 16),
   on every Gemma 3 size's projection shapes and the 31B's; the last lines then
   give the entries the timings justify (range_choice.py);
4. table: variant, shape, M, us, TB/s (0.5625 B/weight), % of copy, x vs torch
   bf16, x vs MAX bf16 (MAX's figure from docs/dev/kernels.md, 2026-11-29, where
   there is one; MAX is not on this machine), rel err; best per shape.

Variant names (bench/kernel_timing/nvfp4_ptx_harness.mojo; op `variant` in brackets):
  gv0 [0] register kernel, 4 groups/batch   a5 [1] cp.async ring MT2 TN2   g4 [2] register MT2
  b3sK [3] bulk ring S4 G2   b4sK [4] bulk ring S3 G4   b5sK [5] bulk MT2 TN2   b6sK [6] bulk MT2 TN4
  r7sK [7] register kernel, hoisted global scale   b8sK [8] bulk ring S4 G4;   sK = cluster split-K
  (launched as a cluster of SK blocks); gvg, gwg, r7gK: the guarded twins of gv0, g4, r7sK (K % 64 != 0).
  p3s1, p3s2, p4s4: b3/b4 with programmatic dependent launch (weights fetched before
  griddepcontrol.wait); timed in a chain of identical GEMVs, so an upper bound for a model.
  gd0 (zd0 gated): gv0 with programmatic dependent launch (waits before any load), checked
  here; pdl_chain_h200.py times it along a decoder layer, beside ge0 (ze0), which issues
  its first weight loads before the wait (66 registers, not the op's), and gl0 (zl0), which
  lets the next kernel start only after its stores (not the op's either); gdx (zdx) is gd0
  (zd0) with its activations on the read-only path again, the form ptxas may move above
  the wait (a control, made by build_ptx.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

warnings.filterwarnings("ignore", category=DeprecationWarning)  # cupy ExternalStream

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kernels.sm90_layout import TILE_K, prepare_weights  # noqa: E402

import range_choice  # noqa: E402  (this folder: bench/kernel_timing/)

PTX_DIR = ROOT / "bench" / "ptx"
DRY = False  # --dry-run: CPU, a reference "kernel", wall-clock timing (checks this script, not the kernels)
L2_BYTES = 60 * 2**20
FP4_BYTES_PER_WEIGHT = 0.5625
E2M1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)

SHAPES_31B = [(16384, 5376), (5376, 8192), (43008, 5376), (5376, 21504)]
SHAPES_1B = [(1536, 1152), (1152, 1024), (13824, 1152), (1152, 6912)]
SHAPES_4B = [(4096, 2560), (2560, 2048), (20480, 2560), (2560, 10240)]
# --ranges also times the other Gemma 3 sizes (27B's gate|up and down are the 31B's shapes).
SHAPES_270M = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]
SHAPES_12B = [(8192, 3840), (3840, 4096), (30720, 3840), (3840, 15360)]
SHAPES_27B = [(8192, 5376), (5376, 4096)]
# Correctness: unaligned N and K (K % 64 != 0 meets the zero-code padding), a K whose
# k-groups split into warp slices that are not whole batches, and a 1B shape.
CHECK_SHAPES = ((24, 80), (1000, 1040), (40, 320), (1536, 1152))
CHECK_ROWS = (1, 3, 9, 17)  # across the 8- and 16-row chunks
CHECKED = ", ".join(f"[{n},{k}]" for n, k in CHECK_SHAPES) + " x M " + ",".join(map(str, CHECK_ROWS))
ROLES = ("q|k|v", "o", "gate|up", "down")  # each SHAPES_* list is in this order
NAMES = {
    shape: f"{size} {role}"
    for size, shapes in (("31B", SHAPES_31B), ("1B", SHAPES_1B), ("4B", SHAPES_4B), ("270M", SHAPES_270M),
                         ("12B", SHAPES_12B), ("27B", SHAPES_27B))
    for shape, role in zip(shapes, ROLES)
}  # fmt: skip
# MAX 26.7 bf16 matmul on this H200 (docs/dev/kernels.md, 2026-11-29): (N, K, M) -> us.
MAX_BF16_US = {
    (16384, 5376, 1): 41.5, (16384, 5376, 4): 60.0, (16384, 5376, 16): 60.2,
    (5376, 8192, 1): 23.4, (5376, 8192, 4): 41.4, (5376, 8192, 16): 41.3,
    (43008, 5376, 1): 104.6, (43008, 5376, 4): 131.6, (43008, 5376, 16): 131.8,
    (5376, 21504, 1): 60.0, (5376, 21504, 4): 75.5, (5376, 21504, 16): 75.4,
    (1536, 1152, 1): 2.9, (1536, 1152, 4): 13.6, (1536, 1152, 16): 13.1,
    (1152, 1024, 1): 2.2, (1152, 1024, 4): 12.8, (1152, 1024, 16): 12.9,
    (13824, 1152, 1): 11.5, (13824, 1152, 4): 21.5, (13824, 1152, 16): 21.6,
    (1152, 6912, 1): 6.3, (1152, 6912, 4): 18.7, (1152, 6912, 16): 18.8,
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """How to launch one harness kernel: kind reg (nvfp4_gemv_sm90_kernel),
    async (cp.async ring), bulk (bulk-copy ring), reg2 (hoisted register
    kernel), nul (launch floor)."""

    kind: str
    mt: int = 1
    tn: int = 1
    stages: int = 0
    g: int = 0
    sk: int = 1
    op_variant: int = -1
    pdl: bool = False  # launched with programmatic stream serialization (cuLaunchKernelEx)
    kw_max: int = 16  # register kernels: the most warps along K it runs with (its reduction buffer's size)
    diag: bool = False  # a diagnostic (not a GEMV): timed, never checked, never "best"

    @property
    def max_m(self) -> int:
        return 8 * self.mt


VARIANTS = {
    "gv0": Variant("reg", 1, 1, op_variant=0),
    "a5": Variant("async", 2, 2, 4, op_variant=1),
    "g4": Variant("reg", 2, 1, op_variant=2),
    "b3s1": Variant("bulk", 1, 1, 4, 2, 1, 3), "b3s2": Variant("bulk", 1, 1, 4, 2, 2, 3),
    "b3s4": Variant("bulk", 1, 1, 4, 2, 4, 3),
    "b4s1": Variant("bulk", 1, 1, 3, 4, 1, 4), "b4s2": Variant("bulk", 1, 1, 3, 4, 2, 4),
    "b4s4": Variant("bulk", 1, 1, 3, 4, 4, 4),
    "b8s1": Variant("bulk", 1, 1, 4, 4, 1, 8), "b8s2": Variant("bulk", 1, 1, 4, 4, 2, 8),
    # PDL: b3/b4 kernels that fill their weight ring before griddepcontrol.wait, launched with
    # programmatic stream serialization: in this chain of GEMVs each call's weight loads overlap
    # the previous call (an upper bound for a model, whose neighbours are MAX kernels).
    "p3s1": Variant("bulk", 1, 1, 4, 2, 1, 3, pdl=True), "p3s2": Variant("bulk", 1, 1, 4, 2, 2, 3, pdl=True),
    "p4s4": Variant("bulk", 1, 1, 3, 4, 4, 4, pdl=True),
    # gv0 with programmatic dependent launch (the op's variant 0 with pdl): waits before any load;
    # pdl_chain_h200.py times it in a decoder layer's chain.
    "gd0": Variant("reg", 1, 1, op_variant=0, pdl=True),
    "ge0": Variant("reg", 1, 1, pdl=True),  # gd0 with its first weight loads before the wait (not the op's)
    "gl0": Variant("reg", 1, 1, pdl=True),  # gd0 letting the next kernel start after its stores (not the op's)
    # gd0 with its activations loaded through the read-only path, as before pdl.mojo's rule (a
    # control; build_ptx.sh makes it from gd0's PTX).
    "gdx": Variant("reg", 1, 1, pdl=True),
    "b5s1": Variant("bulk", 2, 2, 4, 2, 1, 5), "b5s2": Variant("bulk", 2, 2, 4, 2, 2, 5),
    "b6s1": Variant("bulk", 2, 4, 3, 2, 1, 6), "b6s2": Variant("bulk", 2, 4, 3, 2, 2, 6),
    "r7s1": Variant("reg2", 1, 1, sk=1, op_variant=7), "r7s2": Variant("reg2", 1, 1, sk=2, op_variant=7),
    "r7s4": Variant("reg2", 1, 1, sk=4, op_variant=7),
    # r7sK with every batch guarded and clamped: variant 7 for K % 64 != 0 (ALIGNED_ONLY).
    "r7g1": Variant("reg2", 1, 1, sk=1), "r7g2": Variant("reg2", 1, 1, sk=2), "r7g4": Variant("reg2", 1, 1, sk=4),
    # gv0 / g4 with the next PF batches bulk-prefetched into L2 (fa: the whole slice up front).
    "f1": Variant("reg", 1, 1), "f2": Variant("reg", 1, 1), "f4": Variant("reg", 1, 1),
    "fa": Variant("reg", 1, 1), "h1": Variant("reg", 2, 1),
    "g3": Variant("reg", 1, 1),  # gv0 with 8 k-groups per batch (80 registers)
    # gv0 with a batch's 16 mma over 2 (g1) or 4 (gc4) accumulators: shorter dependency chains.
    "g1": Variant("reg", 1, 1), "gc4": Variant("reg", 1, 1),
    # gv0 and g4 with every batch guarded and clamped: the op's kernels for K % 64 != 0 (ALIGNED_ONLY).
    "gvg": Variant("reg", 1, 1), "gwg": Variant("reg", 2, 1),
    "gvr": Variant("reg", 1, 1),  # gv0 assembled with <= 56 registers (build_ptx.sh): 36 warps an SM
    # gv0 (gxg: gvg) with blocks of up to 32 warps along K: a short grid's slices become one batch.
    "gx": Variant("reg", 1, 1, kw_max=32), "gxg": Variant("reg", 1, 1, kw_max=32),
    # gv0 software-pipelined in registers (PIPE): stages of 2 (gp) or 3 (gq) k-groups.
    "gp": Variant("reg", 1, 1), "gq": Variant("reg", 1, 1),
    "gh0": Variant("reg", 1, 1),  # gv0 with the global scale loaded before the loop
    # gv0's weight loads alone, 4, 8 or 16 k-groups per batch: the access pattern's own ceiling.
    "ld0": Variant("reg", 1, 1, diag=True, kw_max=32), "ld8": Variant("reg", 1, 1, diag=True, kw_max=32),
    "ld16": Variant("reg", 1, 1, diag=True, kw_max=32),
}  # fmt: skip


ASSEMBLED_FROM = {"gvr": "gv0", "gdx": "gd0", "zdx": "zd0"}
"""Harness kernels that build_ptx.sh assembles from another kernel's PTX, not
compiled from Mojo: with other ptxas options (gvr: -maxrregcount 56) or with
the previous kernel's output loaded through the read-only path again
(readonly_loads.sed: gdx, zdx, and the norm rdx from rd0)."""

ALIGNED_ONLY = {
    "gv0": "gvg", "gd0": "gvg", "ge0": "gvg", "gl0": "gvg", "gdx": "gvg", "gvr": "gvg", "gp": "gvg", "gq": "gvg", "g4": "gwg", "gx": "gxg", "zv0": None, "zg4": None,
    "r7s1": "r7g1", "r7s2": "r7g2", "r7s4": "r7g4",
}  # fmt: skip
"""Harness kernels built with ALIGNED_K (no activation clamp: K % 64 == 0 only)
-> the guarded kernel _launch_gemv (_launch_reg) runs for other K, which Kernels.gemv then
launches in their place, as the op does (None: none built; the gated shapes
are all aligned)."""

GATED = {"zv0": "gv0", "zd0": "gd0", "ze0": "ge0", "zl0": "gl0", "zdx": "gdx", "za5": "a5", "zg4": "g4", "zb3s1": "b3s1", "zb5s1": "b5s1"}
"""Harness kernels with the gated epilogue (gelu_tanh(gate) * up of a gate|up
interleaved by 8 rows; n = N/2) -> the kernel they gate (same launch);
bench/kernel_timing/gated_h200.py times them. Not part of the sweep."""


def spec(name: str) -> Variant:
    """How to launch harness kernel ``name`` (a gated one as the kernel it gates)."""
    return VARIANTS[GATED.get(name, name)]


def tunable_variants() -> dict[str, int]:
    """The harness kernels one SM90_TUNED entry can name, with their op variant
    (no cluster split, no programmatic dependent launch, no diagnostics)."""
    return {name: v.op_variant for name, v in VARIANTS.items() if v.op_variant >= 0 and v.sk == 1 and not v.pdl and not v.diag}


def old_default(m: int) -> str:
    """What the op's variant -1 launches at M rows (kw picked)."""
    return range_choice.ORIGINAL["narrow" if m <= 8 else "wide"]


def pick_kw(blocks: int, k_groups: int, target_warps: int) -> int:
    """_pick_kw in nvfp4_matmul.mojo (the old kernels' default)."""
    kw = 4
    while kw < 16 and blocks * kw < target_warps:
        kw *= 2
    return max(min(kw, k_groups), 1)


def reg_kw(n_tiles: int, k_groups: int, kw: int = 0, kw_max: int = 16) -> int:
    """The kw a register kernel (gv0 and its kin) runs with: kw, else the op's pick."""
    return min(kw or pick_kw(n_tiles, k_groups, 2560), kw_max)


def bulk_smem_bytes(v: Variant, kw: int) -> int:
    red_off = (kw * v.stages * v.tn * v.g * 576 + kw * v.stages * 8 + 15) // 16 * 16
    return red_off + kw * v.tn * v.mt * 512


def candidates(m: int, n: int, k: int, quick: bool, only: frozenset[str] = frozenset(),
               extra_kw: tuple[int, ...] = ()) -> list[tuple[str, int]]:
    """(variant, kw) pairs for one cell; kw 0 = the kernel's own default.
    only: keep these variants (and the old default, the baseline); extra_kw:
    more kw values for the register kernels (e.g. 6, 10, 12)."""
    out: list[tuple[str, int]] = []
    reg_kws = (4, 8) if quick else (4, 8, 16)
    if m <= 8:
        out += [("gv0", 0)] + [("gv0", kw) for kw in dict.fromkeys(reg_kws + extra_kw)]
        for name in ("f1", "f2", "f4", "fa", "g3", "gh0", "g1", "gc4", "gvg", "gvr", "gp", "gq", "ld0", "ld8", "ld16"):
            out += [(name, 0)] + [(name, kw) for kw in dict.fromkeys(reg_kws + extra_kw)]
        out += [("gx", kw) for kw in (16, 24, 32)]
        for name in ("r7s1", "r7s2", "r7s4"):
            out += [(name, kw) for kw in dict.fromkeys(((4, 8) if quick else (4, 8, 16)) + extra_kw)]
        for name in ("b3s1", "b3s2", "b3s4", "b4s1", "b4s2", "b4s4", "b8s1", "b8s2", "p3s1", "p3s2", "p4s4"):
            out += [(name, kw) for kw in ((2, 4) if quick else (2, 4, 8))]
    else:
        out += [("a5", 0), ("g4", 0), ("gwg", 0)] + ([] if quick else [("a5", kw) for kw in (4, 8)])
        out += [(name, kw) for name in ("g4", "gwg") for kw in reg_kws]
        for name in ("b5s1", "b5s2", "b6s1", "b6s2"):
            out += [(name, kw) for kw in ((2, 4) if quick else (2, 4, 8))]
        out += [("b3s1", 4), ("b3s2", 4)] + [("h1", 0)] + [("h1", kw) for kw in reg_kws]
    return feasible([(name, kw) for name, kw in out if not only or name in only or name == old_default(m)], k)


RANGE_REG_KW = (4, 6, 8, 10, 12, 16)


def range_candidates(m: int, k: int) -> list[tuple[str, int]]:
    """--ranges: the (variant, kw) pairs one SM90_TUNED entry can name for M's
    range (op variants, no cluster split, no PDL), the original kernel first."""
    if m <= 8:
        out = [("gv0", 0)] + [("gv0", kw) for kw in RANGE_REG_KW]
        out += [(b, kw) for b in ("b3s1", "b4s1") for kw in (2, 4, 8)]
    else:
        out = [("a5", 0), ("a5", 4), ("a5", 8), ("g4", 0)] + [("g4", kw) for kw in RANGE_REG_KW]
        out += [(b, kw) for b in ("b5s1", "b6s1", "b3s1") for kw in (2, 4, 8)]
        out += [("gv0", 0)] + [("gv0", kw) for kw in (4, 8, 16)]
    return feasible(out, k)


def feasible(pairs: list[tuple[str, int]], k: int) -> list[tuple[str, int]]:
    """The pairs a shape with K columns can launch: every warp needs a k-group,
    and a bulk ring must fit in shared memory."""
    kg = -(-k // 64)
    keep = []
    for name, kw in pairs:
        v = VARIANTS[name]
        if kw and kw * v.sk > kg:
            continue
        if v.kind == "bulk" and bulk_smem_bytes(v, kw or 4) > 160 * 1024:
            continue
        keep.append((name, kw))
    return keep


def random_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (all 16 values) and varied valid E4M3 scales (incl. subnormal
    and zero blocks), on gen's device."""
    dev = gen.device
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen, device=dev)
    scale_bits = torch.randint(0x28, 0x60, (n, k // 16), dtype=torch.uint8, generator=gen, device=dev)
    flat = scale_bits.view(-1)
    flat[::97] = torch.randint(1, 8, flat[::97].shape, dtype=torch.uint8, generator=gen, device=dev)
    flat[::389] = 0
    return packed, scale_bits


def dequant_ref(packed: torch.Tensor, scale_bits: torch.Tensor, gs: float) -> torch.Tensor:
    """float64 [N, K], straight from the ModelOpt format (independent of the prepared layout)."""
    n, kh = packed.shape
    dev = packed.device
    codes = torch.stack((packed & 15, packed >> 4), -1).view(n, 2 * kh).long()
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().to(dev)
    return E2M1.to(dev)[codes] * table[scale_bits.long()].repeat_interleave(16, 1) * gs


class _LaunchAttr(__import__("ctypes").Structure):
    import ctypes as _c

    _fields_ = [("id", _c.c_uint32), ("pad", _c.c_uint32), ("value", _c.c_uint8 * 64)]


class _LaunchConfig(__import__("ctypes").Structure):
    import ctypes as _c

    _fields_ = [
        ("gridDimX", _c.c_uint), ("gridDimY", _c.c_uint), ("gridDimZ", _c.c_uint),
        ("blockDimX", _c.c_uint), ("blockDimY", _c.c_uint), ("blockDimZ", _c.c_uint),
        ("sharedMemBytes", _c.c_uint), ("hStream", _c.c_void_p),
        ("attrs", _c.POINTER(_LaunchAttr)), ("numAttrs", _c.c_uint),
    ]  # fmt: skip


# cuda.h's CUlaunchAttributeID, CUDA 12-13.
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
LaunchAttrs = list[tuple[int, tuple[int, ...]]]  # (attribute id, its uint32 values)


def launch_attrs(pdl: bool, cluster_z: int) -> LaunchAttrs:
    """The cuLaunchKernelEx attributes a harness kernel needs, as (id, uint32
    values): programmatic stream serialization for PDL, and the cluster shape
    (1, 1, SK) for a split-K kernel. Mojo does not write the kernel's
    `nvvm.cluster_dim` into the harness's PTX (its entry is a wrapper), so a
    plain launch would run each block as a cluster of one, and its DSMEM
    reads of the other ranks would fault; the op passes cluster_dim itself."""
    attrs = []
    if pdl:
        attrs.append((_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
    if cluster_z > 1:
        attrs.append((_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (1, 1, cluster_z)))
    return attrs


def attr_array(attrs: LaunchAttrs):
    """launch_attrs() as the driver's CUlaunchAttribute array (each value's
    uint32 fields at the start of its 64-byte union)."""
    import ctypes as c

    arr = (_LaunchAttr * len(attrs))()
    for slot, (attr_id, values) in zip(arr, attrs):
        slot.id = attr_id
        c.memmove(slot.value, (c.c_uint32 * len(values))(*values), 4 * len(values))
    return arr


def launch_ex(func_ptr: int, stream: int, grid, block, smem: int, args: list, attrs: LaunchAttrs) -> None:
    """cuLaunchKernelEx with launch attributes (driver API via ctypes: CuPy's
    launch takes none). args: ints for pointers (u64), numpy int64 or float32; attrs:
    launch_attrs()."""
    import ctypes as c

    lib = launch_ex.__dict__.setdefault("lib", c.CDLL("libcuda.so.1"))
    arr = attr_array(attrs)
    cfg = _LaunchConfig(*grid, *block, smem, c.c_void_p(stream), arr, len(attrs))
    vals = [c.c_uint64(a) if isinstance(a, int) else c.c_float(float(a)) if isinstance(a, np.float32)
            else c.c_int64(int(a)) for a in args]
    params = (c.c_void_p * len(vals))(*[c.cast(c.pointer(v), c.c_void_p) for v in vals])
    err = lib.cuLaunchKernelEx(c.byref(cfg), c.c_void_p(func_ptr), params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {err}")


class Kernels:
    def __init__(self) -> None:
        import cupy as cp

        self.cp = cp
        self.funcs: dict[str, object] = {}
        self.errors: dict[str, str] = {}
        for f in sorted(PTX_DIR.glob("*.ptx")):
            name = f.stem
            cubin = f.with_suffix(".cubin")
            entry = re.search(r"\.entry\s+([A-Za-z0-9_$]+)", f.read_text()).group(1)
            try:
                mod = cp.RawModule(path=str(cubin if cubin.exists() else f))
                fn = mod.get_function(entry)
                if name in {**VARIANTS, **GATED} and spec(name).kind in ("bulk", "async"):
                    fn.max_dynamic_shared_size_bytes = 160 * 1024
                self.funcs[name] = fn
            except Exception as e:  # one variant that does not load is reported, not fatal
                self.errors[name] = f"{type(e).__name__}: {e}"
                print(f"cannot load {name}: {self.errors[name]}", flush=True)

    def raw(self, name: str, grid, block, args, smem: int = 0) -> None:
        attrs = launch_attrs(spec(name).pdl, spec(name).sk) if name in {**VARIANTS, **GATED} else []
        if attrs:
            conv = [a.data_ptr() if isinstance(a, torch.Tensor) else np.int64(a) for a in args]
            fn = self.funcs[name]  # a cupy RawKernel; its .kernel is the cupy.cuda.Function (.ptr = CUfunction)
            func_ptr = int(getattr(getattr(fn, "kernel", fn), "ptr"))
            launch_ex(func_ptr, torch.cuda.current_stream().cuda_stream, grid, block, smem, conv, attrs)
            return
        cp = self.cp
        conv = [cp.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else np.int64(a) for a in args]
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            self.funcs[name](grid, block, tuple(conv), shared_mem=smem)

    def gemv(self, name: str, y, x, codes, scales, gs, m: int, n: int, k: int, kw: int = 0) -> int:
        """Launch like the op would (nvfp4_gemv_sm90_dispatch); returns the kw used.
        n: the output's columns (N/2 for a gated kernel)."""
        if k % TILE_K and name in ALIGNED_ONLY:
            if ALIGNED_ONLY[name] is None:
                raise ValueError(f"{name} needs K % 64 == 0, got K={k}")
            name = ALIGNED_ONLY[name]
        v = spec(name)
        nt, kg = codes.shape[0] // 16, codes.shape[1] // 32
        args = (y, x, codes, scales, gs, m, n, k, nt, kg)
        gy = -(-m // (8 * v.mt))
        if v.kind == "reg":
            kw = reg_kw(nt, kg, kw, v.kw_max)
            self.raw(name, (nt, gy, 1), (kw * 32, 1, 1), (*args, kw))
        elif v.kind == "async":
            blocks = -(-nt // v.tn)
            kw = min(kw or pick_kw(blocks, kg, 1280), 16)
            smem = kw * v.stages * v.tn * 512 + kw * v.tn * v.mt * 512
            self.raw(name, (blocks, gy, 1), (kw * 32, 1, 1), (*args, kw), smem)
        elif v.kind == "bulk":
            kw = max(min(kw or 4, 16, kg // v.sk), 1)
            self.raw(name, (-(-nt // v.tn), gy, v.sk), (kw * 32, 1, 1), (*args, kw), bulk_smem_bytes(v, kw))
        elif v.kind == "reg2":
            kw = max(min(kw or 4, 16, kg // v.sk), 1)
            self.raw(name, (nt, gy, v.sk), (kw * 32, 1, 1), (*args, kw))
        else:
            raise ValueError(name)
        return kw


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


class FakeKernels:
    """--dry-run stand-in: computes what the kernel must (from the prepared
    layout, via sm90_reference_dequant) and writes it, rows past M untouched."""

    def __init__(self) -> None:
        from kernels.sm90_layout import sm90_reference_dequant

        self.deq = sm90_reference_dequant
        self.funcs = {name: None for name in [*VARIANTS, "nul"]}
        self.errors: dict[str, str] = {}

    def raw(self, name, grid, block, args, smem: int = 0) -> None:
        pass

    def gemv(self, name, y, x, codes, scales, gs, m, n, k, kw=0) -> int:
        # Test hooks for the hang handling (dry run only): a kernel that never returns,
        # in the correctness child (DRY_HANG) or only in the timing loop (DRY_HANG_TIMING).
        if name == os.environ.get("DRY_HANG") or (name == os.environ.get("DRY_HANG_TIMING") and m == 4
                                                   and "--check-child" not in sys.argv):
            time.sleep(1e6)
        w = self.deq(codes, scales, n, k) * float(gs[0])
        y.copy_((x.double() @ w.T).to(y.dtype))
        return kw or 4


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph that calls fn() once (fn run once first, outside it, as warm-up):
    its kernels launched back to back, as in a captured decode step."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(fn, replays: int = 20) -> list[float]:
    """ms of each of `replays` replays of a CUDA graph that calls fn() once."""
    if DRY:
        t0 = time.perf_counter()
        fn()
        return [(time.perf_counter() - t0) * 1e3] * 3
    g = capture_graph(fn)
    g.replay()
    sync()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def bandwidth() -> tuple[float, float]:
    """(copy TB/s read + write via an SM kernel, read-only TB/s via a sum)."""
    if DRY:
        return 4.0, 4.0
    src = torch.randn(2**29, dtype=torch.float32, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    out = torch.empty(1, dtype=torch.float32, device="cuda")
    copy_ms = float(np.median(time_graph(lambda: torch.mul(src, 1.0, out=dst), 20)))
    read_ms = float(np.median(time_graph(lambda: torch.sum(src.view(1, -1), dim=1, out=out), 20)))
    nbytes = src.numel() * 4
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / copy_ms / 1e9, nbytes / read_ms / 1e9


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not bool(torch.isfinite(y).all()):
        return float("inf")  # NaN poison left (an unwritten element) or a NaN result
    return float((y.double() - ref).norm() / ref.norm())


class Budget:
    def __init__(self, seconds: float) -> None:
        self.t0 = time.time()
        self.seconds = seconds
        self.skipped: list[str] = []

    def left(self) -> float:
        return self.seconds - (time.time() - self.t0)

    def ok(self, what: str, need: float = 0.0) -> bool:
        if self.left() > need:
            return True
        self.skipped.append(what)
        return False


def check_correctness(ks: Kernels, gen: torch.Generator, log, exclude=(), progress=None) -> list[dict]:
    """Every variant on unaligned shapes and row counts that cross the 8/16-row chunks.
    `progress` (a file) gets a line before each launch, so that a parent can
    tell which variant hung or crashed the process."""
    rows = []
    dev = gen.device
    for n, k in CHECK_SHAPES:
        packed, sb = random_weights(n, k, gen)
        codes, scales = prepare_weights(packed, sb)
        gs_val = float(torch.empty(1).uniform_(0.002, 0.05))
        gs = torch.tensor([gs_val], dtype=torch.float32, device=dev)
        w = dequant_ref(packed, sb, gs_val)
        for m in CHECK_ROWS:
            for name in VARIANTS:
                if name not in ks.funcs or name in exclude or VARIANTS[name].diag:
                    continue
                # kw 1 and 3 (reg): warp slices of whole batches plus a partial one
                for kw in (0, 2) if VARIANTS[name].kind in ("bulk", "reg2") else (0, 1, 3):
                    if progress is not None:
                        progress.write(f"START {name}\n")
                        progress.flush()
                    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
                    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
                    try:
                        used = ks.gemv(name, y, x, codes, scales, gs, m, n, k, kw)
                        sync()
                        err = rel_err(y, x.double() @ w.T)
                        twin = ALIGNED_ONLY.get(name)
                        if twin and k % TILE_K == 0 and twin in ks.funcs:  # same arithmetic, same order
                            y2 = torch.full_like(y, float("nan"))
                            ks.gemv(twin, y2, x, codes, scales, gs, m, n, k, used)
                            sync()
                            if not torch.equal(y, y2):
                                log(f"correctness {name} [{n},{k}] M={m} kw={used}: differs from {twin}")
                                err = float("inf")
                    except Exception as e:
                        log(f"correctness {name} [{n},{k}] M={m}: {type(e).__name__}: {e}")
                        if progress is not None:  # a CUDA error may be sticky: let the parent exclude it
                            progress.flush()
                            sys.stdout.flush()
                            os._exit(4)
                        used, err = kw, float("inf")
                    row = dict(n=n, k=k, m=m, variant=name, kw=used, err=err, ok=err < 1e-2)
                    rows.append(row)
                    if progress is not None:
                        progress.write("ROW " + json.dumps(row) + "\n")
                        progress.flush()
    bad = [r for r in rows if not r["ok"]]
    by_variant: dict[str, float] = {}
    for r in rows:
        by_variant[r["variant"]] = max(by_variant.get(r["variant"], 0.0), r["err"])
    log(f"correctness (max rel err over {CHECKED}): "
        + ", ".join(f"{v} {e:.1e}" for v, e in by_variant.items()))
    if bad:
        log(f"FAILED correctness: {len(bad)} cases, e.g. {bad[:4]}")
    return rows


def correctness_in_child(out: Path, log, budget: "Budget") -> list[dict]:
    """Runs check_correctness in a child process (its own CUDA context): a
    variant that hangs (an mbarrier wait that never completes) or faults
    (a sticky CUDA error) is named from the progress file, excluded, and the
    check re-run without it; the parent never launches it."""
    exclude: list[str] = []
    rows: list[dict] = []
    for attempt in range(len(VARIANTS) + 1):  # each failed attempt excludes one variant
        prog = out / f"correctness_{attempt}.txt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--check-child", str(prog)]
        if DRY:
            cmd.append("--dry-run")
        if exclude:
            cmd += ["--exclude", ",".join(exclude)]
        # A hang is a stall of the progress file: 60 s for the first line
        # (imports, module loads), then 20 s between lines (each is one launch).
        child_log = (out / f"correctness_{attempt}.log").open("w")
        proc = subprocess.Popen(cmd, stdout=child_log, stderr=subprocess.STDOUT, text=True)
        last_size, last_change, rc = -1, time.time(), None
        while rc is None:
            time.sleep(0.5)
            rc = proc.poll()
            size = prog.stat().st_size if prog.exists() else 0
            if size != last_size:
                last_size, last_change = size, time.time()
            stall = (60.0 if size == 0 else 20.0) * (4 if DRY else 1)
            if rc is None and (time.time() - last_change > stall or budget.left() < 120):
                proc.kill()
                proc.wait()
                rc = f"stalled {time.time() - last_change:.0f} s"
        child_log.close()
        tail = (out / f"correctness_{attempt}.log").read_text()[-1500:]
        lines = prog.read_text().splitlines() if prog.exists() else []
        rows = [json.loads(line[4:]) for line in lines if line.startswith("ROW ")]
        if rc == 0:
            break
        started = [line[6:] for line in lines if line.startswith("START ")]
        culprit = started[-1] if started else None
        log(f"correctness child {attempt}: {rc}; last variant started: {culprit}; {tail.strip()[-600:]}")
        if culprit is None or culprit in exclude:
            log("correctness check incomplete: the variants after the last one started were not checked")
            break
        exclude.append(culprit)
    for name in exclude:
        rows.append(dict(n=0, k=0, m=0, variant=name, kw=0, err=float("inf"), ok=False, hung_or_crashed=True))
    by_variant: dict[str, float] = {}
    for r in rows:
        by_variant[r["variant"]] = max(by_variant.get(r["variant"], 0.0), r["err"])
    log(f"correctness (max rel err over {CHECKED}): "
        + ", ".join(f"{v} {e:.1e}" for v, e in by_variant.items())
        + (f"; hung or crashed: {exclude}" if exclude else ""))
    return rows


class Watchdog:
    """Ends the run (after printing what it has) if the timing loop stops
    making progress: a kernel that never finishes would otherwise take the
    whole call's output with it."""

    def __init__(self, seconds: float, on_stall) -> None:
        import threading

        self.seconds = seconds
        self.last = time.time()
        self.what = "start"
        self.on_stall = on_stall
        threading.Thread(target=self._run, daemon=True).start()

    def tick(self, what: str) -> None:
        self.last = time.time()
        self.what = what

    def _run(self) -> None:
        while True:
            time.sleep(2)
            if time.time() - self.last > self.seconds:
                try:
                    self.on_stall(self.what)
                finally:
                    os._exit(3)


def parse_cells(text: str) -> list[tuple[tuple[int, int], int]]:
    """``N:K:M,...`` as ((N, K), M) cells; K must be whole 16-weight blocks."""
    cells = []
    for item in filter(None, text.split(",")):
        try:
            n, k, m = (int(v) for v in item.split(":"))
        except ValueError:
            raise SystemExit(f"--cells: {item!r} is not N:K:M (three integers, e.g. 262144:5376:1)") from None
        if min(n, k, m) < 1 or k % 16:
            raise SystemExit(f"--cells: {item!r} needs N, K, M >= 1 and K a multiple of 16")
        cells.append(((n, k), m))
    return cells


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run (guard)")
    ap.add_argument("--quick", action="store_true", help="fewer kw candidates")
    ap.add_argument("--only", default="", help="comma-separated variants to time (the old default always is)")
    ap.add_argument("--extra-kw", default="", help="comma-separated extra kw values for the register kernels")
    ap.add_argument("--ranges", action="store_true",
                    help="time what one SM90_TUNED entry can name at every M of its range (M 1-8, 9-16) on "
                         "every Gemma 3 size's shapes and the 31B's, and print the entries the timings justify")
    ap.add_argument("--cells", default="",
                    help="N:K:M[,N:K:M...]: time only these cells (e.g. the Gemma 4 31B NVFP4 output head, "
                         "262144:5376:1)")
    ap.add_argument("--ncu", choices=("auto", "off"), default="auto")
    ap.add_argument("--dry-run", action="store_true", help="CPU, reference kernel: checks the script's flow only")
    ap.add_argument("--check-child", help=argparse.SUPPRESS)  # internal: run the correctness block, write progress here
    ap.add_argument("--exclude", default="", help=argparse.SUPPRESS)
    ap.add_argument("--profile", help="VARIANT:N:K:M:KW - launch twice (for ncu -s 1 -c 1) and exit")
    args = ap.parse_args()
    global DRY
    budget = Budget(args.budget)
    if args.profile:
        return profile_one(args.profile)
    if args.check_child:
        DRY = args.dry_run
        ks = FakeKernels() if DRY else Kernels()
        gen = torch.Generator(device="cpu" if DRY else "cuda").manual_seed(int(time.time()))
        with open(args.check_child, "w") as prog:
            check_correctness(ks, gen, print, exclude=set(filter(None, args.exclude.split(","))), progress=prog)
        return None
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = (args.out / "kernels_h200.jsonl").open("w")

    def log(msg: str) -> None:
        print(msg, flush=True)

    def record(row: dict) -> None:
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()

    global SHAPES_31B, SHAPES_1B, SHAPES_4B, SHAPES_270M, SHAPES_12B, SHAPES_27B
    if args.dry_run:
        DRY = True
        SHAPES_31B, SHAPES_1B, SHAPES_4B = [(48, 320)], [(40, 192)], [(32, 128)]
        SHAPES_270M, SHAPES_12B, SHAPES_27B = [], [], []
        for s_ in SHAPES_31B + SHAPES_1B + SHAPES_4B:
            NAMES[s_] = f"dry {s_}"
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cpu" if DRY else "cuda")
    props = torch.cuda.get_device_properties(0) if not DRY else type("P", (), dict(name="dry-run CPU"))()
    if not DRY:
        log(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB, "
            f"torch {torch.__version__}, cupy {__import__('cupy').__version__}")
    if (PTX_DIR / "ptxas.txt").exists():
        log((PTX_DIR / "ptxas.txt").read_text().strip())
    ks = FakeKernels() if DRY else Kernels()
    log(f"loaded {len(ks.funcs)} kernels ({'cubin' if any(PTX_DIR.glob('*.cubin')) else 'PTX JIT'}); "
        f"failed: {sorted(ks.errors) or 'none'}")
    copy_tbs, read_tbs = bandwidth()
    log(f"copy bandwidth {copy_tbs:.2f} TB/s (read+write), read-only {read_tbs:.2f} TB/s")

    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    floor_us = float("nan")
    if "nul" in ks.funcs:
        yb = torch.empty(1024, dtype=torch.bfloat16, device=dev)
        xb = torch.empty(16, dtype=torch.bfloat16, device=dev)
        gs0 = torch.ones(1, dtype=torch.float32, device=dev)
        t = time_graph(lambda: [ks.raw("nul", (72, 1, 1), (512, 1, 1), (yb, xb, yb, yb, gs0, 1, 72, 0, 0, 0, 0))
                                for _ in range(64)])
        floor_us = float(np.median(t)) * 1e3 / 64
        log(f"launch floor (empty 72x512 kernel, 64 per graph): {floor_us:.2f} us per launch")

    corr = correctness_in_child(args.out, log, budget)
    broken = {r["variant"] for r in corr if not r["ok"]}
    summary: list[dict] = []
    rows: list[dict] = []

    # A GPU step takes seconds at most; the CPU dry run builds the largest
    # cells' weights (the 31B head: 1.4e9 weights) in minutes, not a hang.
    stall_s = 900.0 if args.dry_run else 45.0

    def on_stall(what: str) -> None:
        log(f"WATCHDOG: no progress for {stall_s:.0f} s at {what}; a kernel hung. Partial results:")
        print_table(summary, rows, copy_tbs, read_tbs, floor_us, budget, broken | {what.split()[-1]}, log)

    watchdog = Watchdog(stall_s, on_stall)

    cells = []  # (priority order) target 1 first, then the small shapes, then the rest
    cells += [(s, 1) for s in SHAPES_31B] + [(s, 1) for s in SHAPES_1B + SHAPES_4B]
    cells += [(s, 4) for s in SHAPES_31B] + [(s, 16) for s in SHAPES_31B]
    cells += [(s, m) for m in (4, 16, 2, 8) for s in SHAPES_1B + SHAPES_4B]
    if args.ranges:
        every_m = range_choice.RANGES["narrow"] + range_choice.RANGES["wide"]
        gemma3 = SHAPES_270M + SHAPES_1B + SHAPES_4B + SHAPES_12B + SHAPES_27B
        cells = [(s, m) for s in gemma3 + SHAPES_31B for m in every_m]
    if args.cells:
        cells = parse_cells(args.cells)
        for s_, _ in cells:
            NAMES.setdefault(s_, "cell")
    by_shape: dict[tuple[int, int], list[int]] = {}
    for s, m in cells:
        by_shape.setdefault(s, []).append(m)

    order = list(dict.fromkeys(s for s, _ in cells))
    # Shapes run in priority order; all of a shape's M values run together (one weight setup).
    for n, k in order:
        ms = by_shape[(n, k)]
        watchdog.tick(f"[{n},{k}] weights")
        if not budget.ok(f"[{n},{k}] all M", 25):
            continue
        fp4_bytes = n * k * FP4_BYTES_PER_WEIGHT
        r4 = max(2, min(64, math.ceil(3 * L2_BYTES / fp4_bytes)))
        r16 = max(2, min(64, math.ceil(3 * L2_BYTES / (2 * n * k))))
        sets = []
        for _ in range(r4):
            packed, sb = random_weights(n, k, gen)
            codes, scales = prepare_weights(packed, sb)
            sets.append((codes, scales))
        gs_val = 0.0123
        gs = torch.tensor([gs_val], dtype=torch.float32, device=dev)
        w_ref = dequant_ref(packed, sb, gs_val)  # the last set's weights (float64)
        chk_codes, chk_scales = sets[-1]
        w16 = [torch.randn(n, k, dtype=torch.bfloat16, device=dev, generator=gen) * 0.02 for _ in range(r16)]
        for m in ms:
            watchdog.tick(f"[{n},{k}] M={m} setup")
            if not budget.ok(f"[{n},{k}] M={m}", 8):
                continue
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
            ys16 = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(r16)]
            bf16_us = float(np.median(time_graph(lambda: [torch.matmul(x, w.T, out=y) for w, y in zip(w16, ys16)]))) * 1e3 / r16
            cell = []
            only = frozenset(filter(None, args.only.split(",")))
            extra_kw = tuple(int(v) for v in filter(None, args.extra_kw.split(",")))
            pairs = range_candidates(m, k) if args.ranges else candidates(m, n, k, args.quick, only, extra_kw)
            for name, kw in pairs:
                if name not in ks.funcs or name in broken:
                    continue
                watchdog.tick(f"[{n},{k}] M={m} kw={kw} {name}")
                xf = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)  # fresh input per check
                y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
                try:
                    used = ks.gemv(name, y, xf, chk_codes, chk_scales, gs, m, n, k, kw)
                    sync()
                    err = rel_err(y, xf.double() @ w_ref.T)
                    ys = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(r4)]
                    t = time_graph(lambda: [ks.gemv(name, yy, x, s[0], s[1], gs, m, n, k, used) for s, yy in zip(sets, ys)])
                except Exception as e:
                    log(f"[{n},{k}] M={m} {name} kw={kw}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                us = float(np.median(t)) * 1e3 / r4
                tbs = fp4_bytes / (us * 1e-6) / 1e12
                row = dict(n=n, k=k, m=m, variant=name, op_variant=VARIANTS[name].op_variant, kw=used, kw_arg=kw,
                           splitk=VARIANTS[name].sk, us=us, us_spread=(max(t) - min(t)) * 1e3 / r4, tbs=tbs,
                           pct_copy=100 * tbs / copy_tbs, bf16_torch_us=bf16_us, x_torch=bf16_us / us,
                           max_bf16_us=MAX_BF16_US.get((n, k, m)), err=err, r4=r4, r16=r16)
                row["x_max"] = row["max_bf16_us"] / us if row["max_bf16_us"] else None
                rows.append(row)
                record(row)
                if VARIANTS[name].diag:
                    log(f"DIAG {NAMES[(n, k)]} [{n},{k}] M={m}: {name} kw={used} {us:.2f} us "
                        f"{tbs:.2f} TB/s {row['pct_copy']:.0f}% copy")
                elif err < 1e-2:
                    cell.append(row)
            if not cell:
                log(f"[{n},{k}] M={m}: no valid variant")
                continue
            best = min(cell, key=lambda r: r["us"])
            old = [r for r in cell if r["variant"] == old_default(m) and r["kw_arg"] == 0]  # today's default
            # Second timing of the best and the old default (noise estimate).
            for r in [best] + old[:1]:
                ys = [torch.empty(m, n, dtype=torch.bfloat16, device=dev) for _ in range(r4)]
                t2 = time_graph(lambda: [ks.gemv(r["variant"], yy, x, s[0], s[1], gs, m, n, k, r["kw"]) for s, yy in zip(sets, ys)])
                r["us_again"] = float(np.median(t2)) * 1e3 / r4
            old_row = old[0] if old else None
            summary.append(dict(best, name=NAMES[(n, k)], old_variant=old_default(m),
                                old_us=old_row["us"] if old_row else None))
            log(f"BEST {NAMES[(n, k)]} [{n},{k}] M={m}: {best['variant']} kw={best['kw']} "
                f"{best['us']:.2f} us (again {best['us_again']:.2f}) {best['tbs']:.2f} TB/s "
                f"{best['pct_copy']:.0f}% copy, {best['x_torch']:.2f}x torch bf16"
                + (f", {best['x_max']:.2f}x MAX bf16" if best["x_max"] else "")
                + (f"; old {old_default(m)} {old_row['us']:.2f} us" if old_row else ""))
        del sets, w16, w_ref
        if not DRY:
            torch.cuda.empty_cache()

    watchdog.seconds = 1e9  # ncu runs in children with their own timeouts
    ncu_out = []
    if args.ncu == "auto" and not DRY and shutil.which("ncu") and summary and budget.left() > 60:
        for s in [r for r in summary if (r["n"], r["k"], r["m"]) in ((16384, 5376, 1), (1152, 1024, 1))]:
            spec = f"{s['variant']}:{s['n']}:{s['k']}:{s['m']}:{s['kw']}"
            if budget.left() < 45:
                budget.skipped.append(f"ncu {spec}")
                continue
            ncu_out.append(run_ncu(spec, args.out, log))

    choices = range_choice.range_choices([rows], tunable_variants())
    result = dict(device=props.name, copy_tbs=copy_tbs, read_tbs=read_tbs, launch_floor_us=floor_us,
                  correctness=corr, summary=summary, skipped=budget.skipped, ncu=ncu_out, ranges=choices,
                  seconds=time.time() - budget.t0)
    (args.out / "kernels_h200.json").write_text(json.dumps(result, indent=1))
    print_table(summary, rows, copy_tbs, read_tbs, floor_us, budget, broken, log)
    if args.ranges:  # every op variant: SM90_GPU_CHECKED needs MAX, which a sweep runs without
        log("\n== one kernel per range of M")
        for line in range_choice.report(choices, NAMES, 1):
            log(line)


def load_only_fit(rows: list[dict], m: int = 1) -> tuple[float, float, int] | None:
    """Least-squares fit of the load-only diagnostics' best time per shape at
    row count m: t = bytes / stream + fixed. Returns (stream TB/s, fixed us,
    shapes), or None with fewer than two shapes."""
    best: dict[tuple[int, int], float] = {}
    for r in rows:
        if VARIANTS[r["variant"]].diag and r["m"] == m:
            key = (r["n"], r["k"])
            best[key] = min(best.get(key, math.inf), r["us"])
    fit = stream_fit([(n * k * FP4_BYTES_PER_WEIGHT / 1e6, us) for (n, k), us in best.items()])
    return None if fit is None else (*fit, len(best))


def stream_fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(stream TB/s, fixed us) of t_us = MB / stream + fixed, least squares
    over (MB, us) points; None under two points."""
    if len(points) < 2:
        return None
    mb, us = np.array(points).T
    (us_per_mb, fixed_us), *_ = np.linalg.lstsq(np.vstack([mb, np.ones_like(mb)]).T, us, rcond=None)
    return 1.0 / us_per_mb, float(fixed_us)


def print_table(summary, rows, copy_tbs, read_tbs, floor_us, budget, broken, log) -> None:
    log(f"\n== {len(rows)} timed configurations; copy {copy_tbs:.2f} TB/s, read-only {read_tbs:.2f} TB/s, "
        f"launch floor {floor_us:.2f} us; variants failing correctness: {sorted(broken) or 'none'}")
    log("| shape | [N, K] | M | best (kw) | us (again) | TB/s | % copy | x torch bf16 | x MAX bf16* | old us | rel err |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in summary:
        xm = f"{r['x_max']:.2f}" if r.get("x_max") else "-"
        old = f"{r['old_variant']} {r['old_us']:.2f}" if r.get("old_us") else "-"
        log(f"| {r['name']} | {r['n']}x{r['k']} | {r['m']} | {r['variant']} ({r['kw']}) | {r['us']:.2f} "
            f"({r.get('us_again', float('nan')):.2f}) | {r['tbs']:.2f} | {r['pct_copy']:.0f} | {r['x_torch']:.2f} | {xm} "
            f"| {old} | {r['err']:.1e} |")
    log("* MAX bf16 from docs/dev/kernels.md (same H200 kind, 2026-11-29); MAX is not run here.")
    # The kernel targets (docs/dev/kernels.md) against this run.
    t1 = [r for r in summary if (r["n"], r["k"]) in SHAPES_31B]
    miss1 = [f"{r['name']} M={r['m']} {r['pct_copy']:.0f}%" for r in t1
             if r["pct_copy"] < (85 if r["m"] == 1 else 75)]
    small = [r for r in summary if (r["n"], r["k"]) in SHAPES_1B + SHAPES_4B]
    miss2 = [f"{r['name']} M={r['m']} {r['x_torch']:.2f}x" for r in small if r["x_torch"] < 1.5]
    log(f"target 1 (M=1 >= 85%, M=4/16 >= 75% of copy): {'met' if t1 and not miss1 else 'missed: ' + ', '.join(miss1)}")
    log(f"target 2 (>= 1.5x bf16, here torch/cuBLAS): {'met' if small and not miss2 else 'missed: ' + ', '.join(miss2)}")
    with_max = [r for r in small if r.get("x_max")]
    miss2m = [f"{r['name']} M={r['m']} {r['x_max']:.2f}x" for r in with_max if r["x_max"] < 1.5]
    log(f"target 2 against MAX bf16's 2026-11-29 figures (1B, M=1/4/16 only): "
        f"{'met' if with_max and not miss2m else 'missed: ' + ', '.join(miss2m)}")
    fit = load_only_fit(rows)
    if fit:
        stream, fixed, shapes = fit
        reachable = [NAMES[s] for s in SHAPES_31B
                     if s[0] * s[1] * FP4_BYTES_PER_WEIGHT / 1e6 / (0.85 * copy_tbs) > fixed + s[0] * s[1] * FP4_BYTES_PER_WEIGHT / 1e6 / stream]
        log(f"load-only fit at M=1 over {shapes} shapes: t = bytes / {stream:.2f} TB/s + {fixed:.2f} us per launch; "
            f"31B shapes where one launch could reach 85% of copy: {reachable or 'none'}")
    if budget.skipped:
        log(f"skipped for the budget: {budget.skipped}")


def run_ncu(spec: str, out: Path, log) -> dict:
    v = spec.split(":")[0]
    sections = ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "SchedulerStats", "MemoryWorkloadAnalysis"]
    cmd = ["ncu", "--clock-control", "none", "-k", f"regex:harness_{v}_", "-s", "1", "-c", "1"]
    for s in sections:
        cmd += ["--section", s]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--profile", spec]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        text = r.stdout + r.stderr
    except (OSError, subprocess.SubprocessError) as e:
        text = f"ncu failed: {e}"
    path = out / f"ncu_{spec.replace(':', '_')}.txt"
    path.write_text(text)
    keys = ("Duration", "DRAM Throughput", "Registers Per", "Achieved Occupancy", "Theoretical Occupancy",
            "Issued Warp Per", "Warp Cycles Per Issued", "No Eligible", "L2 Hit", "Block Limit")
    lines = [re.sub(r"\s+", " ", line).strip() for line in text.splitlines() if any(x in line for x in keys)]
    log(f"== ncu {spec}\n" + "\n".join(lines[:20]))
    return dict(spec=spec, lines=lines)


def profile_one(spec: str) -> None:
    name, n, k, m, kw = spec.split(":")
    n, k, m, kw = int(n), int(k), int(m), int(kw)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    packed, sb = random_weights(n, k, gen)
    codes, scales = prepare_weights(packed, sb)
    x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    gs = torch.tensor([0.01], dtype=torch.float32, device=dev)
    ks = Kernels()
    for _ in range(2):
        ks.gemv(name, y, x, codes, scales, gs, m, n, k, kw)
    sync()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
