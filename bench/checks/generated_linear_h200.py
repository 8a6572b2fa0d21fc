"""attnquant.generated_linear on the H200: check, time, table.

A generated projection is W = s[:, None] * W0 + u @ v.T (W0 [N, K] bf16;
s [N], u [N, r], v [K, r] float32). One call does everything:

1. correctness through MAX on the GPU, through the public wrappers
   (``attnquant.graph.generated.generated_linear`` / ``generated_mlp``) in one
   graph with symbolic shapes: the Gemma 3 1B projection shapes for M in
   {1, 4, 16, 17, 33} and r in {0, 4, 32, 64}, and the fused MLP at Gemma 3
   1B's MLP shape, each against a torch float32 reference on fresh random
   inputs. Every case first runs the graph on NaN activations (all outputs
   must come back NaN, then are freed so the real run's outputs most likely
   reuse that NaN-filled memory: an element the kernel skips stays NaN);
2. timing, one MAX graph per formulation holding R independent ops on R
   weight sets (rotated past the 60 MB L2), symbolic M/N/K/r, captured as a
   device graph and replayed (``time_model`` of bench/kernel_timing/nvfp4_gemv_h200.py):
     (a) generated_linear, the Mojo op;
     (b) the GEMM formulation with stock MAX ops, all bf16:
         [y0 | t] = x @ [W0 ; v.T].T (one matmul), split,
         y = s * y0 + t @ u.T;
     (c) dense bf16 x @ W.T (W precomputed outside the graph: the baseline).
   Every timed output of set 0 is also checked against float32.

Run on the H200 (MAX installed there):
    python3 bench/checks/generated_linear_h200.py [--out DIR]
Here, without a GPU:
    python3 bench/checks/generated_linear_h200.py --device cpu --dry-run
        (float32, tiny shapes, R=2: builds, runs and checks every graph on CPU)
    python3 bench/checks/generated_linear_h200.py --compile-only [--dry-run]
        (virtual sm_90a device: compiles every graph for the H200, runs nothing)
Mismatches print FAIL lines and the run goes on; the last line says
ALL CHECKS PASSED or how many failed (exit status 1 then).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "kernel_timing"))

import nvfp4_gemv_h200 as nv  # noqa: E402  (Max, time_model, log, shapes)

log = nv.log

SHAPES = list(nv.SHAPES_GEMMA3_1B)  # q|k|v, o, gate|up, down of Gemma 3 1B
MS = [1, 4, 16]
RANKS = [4, 32]
CHECK_MS = [1, 4, 16, 17, 33]
CHECK_RANKS = [0, 4, 32, 64]
MLP_SHAPE = (1152, 6912)  # hidden, intermediate
MLP_CASES = [(1, (4, 32, 64)), (4, (32, 32, 32)), (17, (0, 4, 32))]
R_SETS = 32  # weight sets per timing graph: >= 75 MB of W0 for the smallest shape

DRY_SHAPES = [(48, 40), (40, 56)]
DRY_MLP = (40, 56)

TOL_GEN = 8e-3  # bf16 output rounding (~2^-9 relative) over float32 accumulation
TOL_GEMM = 3e-2  # bf16 intermediates (y0, t, s, u, v)
TOL_F32 = 1e-5  # --device cpu: float32 end to end


class Failures:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def fail(self, msg: str) -> None:
        self.lines.append(msg)
        log(f"FAIL {msg}")

    def check(self, what: str, err: float, tol: float) -> bool:
        if not err < tol:  # also catches NaN
            self.fail(f"{what}: rel err {err:.3e} >= {tol:.0e}")
            return False
        return True


class Dev(nv.Max):
    """nvfp4_gemv_h200.Max (session, buffers, sync) that can also be the CPU."""

    def __init__(self, device: str, compile_only: bool) -> None:
        from max.dtype import DType
        from max.graph import DeviceRef

        if device == "gpu":
            super().__init__(compile_only)
            self.dev, self.ref, self.dtype = self.gpu, DeviceRef.GPU(0), DType.bfloat16
        else:
            from max import driver
            from max.engine import InferenceSession

            self.driver = driver
            self.cpu = driver.CPU()
            self.gpu = self.cpu
            self.session = InferenceSession(devices=[self.cpu])
            self.compile_only = compile_only
            self.dev, self.ref, self.dtype = self.cpu, DeviceRef.CPU(), DType.float32
        self.torch_dtype = torch.bfloat16 if self.dtype == DType.bfloat16 else torch.float32

    def buf(self, t: torch.Tensor):
        return self.driver.Buffer.from_dlpack(t.contiguous()).to(self.dev)

    def host(self, b) -> torch.Tensor:
        b = b.driver_tensor if hasattr(b, "driver_tensor") else b
        return torch.from_dlpack(b.to(self.cpu)).clone()

    def sync(self) -> None:
        self.dev.synchronize()


# ---------------------------------------------------------------------------
# Random thetas and float32 references
# ---------------------------------------------------------------------------


def random_theta(n: int, k: int, r: int, gen: torch.Generator, dtype: torch.dtype) -> list[torch.Tensor]:
    """W0 ~ N(0, 1/K) in the model dtype; s ~ U(0.5, 1.5); u, v with u v^T
    about a tenth of s W0."""
    w0 = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(dtype)
    s = torch.rand(n, generator=gen) + 0.5
    u = torch.randn(n, r, generator=gen) * (0.3 / math.sqrt(max(r, 1)))
    v = torch.randn(k, r, generator=gen) / math.sqrt(k)
    return [w0, s, u, v]


def ref_linear(x: torch.Tensor, theta: list[torch.Tensor]) -> torch.Tensor:
    """float32: s * (x @ W0.T) + (x @ v) @ u.T."""
    w0, s, u, v = theta
    xf = x.float()
    return s * (xf @ w0.float().T) + (xf @ v) @ u.T


def ref_mlp(x: torch.Tensor, gate: list, up: list, down: list) -> torch.Tensor:
    h = torch.nn.functional.gelu(ref_linear(x, gate), approximate="tanh") * ref_linear(x, up)
    return ref_linear(h, down)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return nv.rel_err(out, ref.double())


# ---------------------------------------------------------------------------
# 1. Correctness of the public wrappers
# ---------------------------------------------------------------------------


def build_check_graph(dv: Dev):
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout

    from max.dtype import DType

    from attnquant.graph import generated as G
    from attnquant.graph import nvfp4 as K

    f32, dt, d = DType.float32, dv.dtype, dv.dev

    def theta_types(n: str, k: str, r: str) -> list:
        return [TensorLayout(dt, [n, k], d), TensorLayout(f32, [n], d),
                TensorLayout(f32, [n, r], d), TensorLayout(f32, [k, r], d)]  # fmt: skip

    def forward(x, w0, s, u, v, xm, gw0, gs, gu, gv, uw0, us, uu, uv, dw0, ds, du, dv_):
        y = G.generated_linear(x, w0, s, u, v)
        ym = G.generated_mlp(xm, (gw0, gs, gu, gv), (uw0, us, uu, uv), (dw0, ds, du, dv_))
        return y, ym

    types = [
        TensorLayout(dt, ["m", "k"], d), *theta_types("n", "k", "r"),
        TensorLayout(dt, ["mm", "h"], d), *theta_types("i", "h", "rg"), *theta_types("i", "h", "ru"),
        *theta_types("h", "i", "rd"),
    ]  # fmt: skip
    t0 = time.time()
    run = compilation.compile(forward, custom_extensions=[K.custom_extensions_path()], session=dv.session)(*types)
    log(f"check graph (generated_linear + generated_mlp, symbolic shapes) compiled in {time.time() - t0:.1f} s")
    return run


def check_public_entry(dv: Dev, gen: torch.Generator, fails: Failures, shapes, mlp_shape, ms, ranks) -> list[dict]:
    from max.experimental.tensor import Tensor

    try:
        run = build_check_graph(dv)
    except Exception as e:
        fails.fail(f"check graph did not build/compile: {type(e).__name__}: {e}")
        traceback.print_exc()
        return []
    if dv.compile_only:
        return []
    tol = TOL_F32 if dv.torch_dtype == torch.float32 else TOL_GEN
    def on_device(tensors: list[torch.Tensor]) -> list:
        return [Tensor.from_dlpack(dv.buf(t)) for t in tensors]

    # The other op's inputs while one op is checked: tiny.
    small_x = torch.randn(1, 8, generator=gen).to(dv.torch_dtype)
    small_lin = on_device(random_theta(4, 8, 1, gen, dv.torch_dtype))
    small_mlp = on_device(
        random_theta(4, 8, 1, gen, dv.torch_dtype)
        + random_theta(4, 8, 1, gen, dv.torch_dtype)
        + random_theta(8, 4, 1, gen, dv.torch_dtype)
    )

    def execute(x: torch.Tensor, lin: list, xm: torch.Tensor, mlp: list):
        """lin (4) and mlp (12) are device tensors; x and xm host tensors."""
        return run(*on_device([x]), *lin, *on_device([xm]), *mlp)

    def poisoned_then_real(x, lin, xm, mlp, which: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs on NaN activations (every output must be NaN; then freed, so
        the real run's outputs most likely reuse that memory), then on x."""
        outs = execute(torch.full_like(x, float("nan")), lin, torch.full_like(xm, float("nan")), mlp)
        poisoned = dv.host(outs[which])
        del outs
        outs = execute(x, lin, xm, mlp)
        return poisoned, dv.host(outs[which])

    def check_poison(what: str, poisoned: torch.Tensor) -> None:
        if poisoned.numel() and not torch.isnan(poisoned.float()).all():
            bad = int((~torch.isnan(poisoned.float())).sum())
            fails.fail(f"{what}: {bad} outputs not NaN on NaN activations (not written by the kernel?)")

    rows = []
    for n, k in shapes:
        for r in ranks:
            try:  # fresh weights per (shape, rank), fresh activations per M
                lin_host = random_theta(n, k, r, gen, dv.torch_dtype)
                lin = on_device(lin_host)
            except Exception as e:
                fails.fail(f"generated_linear [{n},{k}] r={r}: inputs: {type(e).__name__}: {str(e)[:300]}")
                continue
            for m in ms:
                what = f"generated_linear [{n},{k}] M={m} r={r}"
                try:
                    x = torch.randn(m, k, generator=gen).to(dv.torch_dtype)
                    poisoned, y = poisoned_then_real(x, lin, small_x, small_mlp, 0)
                    check_poison(what, poisoned)
                    if tuple(y.shape) != (m, n):
                        fails.fail(f"{what}: output shape {tuple(y.shape)}")
                        continue
                    err = rel_err(y, ref_linear(x, lin_host))
                    ok = fails.check(what, err, tol)
                    rows.append(dict(n=n, k=k, m=m, r=r, err=err, ok=ok))
                    log(f"{what}: rel err {err:.2e}{' ok' if ok else ''}")
                except Exception as e:
                    fails.fail(f"{what}: {type(e).__name__}: {str(e)[:300]}")
            del lin
    hid, inter = mlp_shape
    for m, (rg, ru, rd) in MLP_CASES:
        what = f"generated_mlp H={hid} I={inter} M={m} ranks={rg},{ru},{rd}"
        try:
            gate = random_theta(inter, hid, rg, gen, dv.torch_dtype)
            up = random_theta(inter, hid, ru, gen, dv.torch_dtype)
            down = random_theta(hid, inter, rd, gen, dv.torch_dtype)
            x = torch.randn(m, hid, generator=gen).to(dv.torch_dtype)
            poisoned, y = poisoned_then_real(small_x, small_lin, x, on_device(gate + up + down), 1)
            check_poison(what, poisoned)
            err = rel_err(y, ref_mlp(x, gate, up, down))
            ok = fails.check(what, err, tol)
            rows.append(dict(mlp=True, h=hid, i=inter, m=m, ranks=[rg, ru, rd], err=err, ok=ok))
            log(f"{what}: rel err {err:.2e}{' ok' if ok else ''}")
        except Exception as e:
            fails.fail(f"{what}: {type(e).__name__}: {str(e)[:300]}")
    # The kernel's own rank guard (a symbolic rank is only known at run time).
    try:
        execute(small_x, on_device(random_theta(4, 8, 65, gen, dv.torch_dtype)), small_x, small_mlp)
        fails.fail("rank 65 was not refused by the kernel")
    except Exception as e:
        if "MAX_GENERATED_RANK" in str(e):
            log("rank 65 refused by the kernel: ok")
        else:
            fails.fail(f"rank 65: unexpected error {type(e).__name__}: {str(e)[:300]}")
    return rows


# ---------------------------------------------------------------------------
# 2. Timing graphs: R ops on R weight sets, symbolic shapes
# ---------------------------------------------------------------------------

KINDS = ("generated", "gemm", "dense")


def build_graph(dv: Dev, kind: str, r_sets: int):
    from max.dtype import DType
    from max.graph import Graph, TensorType, ops

    from attnquant.graph import nvfp4 as K

    dev, dt, f32 = dv.ref, dv.dtype, DType.float32
    x_t = TensorType(dt, ["m", "k"], dev)
    if kind == "generated":
        per_set = [TensorType(dt, ["n", "k"], dev), TensorType(f32, ["n"], dev),
                   TensorType(f32, ["n", "r"], dev), TensorType(f32, ["k", "r"], dev)]  # fmt: skip
    elif kind == "gemm":
        # [W0 ; v.T] (N + r rows), s and u in the model dtype.
        per_set = [TensorType(dt, ["nr", "k"], dev), TensorType(dt, ["n"], dev), TensorType(dt, ["n", "r"], dev)]
    else:
        per_set = [TensorType(dt, ["n", "k"], dev)]
    inputs = [x_t, *(per_set * r_sets)]
    with Graph(f"{kind}_r{r_sets}", input_types=inputs, custom_extensions=[K.custom_extensions_path()]) as g:
        x = g.inputs[0].tensor
        outs = []
        w = len(per_set)
        for i in range(r_sets):
            args = [v.tensor for v in g.inputs[1 + w * i : 1 + w * (i + 1)]]
            if kind == "generated":
                (y,) = ops.custom(
                    "attnquant.generated_linear", dev, [x, *args], [TensorType(dt, ["m", "n"], dev)]
                )
            elif kind == "gemm":
                wcat, s, u = args
                ycat = ops.matmul(x, ops.transpose(wcat, 0, 1))  # [m, n + r]
                n_t = ops.shape_to_tensor([s.shape[0]])  # int64 [1] on the host
                y0 = ops.slice_tensor(ycat, [slice(None), (slice(0, n_t), "n")])
                t = ops.slice_tensor(ycat, [slice(None), (slice(n_t, None), "r")])
                y = y0 * s + ops.matmul(t, ops.transpose(u, 0, 1))
            else:
                y = ops.matmul(x, ops.transpose(args[0], 0, 1))
            outs.append(y)
        g.output(*outs)
    return g


class TimingCompiles:
    """Compiles the three timing graphs: in background worker processes
    (max.experimental.compile_pool, so they overlap each other and the check
    phase) unless ``parallel`` is off or the pool fails, then one at a time
    in this process. ``models()`` waits and returns {kind: model}."""

    def __init__(self, dv: Dev, r_sets: int, fails: Failures, parallel: bool) -> None:
        self.dv, self.fails, self.graphs, self.futures, self.pool = dv, fails, {}, {}, None
        self.t0 = time.time()
        for kind in KINDS:
            try:
                self.graphs[kind] = build_graph(dv, kind, r_sets)
            except Exception as e:
                fails.fail(f"timing graph {kind} did not build: {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
        if parallel and self.graphs:
            try:
                from max.experimental.compile_pool import ProcessCompilePool

                self.pool = ProcessCompilePool(max_workers=len(self.graphs))
                self.futures = {kind: self.pool.compile(g) for kind, g in self.graphs.items()}
                log(f"timing graphs {sorted(self.futures)} compiling in {len(self.futures)} worker processes")
            except Exception as e:
                log(f"parallel compile unavailable ({type(e).__name__}: {str(e)[:200]}); compiling serially")
                self.futures = {}

    def models(self) -> dict:
        models = {}
        for kind, g in self.graphs.items():
            t0 = time.time()
            fut = self.futures.get(kind)
            if fut is not None:
                try:
                    models[kind] = self.dv.session.init(fut.result(timeout=420))
                    log(f"graph {kind} compiled (worker) after {time.time() - self.t0:.1f} s")
                    continue
                except Exception as e:
                    log(f"worker compile of {kind} failed ({type(e).__name__}: {str(e)[:300]}); compiling here")
            try:
                models[kind] = self.dv.session.load(g)
                log(f"graph {kind} compiled in {time.time() - t0:.1f} s")
            except Exception as e:
                self.fails.fail(f"timing graph {kind} did not compile: {type(e).__name__}: {str(e)[:400]}")
                traceback.print_exc()
        if self.pool is not None:
            try:
                self.pool.close()
            except Exception:
                pass
        return models


def run_timing(
    dv: Dev, gen: torch.Generator, fails: Failures, models: dict, shapes, ms, ranks, r_sets: int, reps: int
) -> list[dict]:
    if dv.compile_only:
        return []
    bf16_run = dv.torch_dtype != torch.float32
    tol_gen = TOL_GEN if bf16_run else TOL_F32
    tol_gemm = TOL_GEMM if bf16_run else TOL_F32
    rows = []
    key = 5000
    for n, k in shapes:
        for r in ranks:
            # One random theta, copied to R distinct device buffers per kind
            # (distinct addresses are what defeats the L2; values may repeat).
            theta = random_theta(n, k, r, gen, dv.torch_dtype)
            w0, s, u, v = theta
            w_dense = (s[:, None] * w0.float() + u @ v.T).to(dv.torch_dtype)
            wcat = torch.cat([w0, v.T.to(dv.torch_dtype)], dim=0)
            s16, u16 = s.to(dv.torch_dtype), u.to(dv.torch_dtype)
            try:
                bufs = {
                    "generated": [b for _ in range(r_sets) for b in (dv.buf(w0), dv.buf(s), dv.buf(u), dv.buf(v))],
                    "gemm": [b for _ in range(r_sets) for b in (dv.buf(wcat), dv.buf(s16), dv.buf(u16))],
                    "dense": [dv.buf(w_dense) for _ in range(r_sets)],
                }
            except Exception as e:
                fails.fail(f"[{n},{k}] r={r}: buffers: {type(e).__name__}: {e}")
                continue
            for m in ms:
                x = torch.randn(m, k, generator=gen).to(dv.torch_dtype)
                xb = dv.buf(x)
                ref = ref_linear(x, theta)
                row = dict(n=n, k=k, m=m, r=r, r_sets=r_sets)
                for kind in KINDS:
                    if kind not in models:
                        continue
                    key += 1
                    what = f"timing {kind} [{n},{k}] M={m} r={r}"
                    try:
                        ms_per, outs, mode = nv.time_model(dv, models[kind], [xb, *bufs[kind]], key, reps)
                        err = rel_err(dv.host(outs[0]), ref)
                        fails.check(what, err, tol_gen if kind == "generated" else tol_gemm)
                        row[f"{kind}_us"] = ms_per * 1e3 / r_sets
                        row[f"{kind}_err"] = err
                        row[f"{kind}_mode"] = mode
                    except Exception as e:
                        fails.fail(f"{what}: {type(e).__name__}: {str(e)[:300]}")
                rows.append(row)
                log(json.dumps(row))
            del bufs
    return rows


def print_table(rows: list[dict]) -> None:
    def us(row: dict, kind: str) -> str:
        v = row.get(f"{kind}_us")
        return f"{v:.1f}" if v is not None else "—"

    def ratio(row: dict, a: str, b: str) -> str:
        va, vb = row.get(f"{a}_us"), row.get(f"{b}_us")
        return f"{va / vb:.2f}x" if va and vb else "—"

    log("")
    log("| [N, K] | M | r | generated_linear µs | GEMM formulation µs | dense bf16 µs | gen / dense | gen / GEMM | gen err | GEMM err |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        log(
            f"| {row['n']}x{row['k']} | {row['m']} | {row['r']} | {us(row, 'generated')} | {us(row, 'gemm')} "
            f"| {us(row, 'dense')} | {ratio(row, 'generated', 'dense')} | {ratio(row, 'generated', 'gemm')} "
            f"| {row.get('generated_err', float('nan')):.1e} | {row.get('gemm_err', float('nan')):.1e} |"
        )
    modes = sorted({row.get(f"{k}_mode") for row in rows for k in KINDS if row.get(f"{k}_mode")})
    log(f"timing mode: {modes}; µs per op = replay time / R weight sets")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes, R=2, 1 rep (checks the script, times nothing useful)")
    ap.add_argument("--compile-only", action="store_true", help="virtual sm_90a device; compile every graph, run nothing")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--r-sets", type=int, default=R_SETS)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--serial-compile", action="store_true", help="compile the timing graphs in this process, one at a time")
    args = ap.parse_args()
    if args.compile_only and args.device == "cpu":
        ap.error("--compile-only targets the virtual sm_90a GPU; drop --device cpu")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(int(time.time()))
    t_start = time.time()
    fails = Failures()

    shapes, mlp_shape, check_ms, check_ranks = SHAPES, MLP_SHAPE, CHECK_MS, CHECK_RANKS
    ms, ranks, r_sets, reps = MS, RANKS, args.r_sets, args.reps
    if args.dry_run:
        shapes, mlp_shape, check_ms, check_ranks = DRY_SHAPES, DRY_MLP, [1, 3, 17], [0, 4, 64]
        ms, ranks, r_sets, reps = [1, 3], [4], 2, 1

    dv = Dev(args.device, args.compile_only)
    log(f"device {args.device} ({dv.dtype}), shapes {shapes}, M {ms}, r {ranks}, R={r_sets}, reps={reps}")
    # Timing graphs compile in worker processes while the check phase runs.
    parallel = not (args.serial_compile or args.compile_only)
    compiles = None if args.skip_timing else TimingCompiles(dv, r_sets, fails, parallel)
    check_rows = [] if args.skip_check else check_public_entry(dv, gen, fails, shapes, mlp_shape, check_ms, check_ranks)
    rows = []
    if compiles is not None:
        models = compiles.models()
        rows = run_timing(dv, gen, fails, models, shapes, ms, ranks, r_sets, reps)

    if args.compile_only:
        log(f"compile-only: graphs compiled ({time.time() - t_start:.0f} s)")
    else:
        print_table(rows)
        result = dict(
            date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), device=args.device, dry_run=args.dry_run,
            check=check_rows, rows=rows, failures=fails.lines,
        )  # fmt: skip
        (args.out / "generated_linear_h200.json").write_text(json.dumps(result, indent=1))
    log(f"total {time.time() - t_start:.0f} s")
    if fails.lines:
        log(f"{len(fails.lines)} CHECKS FAILED")
        return 1
    log("ALL CHECKS PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
