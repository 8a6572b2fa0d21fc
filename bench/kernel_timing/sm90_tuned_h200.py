"""The GEMV kernels ``SM90_TUNED`` picks, through MAX on the H200, against float64.

For every shape in ``attnquant.graph.nvfp4.sm90.SM90_TUNED`` this builds the
projection exactly as a served model does (the sm90 backend's
``kernel_parameters``, the prepared layout, ``gemv_only`` so the GEMV op runs
at every M), all shapes in one MAX graph with a symbolic row count, and checks
M = 1, 2, 3, 8 (the kernel for up to 8 rows) and 9, 12, 16 (the one above)
against float64 on fresh inputs, output and weights drawn anew per shape.
Also a shape with K % 64 != 0 (GUARDED_SHAPES, the original kernels'
guarded loop), and the gated gate|up layers (``ATTNQUANT_GATED_GEMV``: rows interleaved,
``gelu_tanh(gate) * up`` in the kernel's epilogue) of the Gemma 3 270M, 1B,
4B and 27B/31B geometries, each with the kernels its shape runs, against
``gelu_tanh(x Wg^T) * (x Wu^T)`` in float64; one of them without
``gemv_only``, so that M = 33 takes the large-M route (dequantize, MAX's
matmul, the gate in MAX's ops).

On the H200, after staging MAX (../shared/device/README.md):
    python3 bench/kernel_timing/sm90_tuned_h200.py
Here, without a GPU, ``--compile-only`` compiles the graph for a virtual
sm_90a. ``--also 640x1024:wide=2:8`` checks a kernel the table does not
name (a candidate whose op variant is not in ``SM90_GPU_CHECKED`` yet) at its
shape and range, in place of the table's there. Prints one line per (shape, M) and exits non-zero if any relative
error exceeds 1e-2 (the kernels' own is ~1.7e-3).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from nvfp4_gemv_h200 import random_weights, reference_weight  # noqa: E402  (this folder)

MS = (1, 2, 3, 8, 9, 12, 16, 33)
TOLERANCE = 1e-2
GATED_SHAPES = ((4096, 640), (13824, 1152), (20480, 2560), (43008, 5376))
"""gate|up [2F, K] of Gemma 3 270M, 1B, 4B and of the 27B / Gemma 4 31B."""
GUARDED_SHAPES = ((1000, 1040),)
"""Shapes with K % 64 != 0 (and N % 16 != 0): the register kernels' guarded,
clamped loop, which the op picks per call where no Gemma shape goes."""


def gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    return 0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v**3)))


def parse_also(text: str) -> tuple[tuple[int, int], str, tuple[int, int]]:
    """``640x1024:narrow=4:8`` -> ((640, 1024), "narrow", (4, 8))."""
    try:
        shape, rest = text.split(":", 1)
        kernel_range, choice = rest.split("=")
        n, k = (int(v) for v in shape.split("x"))
        variant, kw = (int(v) for v in choice.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NxK:RANGE=VARIANT:KW, e.g. 640x1024:narrow=4:8") from None
    if kernel_range not in ("narrow", "wide"):
        raise argparse.ArgumentTypeError(f"{text!r}: RANGE is narrow (M<=8) or wide (M>8), got {kernel_range!r}")
    return (n, k), kernel_range, (variant, kw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for a virtual sm_90a, no GPU")
    ap.add_argument("--also", nargs="*", default=[], type=parse_also, metavar="NxK:RANGE=V:KW",
                    help="also check variant V with kw KW for RANGE (narrow: M<=8, wide: M>8) of shape [N, K]")
    args = ap.parse_args()

    from max import driver

    from attnquant.max_compat import gpu_check_session

    session, gpu, cpu = gpu_check_session("sm_90a" if args.compile_only else None)
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout
    from max.experimental.tensor import Tensor

    from attnquant.graph import nvfp4 as K
    from attnquant.graph.nvfp4.sm90 import SM90_TUNED, SM90Tuned
    from attnquant.graph.ops import custom_extensions_path
    from attnquant.max_compat import exit_after_virtual_compile
    from kernels.sm90_layout import interleave_gate_up, padded_shape, prepare_weights

    backend = K.backend_named("mojo-sm90")
    for (n, k), kernel_range, choice in args.also:  # this process's table only
        SM90_TUNED[(n, k)] = dataclasses.replace(SM90_TUNED.get((n, k), SM90Tuned()), **{kernel_range: choice})
    configs = []
    for n, k in [*SM90_TUNED, *GUARDED_SHAPES]:
        config = K.NVFP4LayerConfig(n, k, DType.bfloat16, "cuda", "sm_90a", gemv_only=True)
        params, why = backend.kernel_parameters(config)
        print(f"[{n}, {k}]: {dict(params)} ({why})", flush=True)
        configs.append(dataclasses.replace(config, kernel_params=params))
    for i, (n, k) in enumerate(GATED_SHAPES):
        config = K.NVFP4LayerConfig(n, k, DType.bfloat16, "cuda", "sm_90a", gemv_only=i > 0, gated=True)
        ok, why = backend.gated_epilogue(config)
        assert ok, why
        params, why = backend.kernel_parameters(config)
        print(f"gated [{n}, {k}]{'' if config.gemv_only else ' (large-M route above 16 rows)'}: {dict(params)}")
        configs.append(dataclasses.replace(config, kernel_params=params))

    def forward(*inputs):
        gs = inputs[-1]
        return tuple(
            K.apply(backend, inputs[3 * i], (inputs[3 * i + 1], inputs[3 * i + 2], gs), c) for i, c in enumerate(configs)
        )

    types = []
    for c in configs:
        n_pad, k_pad = padded_shape(c.n, c.k)  # the prepared layout's whole 16-row, 64-wide tiles
        types += [TensorLayout(DType.bfloat16, ["m", c.k], gpu), TensorLayout(DType.uint8, [n_pad, k_pad // 2], gpu),
                  TensorLayout(DType.uint8, [n_pad, k_pad // 16], gpu)]  # fmt: skip
    types.append(TensorLayout(DType.float32, [1], gpu))
    t0 = time.time()
    run = compilation.compile(forward, custom_extensions=[custom_extensions_path()], session=session)(*types)
    print(f"graph with {len(configs)} projections compiled for sm_90a in {time.time() - t0:.1f} s", flush=True)
    if args.compile_only:
        exit_after_virtual_compile()

    gen = torch.Generator().manual_seed(0)
    gs = 0.0137
    weights, refs = [], []
    for c in configs:
        packed, scale_bits = random_weights(c.n, c.k, gen)
        if c.gated:
            codes, scales = prepare_weights(interleave_gate_up(packed), interleave_gate_up(scale_bits))
        else:
            codes, scales = prepare_weights(packed, scale_bits)
        weights += [codes, scales]
        refs.append(reference_weight(packed, scale_bits, gs).cuda())

    def buf(t: torch.Tensor) -> Tensor:
        return Tensor.from_dlpack(driver.Buffer.from_dlpack(t.contiguous()).to(gpu))

    worst = 0.0
    for m in MS:
        xs = [torch.randn(m, c.k, generator=gen).to(torch.bfloat16) for c in configs]
        inputs = []
        for i, x in enumerate(xs):
            inputs += [buf(x), buf(weights[2 * i]), buf(weights[2 * i + 1])]
        outs = run(*inputs, buf(torch.tensor([gs], dtype=torch.float32)))
        for c, x, ref_w, y in zip(configs, xs, refs, outs):
            got = torch.from_dlpack(y.driver_tensor.to(cpu) if hasattr(y, "driver_tensor") else y.to(cpu)).double()
            ref = (x.double().cuda() @ ref_w.T).cpu()
            if c.gated:
                gate, up = ref.split(c.n // 2, dim=1)
                ref = gelu_tanh(gate) * up
            err = float((got - ref).norm() / ref.norm()) if torch.isfinite(got).all() else float("inf")
            worst = max(worst, err)
            print(f"{'gated ' if c.gated else ''}[{c.n}, {c.k}] M={m}: rel err {err:.2e}", flush=True)
    ok = worst <= TOLERANCE
    print(f"RESULT {'OK' if ok else 'FAIL'}: worst rel err {worst:.2e} over {len(configs)} shapes x M {MS}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
