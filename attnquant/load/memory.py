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
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from attnquant.formats import nvfp4
from attnquant.load.checkpoint import check_files, read_config, tensor_shapes
from attnquant.load.precompute import check_ignore_fragments
from attnquant.config import AttnQuantConfig, LOGGER_NAME
from attnquant.formats.names import ProjectionKey, is_ignored

logger = logging.getLogger(LOGGER_NAME)


def _projection_sizes(model_dir: Path | str) -> Iterator[tuple[str, tuple[int, ...], int]]:
    """(module name, shape, checkpoint bytes) of each 2-D projection weight the
    checkpoint stores in a float dtype (one it stores as NVFP4 is served as is)."""
    for name, (shape, element_bytes) in tensor_shapes(model_dir).items():
        key = ProjectionKey.parse(name)
        if key is not None and len(shape) == 2 and element_bytes > 1:
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


def head_addition(model_dir: Path | str, config: AttnQuantConfig) -> int:
    """Bytes an NVFP4 output head (``ATTNQUANT_LM_HEAD=nvfp4``) adds to the
    checkpoint's: its packed copy, less the checkpoint's own head weight when
    it has one (a tied embedding stays, for the token lookup). Negative: a saving."""
    if config.lm_head != "nvfp4":
        return 0
    shapes = tensor_shapes(model_dir)
    own = [(shape, size) for name, (shape, size) in shapes.items() if name.endswith("lm_head.weight")]
    embedding = [(shape, size) for name, (shape, size) in shapes.items() if name.endswith("embed_tokens.weight")]
    if not own and not embedding:
        return 0
    (shape, size), replaced = (own[0], True) if own else (embedding[0], False)
    return nvfp4.served_nbytes(*shape) - (math.prod(shape) * size if replaced else 0)


def graph_fold_addition(model_dir: Path | str, config: AttnQuantConfig) -> int:
    """Bytes the graph fold holds beyond the checkpoint's: its theta weights.

    MAX folds ``s*W0 + U V^T`` once at load and keeps the dense result beside
    theta (``bench/checks/graph_fold_cpu.py``). The W_eff is the checkpoint's size;
    theta is counted as the projections' checkpoint bytes once more: exact at
    passthrough (W0 is each layer's weight), above it with fewer bands (W0 is
    shared), so the KV cache is never planned into memory the weights use.
    """
    if config.precompute_outside or not config.precompute:
        return 0
    return sum(nbytes for _, _, nbytes in _projection_sizes(model_dir))


def served_weights_size(checkpoint_size: int, model_path: str | Path, config: AttnQuantConfig) -> int:
    """``checkpoint_size`` (MAX's estimate: the weight files' bytes) less what
    quantization saves, plus what an NVFP4 head and the graph fold add; unchanged when
    ``model_path`` is not a local checkpoint directory (nothing to read the
    headers from)."""
    if not Path(model_path).is_dir():
        return checkpoint_size
    served = (
        checkpoint_size
        - quantization_saving(model_path, config)
        + head_addition(model_path, config)
        + graph_fold_addition(model_path, config)
    )
    if served != checkpoint_size:
        _log_once(served, checkpoint_size)
    return served


@functools.cache
def _log_once(served: int, checkpoint: int) -> None:
    """MAX asks for the estimate more than once per load; say it once."""
    logger.info(
        "attnquant memory: weights %.2f GiB served, not the checkpoint's %.2f GiB; MAX sizes the KV cache "
        "with the served bytes", served / 2**30, checkpoint / 2**30,
    )  # fmt: skip


def check_quantization(model_path: str | Path) -> None:
    """A checkpoint stored quantized must be NVFP4 in NVIDIA's ModelOpt layout
    (what ``attnquant quantize`` and ``nvidia/*-NVFP4`` exports write).

    Raises:
        ValueError: naming the quantization the checkpoint declares.
    """
    config = read_config(model_path)
    declared = config.get("quantization_config")
    hf_quant = Path(model_path) / "hf_quant_config.json"
    if declared is None and hf_quant.is_file():
        declared = {"quant_method": "modelopt", **json.loads(hf_quant.read_text()).get("quantization", {})}
    if declared is None:
        return
    method, algo = str(declared.get("quant_method", "")).lower(), str(declared.get("quant_algo", "")).upper()
    if (method, algo) != ("modelopt", "NVFP4"):
        raise ValueError(
            f"{model_path} is quantized with {method or '?'}/{algo or '?'}; attnquant serves checkpoints stored "
            "in bf16 (quantized at load) or in ModelOpt NVFP4 (quant_method modelopt, quant_algo NVFP4)"
        )
    group = declared.get("group_size", nvfp4.BLOCK_SIZE)
    if group != nvfp4.BLOCK_SIZE:
        raise ValueError(f"{model_path}: NVFP4 group_size {group}; NVFP4 blocks are {nvfp4.BLOCK_SIZE} values")


def check_before_serving(model_path: str | Path, config: AttnQuantConfig) -> None:
    """What can be checked from a local checkpoint's headers before MAX starts
    a model worker: every safetensors file whole, every
    ``ATTNQUANT_QUANT_IGNORE`` fragment matching a projection.

    Raises:
        ValueError: naming the file or the fragment.
    """
    if not Path(model_path).is_dir():
        return
    check_quantization(model_path)
    check_files(Path(model_path).glob("*.safetensors"))
    keys = [key for name in tensor_shapes(model_path) if (key := ProjectionKey.parse(name)) is not None]
    check_ignore_fragments(config, keys)


def with_served_weights_size(planner_cls: type[Any]) -> type[Any]:
    """``planner_cls`` (a MAX memory planner) with its weight estimate made
    the served size; everything else is MAX's. MAX builds a planner from the
    architecture's config, which carries the load's ``attnquant`` settings."""

    class ServedWeightsPlanner(planner_cls):  # type: ignore[misc, valid-type]
        def estimate_weights_size(self, pipeline_config: Any) -> int:
            config: AttnQuantConfig = self._config.attnquant
            model_path = pipeline_config.model.model_path
            try:
                # In MAX's API server, before a worker maps a damaged file.
                check_before_serving(model_path, config)
            except ValueError as error:
                raise SystemExit(f"attnquant: error: {error}") from None
            checkpoint_size = super().estimate_weights_size(pipeline_config)
            return served_weights_size(checkpoint_size, model_path, config)

    ServedWeightsPlanner.__name__ = ServedWeightsPlanner.__qualname__ = f"AttnQuant{planner_cls.__name__}"
    return ServedWeightsPlanner
