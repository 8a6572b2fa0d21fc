"""Mojo GPU code compiled for a virtual sm_90a on a machine with no GPU: the
PTX of each kernel a harness file launches, for tests to inspect."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnquant.max_compat import child_environment

ROOT = Path(__file__).resolve().parents[1]


def sm90a_ptx(source: Path, out: Path) -> list[Path]:
    """``mojo build --emit asm`` of ``source`` (importing ``kernels/``) into
    ``out``: one .ptx file per kernel, sorted by name. Skips the test where
    no Mojo compiler is installed."""
    mojo = shutil.which("mojo") or str(Path(sys.executable).parent / "mojo")
    if not Path(mojo).exists():
        pytest.skip("mojo compiler not installed")
    result = subprocess.run(
        [mojo, "build", "-I", str(ROOT / "kernels"), "--target-accelerator", "sm_90a", "--emit", "asm",
         "-o", str(out / "h.s"), str(source)],
        cwd=out, capture_output=True, text=True, timeout=900, env=child_environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return sorted(out.glob("*.ptx"))
