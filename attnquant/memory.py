"""How much device memory the served weights take, before they are loaded.

MAX sizes the KV cache from an estimate made before any weight is read:
device memory × ``--device-memory-utilization``, minus the weights, minus
activations. Its weight figure is the checkpoint files' size, so a server
that quantizes at load would reserve the bf16 bytes and hand the KV cache
none of what NVFP4 saves (at Gemma 4 31B geometry, ~20 of 30 GiB per 30
layers). Our architectures' memory planners subtract, per projection that
will be quantized, its checkpoint bytes minus its NVFP4 bytes, read from the
safetensors headers. The graph fold (``ATTNQUANT_PRECOMPUTE=1``) goes the
other way: it holds more than the checkpoint, and the estimate says so.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attnquant import nvfp4
from attnquant.checkpoint import tensor_shapes
from attnquant.config import AttnQuantConfig
from attnquant.projections import ProjectionKey, is_ignored

logger = logging.getLogger("max.pipelines.attnquant")


def _projection_sizes(model_dir: Path | str) -> Iterator[tuple[str, tuple[int, ...], int]]:
    """(module name, shape, checkpoint bytes) of each 2-D projection weight."""
    for name, (shape, element_bytes) in tensor_shapes(model_dir).items():
        key = ProjectionKey.parse(name)
        if key is not None and len(shape) == 2:
            yield key.module_name, shape, math.prod(shape) * element_bytes


def quantization_saving(model_dir: Path | str, config: AttnQuantConfig) -> int:
    """Bytes the served weights take less than the checkpoint's, from NVFP4.

    0 unless ``config.quant`` is nvfp4 (the GEMM and generated_linear paths,
    which also serve fewer bytes, are not counted: over-estimating the weights
    only leaves the KV cache smaller, as MAX's own estimate does).
    """
    if config.quant != "nvfp4":
        return 0
    saving = sum(
        nbytes - nvfp4.served_nbytes(*shape)
        for module, shape, nbytes in _projection_sizes(model_dir)
        if not is_ignored(module, config.quant_ignore)
    )
    return max(saving, 0)


def graph_fold_addition(model_dir: Path | str, config: AttnQuantConfig) -> int:
    """Bytes the graph fold holds beyond the checkpoint's: its theta weights.

    MAX folds ``s*W0 + U V^T`` once at load and keeps the dense result beside
    theta (``bench/graph_fold_cpu.py``). The W_eff is the checkpoint's size;
    theta is counted as the projections' checkpoint bytes once more: exact at
    passthrough (W0 is each layer's weight), above it with fewer bands (W0 is
    shared), so the KV cache is never planned into memory the weights use.
    """
    if config.precompute_outside or not config.precompute:
        return 0
    return sum(nbytes for _, _, nbytes in _projection_sizes(model_dir))


def served_weights_size(checkpoint_size: int, model_path: str | Path, config: AttnQuantConfig) -> int:
    """``checkpoint_size`` (MAX's estimate: the weight files' bytes) less what
    quantization saves, plus what the graph fold adds; unchanged when
    ``model_path`` is not a local checkpoint directory (nothing to read the
    headers from)."""
    if not Path(model_path).is_dir():
        return checkpoint_size
    served = (
        checkpoint_size - quantization_saving(model_path, config) + graph_fold_addition(model_path, config)
    )
    if served != checkpoint_size:
        _log_once(served, checkpoint_size, config.quant)
    return served


@functools.cache
def _log_once(served: int, checkpoint: int, quant: str) -> None:
    """MAX asks for the estimate more than once per load; say it once."""
    if served < checkpoint:
        why = f"{quant}; MAX gives the difference to the KV cache"
    else:
        why = "the graph fold keeps theta beside the W_eff MAX folds at load; the KV cache gets less"
    logger.info(
        "attnquant memory: weights %.2f GiB served, not the checkpoint's %.2f GiB (%s)",
        served / 2**30, checkpoint / 2**30, why,
    )  # fmt: skip


def with_served_weights_size(planner_cls: type[Any]) -> type[Any]:
    """``planner_cls`` (a MAX memory planner) with its weight estimate made
    the served size; everything else is MAX's."""

    class ServedWeightsPlanner(planner_cls):  # type: ignore[misc, valid-type]
        def estimate_weights_size(self, pipeline_config: Any) -> int:
            checkpoint_size = super().estimate_weights_size(pipeline_config)
            return served_weights_size(
                checkpoint_size, pipeline_config.model.model_path, AttnQuantConfig.from_env()
            )

    ServedWeightsPlanner.__name__ = ServedWeightsPlanner.__qualname__ = f"AttnQuant{planner_cls.__name__}"
    return ServedWeightsPlanner
