"""A norm added to the residual stream, then the next norm: MAX's ops or one kernel of ours.

A Gemma decoder layer does this twice: after attention (post-attention norm,
residual, pre-MLP norm) and at its end (post-MLP norm, residual, the next
layer's input norm; ``models.common.layer_boundary``). MAX fuses each into
one kernel on a GPU; at decode that kernel is a chain of dependent steps on a
few KB, and attnquant's ``residual_rms_norm`` (``kernels/attnquant_ops/
residual_norm.mojo``) shortens the chain. Which runs is chosen once per model
(:func:`choose_norm_kernel`, logged with the reason) and both compute the same
roundings.
"""

from __future__ import annotations

import functools
import logging
import struct
from dataclasses import dataclass

from max.dtype import DType
from max.experimental.nn.norm import rms_norm
from max.experimental.tensor import Tensor

from attnquant.config import LOGGER_NAME
from attnquant.graph.ops import custom_op_outputs, pdl_refusal

logger = logging.getLogger(LOGGER_NAME)

KERNEL_VECTOR = 8
"""Values a thread of the kernel holds: the hidden size must be a multiple of it."""
KERNEL_MAX_HIDDEN = KERNEL_VECTOR * 1024
"""One block of at most 1024 threads holds a row."""
KERNEL_DTYPES = (DType.bfloat16, DType.float16, DType.float32)


@dataclass(frozen=True)
class NormKernelConfig:
    """What decides whether the kernel serves a model's residual norms.

    Attributes:
        hidden: the rows' width (the model's hidden size).
        dtype: the activations' dtype.
        device_api: ``"cpu"``, ``"cuda"`` or ``"hip"`` (``max.driver.Device.api``).
        setting: ``ATTNQUANT_NORM_KERNEL`` (None: auto).
        device_arch: e.g. ``"sm_90a"``; empty on CPU.
        pdl: ``ATTNQUANT_PDL`` (the kernel launches with programmatic
            dependent launch, on sm_90+).
    """

    hidden: int
    dtype: DType
    device_api: str
    setting: bool | None = None
    device_arch: str = ""
    pdl: bool = False


@dataclass(frozen=True)
class NormKernel:
    """How a model's residual norms run: attnquant's kernel (true) or MAX's
    ops (false), and whether the kernel launches with programmatic dependent
    launch (``kernels/attnquant_ops/pdl.mojo``)."""

    kernel: bool
    pdl: bool = False

    def __bool__(self) -> bool:
        return self.kernel


def can_use_kernel(config: NormKernelConfig) -> tuple[bool, str]:
    """Whether ``residual_rms_norm`` can serve ``config``, and why (not)."""
    if config.setting is False:
        return False, "ATTNQUANT_NORM_KERNEL=0"
    if config.device_api != "cuda":
        return False, f"the kernel runs on NVIDIA GPUs, this device is {config.device_api}"
    if config.dtype not in KERNEL_DTYPES:
        names = ", ".join(dtype.name for dtype in KERNEL_DTYPES)
        return False, f"activations are {config.dtype.name}, the kernel takes {names}"
    if config.hidden % KERNEL_VECTOR or config.hidden > KERNEL_MAX_HIDDEN:
        return False, (
            f"hidden size {config.hidden}: the kernel takes a multiple of {KERNEL_VECTOR} up to {KERNEL_MAX_HIDDEN}"
        )
    return True, "ATTNQUANT_NORM_KERNEL=1" if config.setting else "auto: an NVIDIA GPU, the hidden size fits"


@functools.lru_cache(maxsize=None)
def choose_norm_kernel(config: NormKernelConfig) -> NormKernel:
    """:func:`can_use_kernel`'s answer, and whether the kernel takes
    ``ATTNQUANT_PDL``, logged once per distinct config."""
    ok, why = can_use_kernel(config)
    refusal = pdl_refusal(config.device_api, config.device_arch) if ok and config.pdl else None
    pdl = ok and config.pdl and refusal is None
    if ok and config.pdl:
        why += f"; ATTNQUANT_PDL=1 not taken: {refusal}" if refusal else "; programmatic dependent launch (ATTNQUANT_PDL=1)"
    logger.info(
        "attnquant: residual norms (hidden %d, %s, %s): %s (%s)",
        config.hidden, config.dtype.name, config.device_api, "attnquant's kernel" if ok else "MAX's ops", why,
    )  # fmt: skip
    return NormKernel(ok, pdl)


def _float_bits(value: float) -> int:
    """``value`` as the bits of a float32, the form the kernel's parameters take."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


@dataclass(frozen=True)
class NormSpec:
    """One Gemma RMS norm: its weight (a value), epsilon and weight offset
    (1.0 where the checkpoint stores ``weight - 1``, Gemma 3; 0.0 for Gemma 4)."""

    weight: Tensor
    eps: float
    offset: float

    def __call__(self, x: Tensor) -> Tensor:
        """MAX's Gemma norm: scales by ``offset + weight`` before the cast."""
        return rms_norm(x, self.weight, self.eps, weight_offset=self.offset, multiply_before_cast=True)


def add_and_norm(
    x: Tensor,
    residual: Tensor,
    first: NormSpec,
    second: NormSpec,
    *,
    kernel: NormKernel | bool,
    scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(r, second(r))`` where ``r = residual * scale + first(x)`` (``scale``
    a [1] value, or none); ``x`` and ``residual`` are [rows, hidden].

    ``kernel``: :func:`choose_norm_kernel`'s answer (a bool: the kernel or
    not, without programmatic dependent launch). MAX's ops written this way
    are one kernel on a GPU too (its norm, add, norm fusion)."""
    if not kernel:
        scaled = residual if scale is None else residual * scale
        r = scaled + first(x)
        return r, second(r)
    parameters = {
        "scaled": scale is not None,
        "eps1_bits": _float_bits(first.eps),
        "eps2_bits": _float_bits(second.eps),
        "offset1_bits": _float_bits(first.offset),
        "offset2_bits": _float_bits(second.offset),
    }
    if isinstance(kernel, NormKernel) and kernel.pdl:
        parameters["pdl"] = True
    operands = [x, residual, first.weight, second.weight, first.weight if scale is None else scale]
    operands = [v if v.dtype == x.dtype else v.cast(x.dtype) for v in operands]  # the op takes one dtype
    out = (x.shape, x.dtype)
    normed, r = custom_op_outputs("attnquant.residual_rms_norm", x, operands, [out, out], parameters)
    return r, normed
