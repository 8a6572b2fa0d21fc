"""The load-time pipeline MAX architectures call once, before compiling.

checkpoint tensors -> (cache hit? load) -> theta -> W_eff -> NVFP4 ->
fused run-time layout. Logs one line saying which path it took, the NVFP4
coverage, the projection bytes before -> after and whether the cache hit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from max.driver import Device
from max.dtype import DType

from attnquant import kernels, matmul, prepare_device
from attnquant.cache import CacheKey, QuantizedWeightCache
from attnquant.checkpoint import checkpoint_identity
from attnquant.config import AttnQuantConfig
from attnquant.matmul import MIN_INNER_MULTIPLE
from attnquant.prepare_device import PrepareDevice
from attnquant.projections import find_projections
from attnquant.reconstruct import precompute_outside
from attnquant.reconstruction_path import (
    GENERATED_MLP,
    PathChoice,
    ReconstructionPath,
    choose_path,
)
from attnquant.runtime_layout import ProjectionPlan, part_name, to_runtime_layout
from attnquant.theta import band_size, build_theta


# A child of MAX's logger, so the line shows in `max serve`/`generate` output.
logger = logging.getLogger("max.pipelines.attnquant")
SUMMARY_PREFIX = "attnquant load:"

_TORCH_DTYPES = {
    DType.float32: torch.float32,
    DType.bfloat16: torch.bfloat16,
    DType.float16: torch.float16,
}


@dataclass(frozen=True)
class PreparedWeights:
    state_dict: dict[str, torch.Tensor]
    plan: ProjectionPlan
    summary: str
    cache_hit: bool


def torch_dtype(dtype: DType) -> torch.dtype:
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"attnquant serves float32, bfloat16 or float16 models, not {dtype}")
    return _TORCH_DTYPES[dtype]


def to_torch(value: Any) -> torch.Tensor:
    """A MAX ``WeightData`` (or any DLPack array) as a torch tensor, no copy."""
    return torch.from_dlpack(getattr(value, "data", value))


def check_config(config: AttnQuantConfig, num_layers: int, device_api: str = "cpu") -> PathChoice:
    """The serving path, or the errors that must surface before MAX spends
    minutes compiling."""
    band_size(num_layers, config.blocks or num_layers)
    return choose_path(config, device_api, residual=has_residual(config, num_layers))


def has_residual(config: AttnQuantConfig, num_layers: int) -> bool:
    """Whether theta has a low-rank residual (fewer bands than layers, R > 0)."""
    return (config.blocks or num_layers) < num_layers and config.rank > 0


def needs_precompute(config: AttnQuantConfig, num_layers: int) -> bool:
    """False when the served weights are the checkpoint's own (G = L, no quantization)."""
    return config.quant != "none" or (config.blocks or num_layers) < num_layers


def prepare_weights(
    state_dict: Mapping[str, Any],
    config: AttnQuantConfig,
    *,
    checkpoint_files: Sequence[Path],
    num_layers: int,
    dtype: DType,
    device: Device,
    graph_capture: bool | None = None,
) -> PreparedWeights:
    """The run-time state dict and projection plan for one model load.

    ``graph_capture``: whether MAX will replay decode steps from a captured
    device graph (``pipeline_config.runtime.device_graph_capture``); None
    when not known. Only used to warn about a slow combination.
    """
    choice = check_config(config, num_layers, str(device.api))
    matmul.set_row_padding(config.row_padding)  # read when MAX traces the graph
    tensors = {name: to_torch(value) for name, value in state_dict.items()}
    start = time.monotonic()
    if choice.path is ReconstructionPath.PRECOMPUTE_OUTSIDE:
        served, hit = _served_tensors(tensors, config, checkpoint_files, num_layers, device)
        runtime, plan = to_runtime_layout(served, fuse=config.qkv_fuse, dtype=torch_dtype(dtype))
        plan = lay_out_for_kernels(runtime, plan, dtype, device, gemv_only=config.nvfp4_dispatch == "gemv")
    else:
        served, hit = theta_tensors(tensors, config, num_layers), False
        # generated_linear is one dispatch per projection: nothing to fuse.
        generated = choice.path is ReconstructionPath.GENERATED
        runtime, plan = to_runtime_layout(
            served, fuse=config.qkv_fuse and not generated, dtype=torch_dtype(dtype),
            theta_factor_dtype=torch.float32 if generated else None,
            # The GEMM and fold paths multiply by U with MAX's matmul (K = rank).
            theta_rank_multiple=1 if generated else MIN_INNER_MULTIPLE,
        )  # fmt: skip
        plan = assign_reconstruction(plan, choice.path, fused_mlp=config.fused_mlp)
    summary = _summary(
        tensors, served, plan, config, num_layers, hit, time.monotonic() - start, choice
    )
    logger.info(summary)
    if config.quant == "nvfp4":
        advice = kernels.capture_off_advice(config.nvfp4_dispatch, str(device.api), graph_capture)
        if advice:
            logger.warning(advice)
    return PreparedWeights(runtime, plan, summary, hit)


def theta_tensors(
    tensors: Mapping[str, torch.Tensor], config: AttnQuantConfig, num_layers: int
) -> dict[str, torch.Tensor]:
    """The checkpoint with each projection's ``weight`` replaced by its theta:
    ``w0`` (the band's shared block: the same tensor object in every layer of
    the band), ``scale`` and, with a residual, ``u``/``v``."""
    keys = find_projections(tensors)
    names = {key.weight_name for key in keys}
    logger.info("attnquant: building theta (%s)", config.describe())
    theta = build_theta(
        {key: tensors[key.weight_name] for key in keys},
        blocks=config.blocks, rank=config.rank, num_layers=num_layers, progress=True,
    )  # fmt: skip
    served = {name: t for name, t in tensors.items() if name not in names}
    for key in keys:
        layer = theta.layers[(key.family, key.layer)]
        module = key.module_name
        served[f"{module}.w0"] = theta.shared[layer.group]
        served[f"{module}.scale"] = layer.scale
        if layer.rank:
            served[f"{module}.u"], served[f"{module}.v"] = layer.u, layer.v
    return served


def assign_reconstruction(
    plan: ProjectionPlan, path: ReconstructionPath, *, fused_mlp: bool
) -> ProjectionPlan:
    """Records the in-graph path on every theta part (``generated-mlp`` marks
    MLP parts that one fused ``generated_mlp`` dispatch serves)."""
    fuse_mlp = path is ReconstructionPath.GENERATED and fused_mlp
    assigned: ProjectionPlan = {}
    for group, parts in plan.items():
        is_mlp = group.endswith(("mlp.gate_up_proj", "mlp.down_proj"))
        value = GENERATED_MLP if fuse_mlp and is_mlp else path.value
        assigned[group] = tuple(
            dataclasses.replace(p, reconstruction=value) if p.kind == "theta" else p for p in parts
        )
    return assigned


def lay_out_for_kernels(
    state_dict: dict[str, torch.Tensor],
    plan: ProjectionPlan,
    dtype: DType,
    device: Device,
    *,
    gemv_only: bool = False,
) -> ProjectionPlan:
    """Chooses each NVFP4 part's kernel and re-lays its bytes out for it, once.

    The chooser logs its choice and reason; a kernel that reads the ModelOpt
    layout leaves the bytes as they are.
    """
    laid_out: ProjectionPlan = {}
    for group, parts in plan.items():
        new_parts = []
        for i, part in enumerate(parts):
            if part.kind == "nvfp4":
                config = kernels.NVFP4LinearConfig.for_device(
                    part.out_dim, part.in_dim, dtype, device, gemv_only=gemv_only
                )
                kernel = kernels.choose_kernel(config)
                name = part_name(group, i, len(parts))
                packed, scales = kernel.prepare_weights(
                    state_dict[f"{name}.weight"], state_dict[f"{name}.weight_scale"]
                )
                state_dict[f"{name}.weight"], state_dict[f"{name}.weight_scale"] = packed, scales
                part = dataclasses.replace(part, layout=kernel.layout.value, gemv_only=gemv_only)
            new_parts.append(part)
        laid_out[group] = tuple(new_parts)
    return laid_out


def _served_tensors(
    tensors: dict[str, torch.Tensor],
    config: AttnQuantConfig,
    checkpoint_files: Sequence[Path],
    num_layers: int,
    device: Device,
) -> tuple[dict[str, torch.Tensor], bool]:
    if not needs_precompute(config, num_layers):
        return tensors, False
    projection_names = {key.weight_name for key in find_projections(tensors)}
    others = {k: v for k, v in tensors.items() if k not in projection_names}
    projections = {k: v for k, v in tensors.items() if k in projection_names}

    def build() -> dict[str, torch.Tensor]:
        logger.info("attnquant: computing served weights (%s)", config.describe())
        # Chosen only when there is work: a cache hit never touches torch's GPU.
        prepare = prepare_device.choose(config.prepare_device, str(device.api), device.id)
        return _precompute_on(prepare, projections, config)

    if not config.cache:
        return {**others, **build()}, False
    model_dir = Path(checkpoint_files[0]).parent
    # Architectures name the same checkpoint's tensors differently (Gemma 4's
    # MTP target vs its plain path): the names are part of what is cached.
    names = hashlib.sha256("\n".join(sorted(projections)).encode()).hexdigest()[:16]
    key = CacheKey.for_model(f"{checkpoint_identity(model_dir)}:{names}", config)
    cached, hit = QuantizedWeightCache(config.cache_dir).load_or_build(key, build)
    return {**others, **cached}, hit


def _precompute_on(
    prepare: PrepareDevice, projections: dict[str, torch.Tensor], config: AttnQuantConfig
) -> dict[str, torch.Tensor]:
    """precompute_outside on the chosen device; with ``auto``, a GPU failure
    (out of memory beside other servers, a driver error) falls back to the CPU."""
    logger.info("attnquant: preparing weights on %s: %s", prepare.device, prepare.reason)
    try:
        return precompute_outside(projections, config, device=prepare.device).state_dict
    except RuntimeError as error:  # torch's CUDA errors, out of memory included
        if not prepare.is_gpu or config.prepare_device == "gpu":
            raise
        logger.warning(
            "attnquant: preparing weights on %s failed (%s); preparing them on the CPU instead "
            "(ATTNQUANT_PREPARE_DEVICE=cpu skips the attempt)", prepare.device, str(error).splitlines()[0],
        )  # fmt: skip
    finally:
        prepare_device.release(prepare)
    return precompute_outside(projections, config).state_dict


def _summary(
    before: Mapping[str, torch.Tensor],
    served: Mapping[str, torch.Tensor],
    plan: ProjectionPlan,
    config: AttnQuantConfig,
    num_layers: int,
    hit: bool,
    seconds: float,
    choice: PathChoice,
) -> str:
    """One line: path and why, theta, NVFP4 coverage, projection bytes, the
    weight bytes a decode step reads, cache.

    Bytes are counted as prepared, before the cast to the model dtype (so a
    float32 CPU run reports checkpoint-dtype bytes); a tensor aliased by
    several layers (a band's shared W0) counts once. "Per decode token" is
    every served tensor once: at batch 1 each step reads every weight (the
    tied embedding once, as the LM head); the KV cache is not counted.

    The graph fold is the exception: MAX evaluates its weight-only ``s*W0 +
    U V^T`` once at load and keeps the result beside theta
    (``bench/graph_fold_cpu.py``), so it holds theta plus a dense W_eff and
    each step reads the dense W_eff."""
    keys = find_projections(before)
    modules = {key.module_name for key in keys}
    bytes_before = sum(_nbytes(before[key.weight_name]) for key in keys)
    quantized = sum(len(p.members) for parts in plan.values() for p in parts if p.kind == "nvfp4")
    bytes_after = _unique_nbytes(t for name, t in served.items() if name.rsplit(".", 1)[0] in modules)
    blocks = config.blocks or num_layers
    theta = "passthrough" if blocks == num_layers else f"R={config.rank}"
    source = "quantized-weight cache hit" if hit else f"prepared in {seconds:.1f}s"
    per_token = [_unique_nbytes(tensors.values()) / 2**30 for tensors in (before, served)]
    resident, folded = bytes_after, ""
    if choice.path is ReconstructionPath.GRAPH_FOLD:
        resident += bytes_before  # W_eff, in the checkpoint dtype as bytes_before counts it
        folded = f" + {bytes_before / 2**20:.1f} MiB W_eff folded by MAX at load"
        per_token[1] = per_token[0]
    return (
        f"{SUMMARY_PREFIX} path={choice} theta G={blocks}/{num_layers} ({theta}) "
        f"quant={config.quant}; NVFP4 {quantized}/{len(keys)} projections; projection "
        f"bytes {bytes_before / 2**20:.1f} MiB -> {bytes_after / 2**20:.1f} MiB{folded} "
        f"({bytes_before / max(resident, 1):.2f}x); weights per decode token "
        f"{per_token[0]:.2f} GiB -> {per_token[1]:.2f} GiB; {source}"
    )


def _unique_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensor objects (an aliased W0 counts once)."""
    return sum(_nbytes(t) for t in {id(t): t for t in tensors}.values())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
