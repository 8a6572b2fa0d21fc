"""bench/kernel_timing/kernels_h200.py's pieces that run without a GPU."""

from __future__ import annotations

from tests.bench_modules import bench_module


def test_load_only_fit_recovers_stream_and_fixed_cost() -> None:
    """kernels_h200.py's fit of the load-only diagnostics (what its table's
    last line reports): exact on rows made from a known line, blind to the
    GEMV variants' rows and to other row counts."""
    sweep = bench_module("kernels_h200")
    shapes = [(16384, 5376), (5376, 8192), (1536, 1152)]
    rows = []
    for n, k in shapes:
        mb = n * k * sweep.FP4_BYTES_PER_WEIGHT / 1e6
        rows.append(dict(n=n, k=k, m=1, variant="ld0", us=mb / 4.0 + 2.5))
        rows.append(dict(n=n, k=k, m=1, variant="ld8", us=mb / 4.0 + 3.5))  # slower: not the best
        rows.append(dict(n=n, k=k, m=1, variant="gv0", us=mb / 9.0))  # a GEMV row: ignored
        rows.append(dict(n=n, k=k, m=4, variant="ld0", us=1.0))  # another M: ignored
    stream, fixed, count = sweep.load_only_fit(rows)
    assert count == 3 and abs(stream - 4.0) < 1e-9 and abs(fixed - 2.5) < 1e-9
    assert sweep.load_only_fit(rows[:4]) is None  # one shape: no fit
