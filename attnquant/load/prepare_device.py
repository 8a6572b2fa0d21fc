"""Where load-time weight preparation (W_eff, NVFP4 quantization) runs.

Preparing is elementwise work over every projection weight: on an H200
torch quantizes at 44-48 GB/s on the GPU and well under 1 GB/s on the host
(docs/performance.md). The quantizer gives the same bits on both (checked by
tests and by ``bench/kernel_timing/quantize_speed.py`` against MAX's reference), so
the device changes the time, not the weights, and the quantized-weight cache
does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU = torch.device("cpu")


@dataclass(frozen=True)
class PrepareDevice:
    """The torch device weight preparation runs on, and why (for the log)."""

    device: torch.device
    reason: str

    @property
    def is_gpu(self) -> bool:
        return self.device.type != "cpu"


def choose(setting: str, serving_api: str, serving_id: int = 0) -> PrepareDevice:
    """The device for ``ATTNQUANT_PREPARE_DEVICE=setting`` when the model is
    served on a MAX device of ``serving_api`` (``"cpu"``, ``"cuda"``, ``"hip"``)
    with index ``serving_id``.

    Raises:
        ValueError: ``setting`` is ``"gpu"`` and torch cannot use that GPU.
    """
    variable = f"ATTNQUANT_PREPARE_DEVICE={setting}"
    if setting == "cpu":
        return PrepareDevice(CPU, variable)
    if serving_api not in ("cuda", "hip"):
        return _cpu_unless_required(setting, f"serving on {serving_api}, not a GPU ({variable})")
    # torch reaches NVIDIA and AMD GPUs alike through torch.cuda.
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} has no usable CUDA/ROCm device"
        return _cpu_unless_required(setting, f"{build} ({variable})")
    if serving_id >= torch.cuda.device_count():
        seen = f"torch sees {torch.cuda.device_count()} GPU(s), serving on GPU {serving_id}"
        return _cpu_unless_required(setting, f"{seen} ({variable})")
    return PrepareDevice(torch.device("cuda", serving_id), f"torch can use the serving GPU ({variable})")


def for_host(setting: str) -> PrepareDevice:
    """Outside serving (``attnquant quantize``): the first GPU torch can use."""
    return choose(setting, "cuda", 0)


def _cpu_unless_required(setting: str, reason: str) -> PrepareDevice:
    if setting == "gpu":
        raise ValueError(
            f"{reason}: weights cannot be prepared on a GPU. Install a CUDA (or ROCm) "
            "build of torch, or set ATTNQUANT_PREPARE_DEVICE=auto or cpu."
        )
    return PrepareDevice(CPU, reason)


def release(prepare: PrepareDevice) -> None:
    """Hands torch's cached GPU blocks back, so MAX's allocations see them free."""
    if prepare.is_gpu:
        torch.cuda.empty_cache()
