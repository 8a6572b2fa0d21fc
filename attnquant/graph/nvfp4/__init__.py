"""NVFP4 projections in the graph: the backends, one file each, and the chooser.

Backends, tried in order (the first that can implement the layer wins):

``max-sm100`` (``sm100.py``)
    MAX's own NVFP4 block-scaled matmul on Blackwell (sm_100-sm_109): W4A4
    (activations quantized to NVFP4 in the graph); compile-checked for a
    virtual sm_100a, not measured.
``mojo-sm90`` (``sm90.py``)
    Tensor-core GEMV over weights re-laid out at load; NVIDIA sm_80+, bf16.
``mojo-cpu`` (``cpu.py``)
    Mojo CPU kernel on the ModelOpt layout, float32 activations.
``mojo-gpu`` (``gpu.py``)
    Simple Mojo GPU kernel on the ModelOpt layout (any GPU, any dtype).
``graph-dequant`` (``dequant.py``)
    Stock MAX ops only; runs everywhere.

The choice is made once per layer when the weights are converted for the
serving device (``attnquant.graph.runtime``), logged with the reason each
earlier backend was skipped, and recorded in the plan (``PartPlan.backend``);
the graph looks the backend up by that name (:func:`backend_named`).
"""

from __future__ import annotations

import functools
import logging

from max.experimental import functional as F
from max.experimental.tensor import Tensor

from attnquant.config import LOGGER_NAME
from attnquant.graph.nvfp4.base import (
    GEMV_MAX_M,
    NVFP4Backend,
    NVFP4LayerConfig,
    WeightLayout,
)
from attnquant.graph.nvfp4.cpu import MojoCPUBackend
from attnquant.graph.nvfp4.dequant import GraphDequantBackend
from attnquant.graph.nvfp4.gpu import MojoGenericGPUBackend
from attnquant.graph.nvfp4.sm90 import MojoSM90Backend
from attnquant.graph.nvfp4.sm100 import MaxSM100Backend
from attnquant.max_compat import device_arch

logger = logging.getLogger(LOGGER_NAME)

BACKENDS: tuple[type[NVFP4Backend], ...] = (
    MaxSM100Backend,
    MojoSM90Backend,
    MojoCPUBackend,
    MojoGenericGPUBackend,
    GraphDequantBackend,
)
_BY_NAME = {backend.name: backend for backend in BACKENDS}


@functools.lru_cache(maxsize=None)
def choose_backend(config: NVFP4LayerConfig) -> type[NVFP4Backend]:
    """The first backend in ``BACKENDS`` that can implement ``config``.

    Logged once per distinct config (cached), with the reason each earlier
    backend was skipped.

    Raises:
        ValueError: when none can, with every backend's reason.
    """
    skipped = []
    for backend in BACKENDS:
        ok, why = backend.can_implement(config)
        if ok:
            params, params_why = backend.kernel_parameters(config)
            why = f"{why}; {params_why}" if params_why else why
            logger.info(
                "attnquant: NVFP4 [%d, %d] %s on %s %s: using %s (%s)%s%s",
                config.n, config.k, config.act_dtype, config.device_api, config.device_arch,
                backend.name, why,
                "; GEMV at every M (ATTNQUANT_NVFP4_DISPATCH=gemv)" if config.gemv_only else "",
                "; skipped " + "; ".join(skipped) if skipped else "",
            )  # fmt: skip
            return backend
        skipped.append(f"{backend.name}: {why}")
    raise ValueError(f"no NVFP4 backend can implement {config}: " + "; ".join(skipped))


def backend_named(name: str) -> type[NVFP4Backend]:
    """The backend the plan recorded for a part."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown NVFP4 backend {name!r}; known: {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def apply(backend: type[NVFP4Backend], x: Tensor, weights: tuple[Tensor, Tensor, Tensor], config: NVFP4LayerConfig) -> Tensor:
    """``backend.apply`` for ``x`` with any leading dims (the last is K)."""
    if x.rank == 2:
        return backend.apply(x, *weights, config)
    lead = list(x.shape[:-1])
    y = backend.apply(F.reshape(x, [-1, config.k]), *weights, config)
    return F.reshape(y, [*lead, config.out_features])


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
    """``x @ dequant(W).T`` on the best backend for ``x``'s device and dtype
    among those reading ``layout`` (for benchmarks and tests; models use the
    backend their plan records).

    Weights from the sm90 layout are padded: pass ``out_features=N``.
    """
    if layout is WeightLayout.SM90 and out_features is None:
        raise ValueError("prepared (sm90) weights are padded: pass out_features=N")
    k = int(x.shape[-1])
    n = int(packed.shape[0]) if out_features is None else out_features
    config = NVFP4LayerConfig(
        n, k, x.dtype, str(x.device.api), device_arch(x.device), gemv_only=gemv_only, layout=layout
    )
    return apply(choose_backend(config), x, (packed, scale_bits, global_scale), config)


__all__ = [
    "BACKENDS",
    "GEMV_MAX_M",
    "GraphDequantBackend",
    "MaxSM100Backend",
    "MojoCPUBackend",
    "MojoGenericGPUBackend",
    "MojoSM90Backend",
    "NVFP4Backend",
    "NVFP4LayerConfig",
    "WeightLayout",
    "apply",
    "backend_named",
    "choose_backend",
    "nvfp4_linear",
]
