"""Every place attnquant leans on a MAX 26.7 internal, in one module.

Each item says why it is needed; ``tests/test_max_compat.py`` asserts that
MAX still behaves the way the workaround assumes, so an upgrade that fixes
or moves any of it fails loudly instead of silently changing behaviour.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from max.driver import Device

MAX_VERSION = "26.7.0"


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
