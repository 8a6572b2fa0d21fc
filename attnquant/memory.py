"""How much device memory the served weights take, before they are loaded.

MAX sizes the KV cache from an estimate made before any weight is read:
device memory × ``--device-memory-utilization``, minus the weights, minus
activations. Its weight figure is the checkpoint files' size, so a server
that quantizes at load would reserve the bf16 bytes and hand the KV cache
none of what NVFP4 saves (at Gemma 4 31B geometry, ~20 of 30 GiB per 30
layers). Our architectures' memory planners subtract, per projection that
will be quantized, its checkpoint bytes minus its NVFP4 bytes, read from the
safetensors headers.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Any

from attnquant import nvfp4
from attnquant.checkpoint import tensor_shapes
from attnquant.config import AttnQuantConfig
from attnquant.projections import ProjectionKey, is_ignored

logger = logging.getLogger("max.pipelines.attnquant")


def quantization_saving(model_dir: Path | str, config: AttnQuantConfig) -> int:
    """Bytes the served weights take less than the checkpoint's, from NVFP4.

    0 unless ``config.quant`` is nvfp4 (the in-graph theta paths, which also
    serve fewer bytes, are not counted: over-estimating the weights only
    leaves the KV cache smaller, as MAX's own estimate does).
    """
    if config.quant != "nvfp4":
        return 0
    saving = 0
    for name, (shape, element_bytes) in tensor_shapes(model_dir).items():
        key = ProjectionKey.parse(name)
        if key is None or len(shape) != 2 or is_ignored(key.module_name, config.quant_ignore):
            continue
        saving += math.prod(shape) * element_bytes - nvfp4.served_nbytes(*shape)
    return max(saving, 0)


def served_weights_size(checkpoint_size: int, model_path: str | Path, config: AttnQuantConfig) -> int:
    """``checkpoint_size`` (MAX's estimate: the weight files' bytes) less what
    quantization saves; unchanged when ``model_path`` is not a local
    checkpoint directory (nothing to read the headers from)."""
    if not Path(model_path).is_dir():
        return checkpoint_size
    saving = quantization_saving(model_path, config)
    if saving:
        _log_once(checkpoint_size - saving, checkpoint_size)
    return checkpoint_size - saving


@functools.cache
def _log_once(served: int, checkpoint: int) -> None:
    """MAX asks for the estimate more than once per load; say it once."""
    logger.info(
        "attnquant memory: weights %.2f GiB served, not the checkpoint's %.2f GiB "
        "(NVFP4); MAX gives the difference to the KV cache",
        served / 2**30, checkpoint / 2**30,
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
