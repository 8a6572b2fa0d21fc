"""The gated GEMV epilogue on the H200: correct against float64, and what it saves.

A gate|up projection [2F, K] whose rows are interleaved by 8
(``kernels.sm90_layout.interleave_gate_up``) lets the GEMV store
``gelu_tanh(gate) * up`` [M, F] itself (``ATTNQUANT_GATED_GEMV``). For each
Gemma 3 gate|up shape (270M, 1B, 4B, and the 27B's, which is Gemma 4 31B's) and
M = 1, 3, 8 (the kernels for up to 8 rows) and 9, 16 (those above), every
gated harness kernel (``kernels_h200.GATED``) is checked against
``gelu_tanh(x Wg^T) * (x Wu^T)`` in float64 (NaN-poisoned output), then timed
(CUDA-graph replay, weights rotated past L2, median) against the same kernel
ungated followed by torch's ``gelu(tanh) * up`` on its [M, 2F] output: the
elementwise launch and round trip the epilogue removes (in a served model that
launch is MAX's kernel, not torch's), and against the ungated kernel alone: what
the epilogue itself costs.

On the H200, no MAX needed: ``bash bench/kernel_timing/build_ptx.sh`` here,
then one device call with ``bench/ptx`` carried:
    python3 bench/kernel_timing/gated_h200.py
``--dry-run`` runs the flow on CPU with a reference in place of the kernels.
Prints a table; exits non-zero if any relative error exceeds 1e-2.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_h200 as H  # noqa: E402  (this folder; puts the repository root on sys.path)
from kernels.sm90_layout import interleave_gate_up, prepare_weights, sm90_reference_dequant  # noqa: E402

SHAPES = {"270M": (4096, 640), "1B": (13824, 1152), "4B": (20480, 2560), "27B/31B": (43008, 5376)}
CHECK_MS = (1, 3, 8, 9, 16)
TIME_MS = (1, 8, 16)
TOLERANCE = 1e-2


def gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))


def kernels_for(m: int) -> list[tuple[str, int]]:
    """(gated harness kernel, kw) that serve M rows: kw 0 = the kernel's pick."""
    if m <= 8:
        return [("zv0", 0), ("zb3s1", 2), ("zb3s1", 4)]
    return [("za5", 0), ("zg4", 0), ("zb5s1", 2), ("zb5s1", 4)]


class ReferenceKernels:
    """--dry-run: computes what a kernel must from the prepared layout."""

    def __init__(self) -> None:
        self.funcs = {name: None for name in [*H.GATED, *H.GATED.values()]}

    def gemv(self, name, y, x, codes, scales, gs, m, n, k, kw=0) -> int:
        w = sm90_reference_dequant(codes, scales, codes.shape[0], k) * float(gs[0])
        out = x.double() @ w.T
        if name in H.GATED:
            blocks = out.view(m, -1, 2, 8)
            out = (gelu_tanh(blocks[:, :, 0]) * blocks[:, :, 1]).reshape(m, -1)
        y.copy_(out[:, : y.shape[1]].to(y.dtype))
        return kw or 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, reference kernels: checks the flow only")
    ap.add_argument("--sets", type=int, default=4, help="weight sets rotated per timing (past the 60 MB L2)")
    args = ap.parse_args()
    H.DRY = args.dry_run
    shapes = {"dry": (64, 128)} if H.DRY else SHAPES
    dev = torch.device("cpu" if H.DRY else "cuda")
    ks = ReferenceKernels() if H.DRY else H.Kernels()
    missing = [name for name in H.GATED if name not in ks.funcs]
    if missing:
        print(f"gated kernels not built: {missing} (bash bench/kernel_timing/build_ptx.sh)")
        return 2
    gen = torch.Generator(device=dev).manual_seed(int(time.time()))
    worst, rows = 0.0, []
    for label, (n, k) in shapes.items():
        f = n // 2
        sets = []
        for _ in range(1 if H.DRY else args.sets):
            packed, scale_bits = H.random_weights(n, k, gen)
            gated = prepare_weights(interleave_gate_up(packed), interleave_gate_up(scale_bits))
            plain = prepare_weights(packed, scale_bits)
            sets.append((packed, scale_bits, gated, plain))
        gs_val = 0.0137
        gs = torch.tensor([gs_val], dtype=torch.float32, device=dev)
        ref_w = H.dequant_ref(sets[0][0], sets[0][1], gs_val)
        for m in CHECK_MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
            gate, up = (x.double() @ ref_w.T).split(f, dim=1)
            ref = gelu_tanh(gate) * up
            for name, kw in kernels_for(m):
                y = torch.full((m, f), float("nan"), dtype=torch.bfloat16, device=dev)
                ks.gemv(name, y, x, *sets[0][2], gs, m, f, k, kw)
                H.sync()
                err = H.rel_err(y, ref)
                worst = max(worst, err)
                print(f"check {label} [{n}, {k}] M={m} {name} kw {kw}: rel err {err:.2e}", flush=True)
        for m in TIME_MS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev, generator=gen)
            y_gated = torch.empty(m, f, dtype=torch.bfloat16, device=dev)
            y_plain = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            for name, kw in kernels_for(m):
                plain_name = H.GATED[name]

                def gated_step() -> None:
                    for _, _, (codes, scales), _ in sets:
                        ks.gemv(name, y_gated, x, codes, scales, gs, m, f, k, kw)

                def kernel_only() -> None:
                    for _, _, _, (codes, scales) in sets:
                        ks.gemv(plain_name, y_plain, x, codes, scales, gs, m, n, k, kw)

                def plain_step() -> None:
                    for _, _, _, (codes, scales) in sets:
                        ks.gemv(plain_name, y_plain, x, codes, scales, gs, m, n, k, kw)
                        g, u = y_plain.split(f, dim=1)
                        torch.mul(torch.nn.functional.gelu(g, approximate="tanh"), u, out=y_gated)

                t_gated, t_alone, t_plain = (float(np.median(H.time_graph(step))) * 1e3 / len(sets)
                                             for step in (gated_step, kernel_only, plain_step))  # fmt: skip
                rows.append((label, n, k, m, name, kw, t_gated, t_alone, t_plain))
    print("\n| shape | [N, K] | M | gated kernel (kw) | gated µs | ungated kernel µs | ungated + torch gelu·mul µs "
          "| saved µs |")
    print("|---|---|---|---|---|---|---|---|")
    for label, n, k, m, name, kw, t_gated, t_alone, t_plain in rows:
        print(f"| {label} gate\\|up | {n}×{k} | {m} | {name} ({kw or 'picked'}) | {t_gated:.2f} | {t_alone:.2f} "
              f"| {t_plain:.2f} | {t_plain - t_gated:.2f} |")
    ok = worst <= TOLERANCE
    print(f"\nRESULT {'OK' if ok else 'FAIL'}: worst rel err {worst:.2e} (gated kernels against float64)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
