"""GPU clock and power while a benchmark runs, sampled with nvidia-smi.

The captured Gemma 3 1B decode step has sat at 2.23 ms in some server
sessions and 2.60 ms in others, and one trial ran at 1.85 ms
(docs/dev/lab-log.md). A replayed step of ~20 small kernels per layer is latency-bound, so
the SM clock is the first suspect; nothing is pinned (the lent GPU's settings
are left alone), so the harness records what the clock was instead.

``ClockSampler`` reads ``nvidia-smi -lms`` in a thread and stamps each sample
with this host's clock; ``during(start, end)`` summarises a time window. Where
nvidia-smi is missing it samples nothing and every summary is empty.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

QUERY = "clocks.sm,clocks.mem,power.draw"


@dataclass
class ClockSampler:
    interval_ms: int = 200
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)
    _process: subprocess.Popen | None = None
    _reader: threading.Thread | None = None

    def __enter__(self) -> ClockSampler:
        if shutil.which("nvidia-smi"):
            self._process = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", "0",
                 "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            try:
                sm, mem, power = (float(part) for part in line.split(","))
            except ValueError:  # "[N/A]" or a partial line
                continue
            self.samples.append((time.time(), sm, mem, power))

    def __exit__(self, *_: object) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=10)

    def during(self, start: float, end: float) -> dict[str, float]:
        """Median SM clock (and its min and max), median memory clock and power
        over the samples taken between ``start`` and ``end`` (Unix seconds)."""
        window = [s for s in self.samples if start <= s[0] <= end]
        if not window:
            return {}
        sm = [s[1] for s in window]
        return {
            "sm_mhz": statistics.median(sm), "sm_mhz_min": min(sm), "sm_mhz_max": max(sm),
            "mem_mhz": statistics.median(s[2] for s in window),
            "power_w": statistics.median(s[3] for s in window), "clock_samples": len(window),
        }  # fmt: skip
