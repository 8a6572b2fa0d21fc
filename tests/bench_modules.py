"""The scripts under bench/, imported as tests see them: a script's own group
(bench/<group>/) is on its path, as when it runs, so it imports its neighbours."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_path(name: str) -> Path:
    """The group folder holding the script or package ``name``."""
    (match,) = [*BENCH.glob(f"*/{name}.py"), *BENCH.glob(f"*/{name}/__init__.py")]
    return match.parent.parent if match.name == "__init__.py" else match.parent


def bench_module(name: str) -> ModuleType:
    folder = bench_path(name)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))
