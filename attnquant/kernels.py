"""NVFP4 linear kernels: backends, the chooser, and the load-time weight layout.

Every NVFP4 projection computes ``y[M, N] = x[M, K] . W^T`` with
``W = e2m1(code) * e4m3(block_scale) * global_scale`` (ModelOpt layout: packed
uint8 ``[N, K/2]``, low nibble = even k; ``scale_bits`` uint8 ``[N, K/16]``,
the raw float8_e4m3fn bits; ``global_scale`` float32 ``[1]``).

Backends, tried in order (first that can implement the layer wins):

``mojo-sm90``
    Tensor-core GEMV (``mma.sync`` bf16, fp32 accumulation) over weights
    re-laid out once at load by :func:`prepare_weights`; NVIDIA sm_80+, bf16
    activations. M <= 16 runs the GEMV; larger M (prefill) dequantizes to bf16
    once per call and uses MAX's matmul (``attnquant.matmul.linear``, rows
    padded to full tiles on sm_90), chosen at run time with ``F.cond``.
``mojo-cpu``
    Mojo CPU kernel on the ModelOpt layout, float32 activations.
``mojo-gpu``
    Simple Mojo GPU kernel on the ModelOpt layout (any GPU, any dtype).
``graph-dequant``
    ``attnquant.nvfp4_graph``: stock MAX ops only; runs everywhere.

Typical use in a model layer::

    cfg = NVFP4LinearConfig.for_device(n, k, DType.bfloat16, device)
    kernel = choose_kernel(cfg)                                  # logged once
    packed, scale_bits = kernel.prepare_weights(packed, scale_bits)   # load time
    ...
    y = kernel.apply(x, packed, scale_bits, global_scale, cfg)   # graph build
"""

from __future__ import annotations

import enum
import functools
import logging
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from max.driver import Device
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, Graph, TensorType

from attnquant import matmul
from kernels import OPS_PATH
from kernels.sm90_layout import (
    BLOCK,
    TILE_K,
    TILE_N,
    check_modelopt_tensors,
    padded_shape,
    prepare_weights,
    sm90_reference_dequant,
)

# A child of MAX's logger, so the choice shows in `max serve`/`generate` output.
logger = logging.getLogger("max.pipelines.attnquant.kernels")

GEMV_MAX_M = 16  # above this, mojo-sm90 dequantizes and calls MAX's matmul


def custom_extensions_path() -> Path:
    """The Mojo package with the attnquant ops; pass it as ``custom_extensions``."""
    return OPS_PATH


_GRAPHS_WITH_OPS: weakref.WeakSet[Graph] = weakref.WeakSet()


def _ops_for_current_graph() -> Path | None:
    """The ops package the first time the graph being built asks, then None.

    Importing a Mojo *source* package into a graph re-runs ``mojo precompile``
    (seconds) on every import, and a model has one NVFP4 call per projection
    group: loading it once per graph took Gemma 3 270M's graph build from
    227 s to seconds on 2 cores.
    """
    graph = Graph.current
    if graph in _GRAPHS_WITH_OPS:
        return None
    _GRAPHS_WITH_OPS.add(graph)
    return custom_extensions_path()


class WeightLayout(enum.Enum):
    MODELOPT = "modelopt"  # packed [N, K/2], scale_bits [N, K/16]
    SM90 = "sm90"  # prepare_weights(): same bytes, tile-ordered and re-encoded

    def shapes(self, n: int, k: int) -> tuple[list[int], list[int]]:
        """The packed-weight and scale shapes of an [N, K] weight in this layout."""
        if self is WeightLayout.SM90:
            n, k = padded_shape(n, k)
        return [n, k // 2], [n, k // BLOCK]


@dataclass(frozen=True)
class NVFP4LinearConfig:
    """What a backend needs to know about one projection.

    Attributes:
        n, k: output and input features of the (unpadded) weight.
        act_dtype: dtype of the activations (and of the output).
        device_api: ``"cpu"``, ``"cuda"`` or ``"hip"`` (``max.driver.Device.api``).
        device_arch: e.g. ``"sm_90a"``; empty on CPU.
        max_m: the largest number of activation rows the layer will see, if
            known (only used to skip building the large-M branch).
        layout: if set, only backends taking this weight layout qualify.
        gemv_only: GPU backends run their GEMV kernel at every M instead of
            branching to dequantize + matmul above ``GEMV_MAX_M``
            (``ATTNQUANT_NVFP4_DISPATCH=gemv``).
    """

    n: int
    k: int
    act_dtype: DType
    device_api: str
    device_arch: str = ""
    max_m: int | None = None
    layout: WeightLayout | None = None
    gemv_only: bool = False

    @classmethod
    def for_device(
        cls,
        n: int,
        k: int,
        act_dtype: DType,
        device: Device,
        *,
        max_m: int | None = None,
        layout: WeightLayout | None = None,
        gemv_only: bool = False,
    ) -> NVFP4LinearConfig:
        return cls(n, k, act_dtype, str(device.api), matmul.device_arch(device), max_m, layout, gemv_only)

    @property
    def cuda_capability(self) -> int:
        """NVIDIA compute capability as 90 for sm_90a; 0 if not NVIDIA."""
        match = re.fullmatch(r"sm_(\d+)[a-z]?", self.device_arch)
        return int(match.group(1)) if self.device_api == "cuda" and match else 0


class NVFP4Kernel:
    """One backend. Subclasses set ``name``/``layout`` and implement
    ``can_implement`` and ``apply``; ``prepare_weights`` is the identity for
    the ModelOpt layout."""

    name: ClassVar[str]
    layout: ClassVar[WeightLayout] = WeightLayout.MODELOPT

    @classmethod
    def can_implement(cls, config: NVFP4LinearConfig) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def prepare_weights(
        cls, packed: torch.Tensor, scale_bits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_modelopt_tensors(packed, scale_bits)
        return packed, scale_bits

    @classmethod
    def apply(
        cls,
        x: Tensor,
        packed: Tensor,
        scale_bits: Tensor,
        global_scale: Tensor,
        config: NVFP4LinearConfig,
    ) -> Tensor:
        raise NotImplementedError


def _layout_ok(cls: type[NVFP4Kernel], config: NVFP4LinearConfig) -> tuple[bool, str]:
    if config.layout is not None and config.layout is not cls.layout:
        return False, f"takes the {cls.layout.value} layout, weights are {config.layout.value}"
    if config.k % BLOCK != 0:
        return False, f"K={config.k} is not a multiple of {BLOCK}"
    return True, ""


class MojoSM90Kernel(NVFP4Kernel):
    name = "mojo-sm90"
    layout = WeightLayout.SM90

    @classmethod
    def can_implement(cls, config: NVFP4LinearConfig) -> tuple[bool, str]:
        ok, why = _layout_ok(cls, config)
        if not ok:
            return ok, why
        if config.device_api != "cuda":
            return False, f"needs an NVIDIA GPU, device is {config.device_api}"
        if config.cuda_capability < 80:
            return False, f"needs mma.sync bf16 (sm_80+), device is {config.device_arch}"
        if config.act_dtype != DType.bfloat16:
            return False, f"needs bf16 activations, got {config.act_dtype}"
        return True, f"tensor-core GEMV for M<={GEMV_MAX_M} on {config.device_arch}"

    @classmethod
    def prepare_weights(
        cls, packed: torch.Tensor, scale_bits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return prepare_weights(packed, scale_bits)

    @classmethod
    def apply(cls, x, packed, scale_bits, global_scale, config):
        return _gemv_or_dequant_matmul(
            x, [packed, scale_bits, global_scale], config,
            gemv_op="attnquant.nvfp4_gemv_sm90", dequant_op="attnquant.nvfp4_dequant_sm90",
            weight_dtype=DType.bfloat16,
        )  # fmt: skip


class MojoCPUKernel(NVFP4Kernel):
    name = "mojo-cpu"

    @classmethod
    def can_implement(cls, config: NVFP4LinearConfig) -> tuple[bool, str]:
        ok, why = _layout_ok(cls, config)
        if not ok:
            return ok, why
        if config.device_api != "cpu":
            return False, f"CPU only, device is {config.device_api}"
        if config.act_dtype != DType.float32:
            return False, f"needs float32 activations (MAX has no CPU bf16), got {config.act_dtype}"
        return True, "Mojo CPU kernel, float32"

    @classmethod
    def apply(cls, x, packed, scale_bits, global_scale, config):
        return _custom("attnquant.nvfp4_matmul", x, [packed, scale_bits, global_scale], config.n)


class MojoGenericGPUKernel(NVFP4Kernel):
    name = "mojo-gpu"

    @classmethod
    def can_implement(cls, config: NVFP4LinearConfig) -> tuple[bool, str]:
        ok, why = _layout_ok(cls, config)
        if not ok:
            return ok, why
        if config.device_api not in ("cuda", "hip"):
            return False, f"GPU only, device is {config.device_api}"
        return True, "simple Mojo GPU kernel (not tuned)"

    @classmethod
    def apply(cls, x, packed, scale_bits, global_scale, config):
        return _gemv_or_dequant_matmul(
            x, [packed, scale_bits, global_scale], config,
            gemv_op="attnquant.nvfp4_matmul", dequant_op="attnquant.nvfp4_dequant",
            weight_dtype=x.dtype,
        )  # fmt: skip


class GraphDequantKernel(NVFP4Kernel):
    name = "graph-dequant"

    @classmethod
    def can_implement(cls, config: NVFP4LinearConfig) -> tuple[bool, str]:
        ok, why = _layout_ok(cls, config)
        return (ok, why) if not ok else (True, "stock MAX ops (decode tables + matmul)")

    @classmethod
    def apply(cls, x, packed, scale_bits, global_scale, config):
        from attnquant import nvfp4_graph

        return nvfp4_graph.linear(x, packed, scale_bits, global_scale)


KERNELS: tuple[type[NVFP4Kernel], ...] = (
    MojoSM90Kernel,
    MojoCPUKernel,
    MojoGenericGPUKernel,
    GraphDequantKernel,
)


@functools.lru_cache(maxsize=None)
def choose_kernel(config: NVFP4LinearConfig) -> type[NVFP4Kernel]:
    """The first backend in ``KERNELS`` that can implement ``config``.

    Logged once per distinct config (cached), with the reason each earlier
    backend was skipped."""
    skipped = []
    for kernel in KERNELS:
        ok, why = kernel.can_implement(config)
        if ok:
            logger.info(
                "NVFP4 [%d, %d] %s on %s %s: using %s (%s)%s%s",
                config.n, config.k, config.act_dtype, config.device_api, config.device_arch,
                kernel.name, why,
                "; GEMV at every M (ATTNQUANT_NVFP4_DISPATCH=gemv)" if config.gemv_only else "",
                "; skipped " + "; ".join(skipped) if skipped else "",
            )  # fmt: skip
            return kernel
        skipped.append(f"{kernel.name}: {why}")
    raise ValueError(f"no NVFP4 kernel can implement {config}: " + "; ".join(skipped))


def nvfp4_linear(
    x: Tensor,
    packed: Tensor,
    scale_bits: Tensor,
    global_scale: Tensor,
    *,
    layout: WeightLayout = WeightLayout.MODELOPT,
    out_features: int | None = None,
    gemv_only: bool = False,
) -> Tensor:
    """``x @ dequant(W).T`` (output in ``x``'s dtype), on the best backend for
    ``x``'s device, dtype and the weight's shape.

    ``x`` may have any leading dims; the last is K. Weights in the ModelOpt
    layout need no preparation. Weights from :func:`prepare_weights` are
    padded, so pass ``layout=WeightLayout.SM90`` and ``out_features=N``.
    """
    k = int(x.shape[-1])
    if layout is WeightLayout.SM90 and out_features is None:
        raise ValueError("prepared (sm90) weights are padded: pass out_features=N")
    n = int(packed.shape[0]) if out_features is None else out_features
    config = NVFP4LinearConfig.for_device(n, k, x.dtype, x.device, layout=layout, gemv_only=gemv_only)
    kernel = choose_kernel(config)
    lead = list(x.shape[:-1])
    x2 = x if x.rank == 2 else F.reshape(x, [-1, k])
    y = kernel.apply(x2, packed, scale_bits, global_scale, config)
    return y if x.rank == 2 else F.reshape(y, [*lead, n])


# ---------------------------------------------------------------------------
# Graph helpers
# ---------------------------------------------------------------------------


def _custom(name: str, x: Tensor, weights: list[Tensor], n: int) -> Tensor:
    out = TensorType(x.dtype, [x.shape[0], n], DeviceRef.from_device(x.device))
    (y,) = F.custom(name, x.device, [x, *weights], [out], custom_extensions=_ops_for_current_graph())
    return y


def _gemv_or_dequant_matmul(
    x: Tensor,
    weights: list[Tensor],
    config: NVFP4LinearConfig,
    *,
    gemv_op: str,
    dequant_op: str,
    weight_dtype: DType,
) -> Tensor:
    """The GEMV op for decode-sized M; for prefill, decode W once and use MAX's matmul."""
    # A ModuleV3 weight enters the graph where it is first used. Inside one
    # branch of F.cond that value would not dominate the other branch, so
    # bring each weight into the enclosing block first (a same-shape reshape
    # is a view).
    weights = [F.reshape(w, list(w.shape)) for w in weights]

    def gemv() -> Tensor:
        return _custom(gemv_op, x, weights, config.n)

    def dequant_matmul() -> Tensor:
        device = DeviceRef.from_device(x.device)
        (w,) = F.custom(
            dequant_op,
            x.device,
            weights,
            [TensorType(weight_dtype, [config.n, config.k], device)],
            custom_extensions=_ops_for_current_graph(),
        )
        return matmul.linear(x, w)

    return _dispatch_on_m(x, config, gemv, dequant_matmul)


def _dispatch_on_m(x: Tensor, config: NVFP4LinearConfig, small, large) -> Tensor:
    """``small()`` for M <= GEMV_MAX_M, else ``large()``. Decided while
    building the graph when M is static (or ``config.max_m`` bounds it), at run
    time with ``F.cond`` when M is symbolic; always ``small()`` (correct at
    any M) with ``config.gemv_only``."""
    if config.gemv_only:
        return small()
    m = x.shape[0]
    bound = int(m) if matmul.is_static_dim(m) else config.max_m
    if bound is not None and bound <= GEMV_MAX_M:
        return small()
    if matmul.is_static_dim(m):
        return large()
    pred = F.shape_to_tensor([m])[0] <= GEMV_MAX_M
    out = TensorType(x.dtype, [m, config.n], DeviceRef.from_device(x.device))
    (y,) = F.cond(pred, [out], small, large)
    return y


def capture_off_advice(dispatch: str, device_api: str, graph_capture: bool | None) -> str | None:
    """A warning when NVFP4 projections on a GPU keep their per-projection
    token-count branch (``ATTNQUANT_NVFP4_DISPATCH=auto``) and the server runs
    without device graph capture: uncaptured, every branch is a host-side
    step. None when that cost does not apply (or capture is not known)."""
    if dispatch != "auto" or device_api == "cpu" or graph_capture is not False:
        return None
    return (
        "attnquant: NVFP4 on a GPU without device graph capture: each projection chooses "
        "GEMV or dequantize+matmul with a run-time branch, measured at +2.4 ms per decode "
        "step for Gemma 3 1B and +2.2 ms for 30 layers of Gemma 4 31B on an H200 "
        "(docs/throughput.md, runs 4 and 7). Remove --no-device-graph-capture (MAX captures "
        "attnquant's architectures by default; for Gemma 4, unless "
        "ATTNQUANT_GEMMA4_GRAPH_CAPTURE=0), or set "
        "ATTNQUANT_NVFP4_DISPATCH=gemv (no branch; prefill re-reads the weights every "
        f"{GEMV_MAX_M} tokens)."
    )


def describe(config: NVFP4LinearConfig) -> str:
    """One line per backend: can it implement ``config``, and why (for logs/CLI)."""
    return "\n".join(f"{k.name}: {k.can_implement(config)}" for k in KERNELS)


__all__ = [
    "BLOCK",
    "GEMV_MAX_M",
    "TILE_K",
    "TILE_N",
    "KERNELS",
    "GraphDequantKernel",
    "MojoCPUKernel",
    "MojoGenericGPUKernel",
    "MojoSM90Kernel",
    "NVFP4Kernel",
    "NVFP4LinearConfig",
    "WeightLayout",
    "choose_kernel",
    "custom_extensions_path",
    "describe",
    "nvfp4_linear",
    "prepare_weights",
    "sm90_reference_dequant",
]
