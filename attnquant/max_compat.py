"""Every place attnquant leans on a MAX 26.7 internal or works around a MAX
26.7 problem, in one module.

Each item says why it is needed; ``tests/test_max_compat.py`` asserts that
MAX still behaves the way the workaround assumes, so an upgrade that fixes
or moves any of it fails loudly instead of silently changing behaviour.
docs/dev/max-workarounds.md has the evidence for each and the upstream issue.
"""

from __future__ import annotations

import enum
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from max.driver import Device
from max.dtype import DType

MAX_VERSION = "26.7.0"

# --- MAX 26.7's sm_90 bf16 matmul ------------------------------------------

SM90_ROW_TILE = 64
"""MAX 26.7's bf16 matmul on sm_90 stores its last, partial tile of this many
token rows whole, past the end of its output (modular/modular#6883): for 2 to
63 rows (and any count that is not a multiple of 64) it overwrites whatever
lies after the output. One row runs a GEMV and is right."""


class RowPadding(str, enum.Enum):
    """How our MAX matmuls keep clear of the partial-tile bug (``ATTNQUANT_ROW_PADDING``)."""

    OFF = "off"
    """Rows as they are: a MAX without the bug, or a device it does not touch."""
    FIXED = "fixed"
    """Zero rows appended up to a multiple of :data:`SM90_ROW_TILE` (one row
    stays one) by shape arithmetic: no branch, but the padding's concatenation
    and slice run at every token count."""
    BRANCH = "branch"
    """As ``FIXED``, inside a run-time branch that one row skips. A branch is a
    host-side step when decode steps are not captured, so only chosen when they are."""


def row_padding(mode: bool | None, dtype: DType, device_api: str, device_arch: str, graph_capture: bool | None) -> RowPadding:
    """The padding our matmuls use on this device, for ``ATTNQUANT_ROW_PADDING``
    = ``mode`` (None: auto, where the bug was seen: bf16 on sm_90)."""
    sm90_bf16 = device_api == "cuda" and device_arch.startswith("sm_90") and dtype == DType.bfloat16
    if mode is False or (mode is None and not sm90_bf16):
        return RowPadding.OFF
    return RowPadding.BRANCH if graph_capture else RowPadding.FIXED


MIN_INNER_MULTIPLE = 32
"""Inner (K) widths of our matmuls with a small K are padded to this multiple:
MAX 26.7's SM90 bf16 matmul does not compile for a small K (``[M, 12] @ [12,
1536]`` stops at ``sm90/tile_loader.mojo:501``). The theta residual
``(x V) U^T`` has K = the rank; the load pads U and V with zero columns, which
leaves the product unchanged."""

SM90_SPLIT_K_SHAPES: frozenset[tuple[int, int]] = frozenset(
    {(5376, 21504), (5376, 4096), (43008, 5376), (8192, 5376), (5120, 13824), (2560, 8192)}
)
"""[N, K] of W with split-K entries in MAX 26.7's SM90 bf16 tuning tables
(written for Gemma 3 27B). With a symbolic token count their split-K
workspace comes out empty and the compile stops
(``tile_scheduler_splitk.mojo:127``); Gemma 4 31B's MLP has these shapes."""


def needs_row_split(n: int, k: int, dtype: DType, device_api: str, m_is_static: bool) -> bool:
    """Whether ``x @ W.T`` (W [N, K]) would reach MAX 26.7's uncompilable
    split-K path: bf16 on an NVIDIA GPU, symbolic M, a tabled shape. Splitting
    W's rows in two moves both halves off the table."""
    return device_api == "cuda" and dtype == DType.bfloat16 and not m_is_static and (n, k) in SM90_SPLIT_K_SHAPES


def device_arch(device: Device) -> str:
    """The device's architecture name (e.g. ``"sm_90a"``); empty for the CPU."""
    return "" if device.api == "cpu" else str(device.architecture_name)


def cuda_capability(device_api: str, device_arch: str) -> int:
    """NVIDIA compute capability as 90 for sm_90a; 0 if not NVIDIA."""
    match = re.fullmatch(r"sm_(\d+)[a-z]?", device_arch)
    return int(match.group(1)) if device_api == "cuda" and match else 0

# --- MAX's pipeline internals -------------------------------------------------


class DevicesFromMesh:
    """Gives a ModuleV3 arch config the ``devices`` property it lacks.

    MAX's ``PagedMemoryPlanner`` only accepts configs satisfying its
    ``ModelConfigWithKVCache`` protocol (``devices`` + ``get_kv_params``).
    MAX's ModuleV3 ``Gemma3Config`` keeps its devices in ``mesh`` and has no
    ``devices``, so the planner refuses it and the ModuleV3 Gemma 3 cannot be
    served at all.
    """

    mesh: Any

    @property
    def devices(self) -> list[Device]:
        return list(self.mesh.devices)


def gemma3_attention_scale(query_pre_attn_scalar: float | None, head_dim: int) -> float:
    """Gemma 3's attention scale, ``query_pre_attn_scalar ** -0.5`` (transformers').

    MAX 26.7's Gemma 3 (ModuleV3 and graph API) reads ``query_pre_attn_scalar``
    into its config and never uses it: its attention scales by
    ``head_dim ** -0.5``. The two agree for Gemma 3 270M to 12B (both 256)
    and differ for Gemma 3 27B (168 against head_dim 128), whose attention
    logits MAX's own model then scales by 1.15x too much.
    """
    return float(query_pre_attn_scalar or head_dim) ** -0.5


def weight_files(weights: Any) -> list[Path]:
    """The checkpoint files behind MAX's ``Weights`` object.

    MAX resolves the weight files (local dir, HF cache, explicit
    ``--weight-path``) but exposes them only on its private attribute; we
    need the files to key the quantized-weight cache by checkpoint identity.
    """
    files = getattr(weights, "_filepaths", None)
    if not files:
        raise ValueError(
            f"cannot find the checkpoint files behind {type(weights).__name__}; "
            "attnquant needs safetensors weights (--weight-path *.safetensors)"
        )
    return [Path(f) for f in files]


def child_environment() -> dict[str, str]:
    """The environment to hand a child process explicitly (``env=``).

    Loading MAX's native library sets ``PYTHONEXECUTABLE`` (to the first
    ``python3`` on PATH) and ``PYTHONPATH`` with C ``setenv``: invisible in
    ``os.environ``, but inherited by every child started without ``env=``, so
    ``[sys.executable, ...]`` then runs outside the virtual environment and
    cannot import its packages. MAX itself may rely on them in-process, so we
    leave them alone and pass children ``os.environ``'s view instead.
    """
    return dict(os.environ)


def gpu_check_session(virtual_arch: str | None = None) -> tuple[Any, Device, Device]:
    """``(session, gpu, cpu)`` for a script that checks graphs on a GPU: the
    GPU present, or with ``virtual_arch`` (e.g. ``"sm_90a"``) a virtual NVIDIA
    one, for compiling without a GPU (end such a process with
    :func:`exit_after_virtual_compile`). Call it before anything else builds
    a MAX device: the virtual device is process-wide."""
    from max import driver
    from max.engine import InferenceSession

    if virtual_arch:
        driver.set_virtual_device_api("cuda")
        driver.set_virtual_device_target_arch(virtual_arch)
        driver.set_virtual_device_count(1)
    gpu, cpu = driver.Accelerator(), driver.CPU()
    return InferenceSession(devices=[cpu, gpu]), gpu, cpu


def exit_after_virtual_compile(code: int = 0) -> NoReturn:
    """End a process that compiled graphs for a virtual device, skipping
    interpreter teardown.

    After a compile in MAX 26.7's virtual-device mode the process can abort
    while exiting ("terminate called without an active exception", SIGABRT:
    a native thread still joinable when it is destroyed), intermittently and
    more often on a busy machine, after everything it did succeeded. Such a
    process has nothing left to release, so it leaves at once with ``code``.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
