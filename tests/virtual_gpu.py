"""MAX graphs compiled for a GPU this machine does not have: MAX 26.7's
virtual-device mode, in a child process (the virtual device is process-wide)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from attnquant.max_compat import child_environment

ROOT = Path(__file__).resolve().parents[1]

_PREAMBLE = """\
from max import driver
driver.set_virtual_device_api("cuda")
driver.set_virtual_device_target_arch({arch!r})
driver.set_virtual_device_count(1)
from max.dtype import DType
from max.engine import InferenceSession
from max.experimental import compilation
from max.experimental.sharding import TensorLayout
from attnquant.max_compat import exit_after_virtual_compile

gpu = driver.Accelerator()
session = InferenceSession(devices=[driver.CPU(), gpu])
"""


def compile_for_virtual_gpu(arch: str, body: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs ``body`` (Python; ``gpu``, ``session``, ``DType``,
    ``compilation`` and ``TensorLayout`` are defined for it) in a child whose
    one GPU is a virtual ``arch``, from the repository root; the child exits
    through ``exit_after_virtual_compile``."""
    script = _PREAMBLE.format(arch=arch) + textwrap.dedent(body) + "\nexit_after_virtual_compile()\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200,
                          env={**child_environment(), **(env or {})}, cwd=ROOT)  # fmt: skip
