"""The load-time pipeline MAX architectures call once, before compiling.

checkpoint tensors -> (cache hit? load) -> theta -> W_eff -> NVFP4 ->
fused run-time layout, and one line (:class:`LoadReport`) saying which path
it took, the NVFP4 coverage, the bytes before -> after and whether the cache
hit. The result is device-independent (ModelOpt-layout NVFP4); the
architecture then converts it for its device (``attnquant.graph.runtime``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from max.dtype import DType

from attnquant.config import AttnQuantConfig, LOGGER_NAME
from attnquant.formats import nvfp4
from attnquant.formats.names import ProjectionKey, find_projections
from attnquant.formats.theta import band_size, build_theta
from attnquant.load import prepare_device
from attnquant.load.cache import CacheEntry, CacheKey, QuantizedWeightCache
from attnquant.load.checkpoint import checkpoint_identity
from attnquant.load.fuse import to_runtime_layout
from attnquant.load.head import OutputHead
from attnquant.load.importance import ResidualStream, for_quantization
from attnquant.load.path import PathChoice, choose_path
from attnquant.load.precompute import PrecomputeResult, check_ignore_fragments, precompute_outside, quantized_tensors
from attnquant.load.report import LoadReport
from attnquant.max_compat import MIN_INNER_MULTIPLE
from attnquant.plan import GENERATED_MLP, ProjectionPlan, ReconstructionPath

logger = logging.getLogger(LOGGER_NAME)

_TORCH_DTYPES = {
    DType.float32: torch.float32,
    DType.bfloat16: torch.bfloat16,
    DType.float16: torch.float16,
}


@dataclass(frozen=True)
class PreparedWeights:
    state_dict: dict[str, torch.Tensor]
    plan: ProjectionPlan
    report: LoadReport
    cache_hit: bool


@dataclass(frozen=True)
class _Served:
    """The projections' served tensors and what a report needs of them."""

    tensors: dict[str, torch.Tensor]
    quantized: int
    layer_errors: dict[int, float]
    hit: bool = False


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


def needs_precompute(config: AttnQuantConfig, num_layers: int, head: OutputHead | None = None) -> bool:
    """False when the served weights are the checkpoint's own (G = L, no quantization)."""
    quantized_head = head is not None and config.lm_head == "nvfp4"
    return config.quant != "none" or (config.blocks or num_layers) < num_layers or quantized_head


def prepare_weights(
    state_dict: Mapping[str, Any],
    config: AttnQuantConfig,
    *,
    checkpoint_files: Sequence[Path],
    num_layers: int,
    dtype: DType,
    device_api: str,
    device_id: int = 0,
    head: OutputHead | None = None,
    stream: ResidualStream | None = None,
) -> PreparedWeights:
    """The run-time state dict and projection plan for one model load, on a
    MAX device of ``device_api`` (``"cpu"``, ``"cuda"``, ...) with index
    ``device_id`` (where preparation may run). ``head``: where the model's
    output head is, when the architecture computes it through attnquant (its
    plan entry is ``head.group``). ``stream``: the architecture's residual
    stream, for the weighted scale search's importance estimate."""
    choice = check_config(config, num_layers, device_api)
    tensors = {name: to_torch(value) for name, value in state_dict.items()}
    keys = find_projections(tensors)
    check_ignore_fragments(config, keys)
    stored = stored_nvfp4(tensors, keys)
    if stored:
        check_stored_nvfp4_servable(config, num_layers, choice)
    float_keys = [key for key in keys if key not in stored]
    start = time.monotonic()
    # NVFP4 the checkpoint stores is served as stored: its tensors pass through.
    prepared = {key.weight_name for key in float_keys} | ({head.weight_name} if head else set())
    others = {name: t for name, t in tensors.items() if name not in prepared}
    singles = (head.group,) if head else ()
    if choice.path is ReconstructionPath.PRECOMPUTE_OUTSIDE:
        served = _precomputed(
            tensors, float_keys, config, checkpoint_files, num_layers, device_api, device_id, head, stream
        )
        runtime, plan = to_runtime_layout(
            {**others, **served.tensors}, fuse=config.qkv_fuse, dtype=torch_dtype(dtype), singles=singles
        )
    else:
        head_tensors = {head.weight_name: head.source(tensors)} if head else {}
        served = _Served({**theta_tensors(tensors, keys, config, num_layers), **head_tensors}, 0, {})
        # generated_linear is one dispatch per projection: nothing to fuse.
        generated = choice.path is ReconstructionPath.GENERATED
        runtime, plan = to_runtime_layout(
            {**others, **served.tensors}, fuse=config.qkv_fuse and not generated, dtype=torch_dtype(dtype),
            theta_factor_dtype=torch.float32 if generated else None,
            # The GEMM and fold paths multiply by U with MAX's matmul (K = rank).
            theta_rank_multiple=1 if generated else MIN_INNER_MULTIPLE,
            singles=singles,
        )  # fmt: skip
        plan = assign_reconstruction(plan, choice.path, fused_mlp=config.fused_mlp)
    if head is not None and head.tied and config.lm_head != "nvfp4":
        plan[head.group] = tuple(dataclasses.replace(p, shared_with=head.embedding) for p in plan[head.group])
    source = "quantized-weight cache hit" if served.hit else f"prepared in {time.monotonic() - start:.1f}s"
    if not needs_precompute(config, num_layers, head):
        source = "checkpoint weights"
    report = LoadReport.measure(
        before=tensors, served={**others, **served.tensors}, keys=keys, quantized=served.quantized + len(stored),
        path=str(choice), blocks=config.blocks or num_layers, num_layers=num_layers, rank=config.rank,
        quant=config.quant, source=source, layer_errors=served.layer_errors,
        folded=choice.path is ReconstructionPath.GRAPH_FOLD,
        lookup_only=(head.embedding,) if head and not (head.tied and config.lm_head == "bf16") else (),
        head=f"lm_head={config.lm_head}" if head else "", stored=stored,
    )  # fmt: skip
    logger.info(report.line())
    if (warning := report.theta_warning()) is not None:
        logger.warning(warning)
    return PreparedWeights(runtime, plan, report, served.hit)


def stored_nvfp4(tensors: Mapping[str, torch.Tensor], keys: Sequence[ProjectionKey]) -> set[ProjectionKey]:
    """The projections a (ModelOpt) checkpoint stores as NVFP4 already, each
    checked: packed uint8 codes, E4M3 block scales one per 16 inputs, one
    positive finite global scale.

    Raises:
        ValueError: naming the tensor that does not fit.
    """
    stored = set()
    for key in keys:
        module = key.module_name
        if f"{module}.weight_scale" not in tensors:
            continue
        packed, scales = tensors[key.weight_name], tensors[f"{module}.weight_scale"]
        global_scale = tensors.get(f"{module}.weight_scale_2")
        problem = _stored_nvfp4_problem(packed, scales, global_scale)
        if problem:
            raise ValueError(f"{module}: {problem}; this is not an NVFP4 (ModelOpt) projection attnquant can serve")
        stored.add(key)
    return stored


def _stored_nvfp4_problem(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None) -> str | None:
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        return f"weight is {packed.dtype} {list(packed.shape)}, not packed uint8 codes [N, K/2]"
    n, k = packed.shape[0], 2 * packed.shape[1]
    if k % nvfp4.BLOCK_SIZE:
        return f"K = {k} is not a multiple of {nvfp4.BLOCK_SIZE}"
    expected = [n, k // nvfp4.BLOCK_SIZE]
    if scales.dtype not in (torch.float8_e4m3fn, torch.uint8) or list(scales.shape) != expected:
        return f"weight_scale is {scales.dtype} {list(scales.shape)}, not E4M3 {expected} (one scale per 16 inputs)"
    bits = scales.view(torch.uint8)
    if bool((bits & 0x80).any()) or bool(((bits & 0x7F) == 0x7F).any()):
        return "weight_scale holds negative or NaN block scales"
    if global_scale is None or global_scale.numel() != 1 or not global_scale.is_floating_point():
        return "weight_scale_2 (the global scale) is missing or not one float"
    if not math.isfinite(float(global_scale.float().reshape(()))) or float(global_scale.float().reshape(())) <= 0:
        return f"weight_scale_2 = {float(global_scale.float().reshape(()))} is not a positive finite scale"
    return None


def check_stored_nvfp4_servable(config: AttnQuantConfig, num_layers: int, choice: PathChoice) -> None:
    """Theta needs every projection's float weights: refused for a checkpoint storing NVFP4."""
    if choice.path is not ReconstructionPath.PRECOMPUTE_OUTSIDE or (config.blocks or num_layers) < num_layers:
        raise ValueError(
            "this checkpoint stores NVFP4 projections, which attnquant serves as they are; theta "
            "(ATTNQUANT_BLOCKS below the layer count, ATTNQUANT_PRECOMPUTE_OUTSIDE=0) needs the float "
            "weights: unset those, or serve the unquantized checkpoint"
        )


def theta_tensors(
    tensors: Mapping[str, torch.Tensor], keys: Sequence[ProjectionKey], config: AttnQuantConfig, num_layers: int
) -> dict[str, torch.Tensor]:
    """Each projection's theta in place of its ``weight``: ``w0`` (the band's
    shared block: the same tensor object in every layer of the band),
    ``scale`` and, with a residual, ``u``/``v``."""
    logger.info("attnquant: building theta (%s)", config.describe())
    theta = build_theta(
        {key: tensors[key.weight_name] for key in keys},
        blocks=config.blocks, rank=config.rank, num_layers=num_layers, progress=True,
    )  # fmt: skip
    served: dict[str, torch.Tensor] = {}
    for key in keys:
        layer = theta.layers[(key.family, key.layer)]
        module = key.module_name
        served[f"{module}.w0"] = theta.shared[layer.group]
        served[f"{module}.scale"] = layer.scale
        if layer.rank:
            served[f"{module}.u"], served[f"{module}.v"] = layer.u, layer.v
    return served


def assign_reconstruction(plan: ProjectionPlan, path: ReconstructionPath, *, fused_mlp: bool) -> ProjectionPlan:
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


def _precomputed(
    tensors: dict[str, torch.Tensor],
    keys: Sequence[ProjectionKey],
    config: AttnQuantConfig,
    checkpoint_files: Sequence[Path],
    num_layers: int,
    device_api: str,
    device_id: int,
    head: OutputHead | None,
    stream: ResidualStream | None,
) -> _Served:
    """The projections' (and the head's) served tensors (W_eff, NVFP4), from
    the cache when it has them."""
    projections = {key.weight_name: tensors[key.weight_name] for key in keys}
    # A bf16 head is served as it is (a tied embedding's alias), outside the cache.
    as_is = {head.weight_name: head.source(tensors)} if head and config.lm_head != "nvfp4" else {}
    if head is not None and not as_is:
        # Quantized from its source, under its own name: the cache never holds the embedding.
        projections[head.weight_name] = head.source(tensors)
        head = dataclasses.replace(head, tied=False)
    if not needs_precompute(config, num_layers, head):
        return _Served({**projections, **as_is}, 0, {})
    if not keys:  # every projection is stored as NVFP4: at most a head to quantize
        packed = quantized_tensors(head.group, projections[head.weight_name], config) if head and not as_is else {}
        return _Served({**as_is, **packed}, 0, {})

    def build() -> CacheEntry:
        logger.info("attnquant: computing served weights (%s)", config.describe(weights_only=True))
        # Chosen only when there is work: a cache hit never touches torch's GPU.
        prepare = prepare_device.choose(config.prepare_device, device_api, device_id)
        importance = for_quantization(
            tensors, keys, config, stream, embedding=head.embedding if head else None,
            head=head.weight_name if head and not as_is else None,
        )  # fmt: skip
        result = _precompute_on(prepare, projections, keys, config, head, importance)
        info = {"quantized": len(result.quantized_modules), "layer_errors": result.layer_errors}
        return CacheEntry(result.state_dict, info)

    if not config.cache:
        entry, hit = build(), False
    else:
        model_dir = Path(checkpoint_files[0]).parent
        # Architectures name the same checkpoint's tensors differently (Gemma 4's
        # MTP target vs its plain path): the names are part of what is cached.
        names = hashlib.sha256("\n".join(sorted(projections)).encode()).hexdigest()[:16]
        identity = checkpoint_identity(model_dir, fingerprints=config.cache_dir / "fingerprints")
        key = CacheKey.for_model(f"{identity}:{names}", config)
        entry, hit = QuantizedWeightCache(config.cache_dir).load_or_build(key, build)
    check_finite(entry.tensors)
    errors = {int(layer): float(e) for layer, e in entry.info.get("layer_errors", {}).items()}
    return _Served({**entry.tensors, **as_is}, int(entry.info.get("quantized", 0)), errors, hit)


def check_finite(tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuses served tensors holding NaN or Inf, however they were obtained
    (built now, or read from the cache): floating tensors must be finite and
    E4M3 block scales must not be the NaN code.

    Raises:
        ValueError: naming the first such tensor.
    """
    for name, tensor in tensors.items():
        if tensor.dtype == torch.float8_e4m3fn:
            bad = bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any())
        elif tensor.is_floating_point():
            bad = not bool(torch.isfinite(tensor).all())
        else:
            continue
        if bad:
            raise ValueError(
                f"served tensor {name} contains NaN or Inf; fix the checkpoint, or leave this projection "
                "unquantized (ATTNQUANT_QUANT_IGNORE)"
            )


def _precompute_on(
    prepare: prepare_device.PrepareDevice,
    projections: dict[str, torch.Tensor],
    keys: Sequence[ProjectionKey],
    config: AttnQuantConfig,
    head: OutputHead | None,
    importance: Mapping[str, torch.Tensor],
) -> PrecomputeResult:
    """precompute_outside on the chosen device; with ``auto``, a GPU failure
    (out of memory beside other servers, a driver error) falls back to the CPU."""
    logger.info("attnquant: preparing weights on %s: %s", prepare.device, prepare.reason)
    try:
        return precompute_outside(
            projections, config, keys=keys, head=head, importance=importance, device=prepare.device
        )
    except RuntimeError as error:  # torch's CUDA errors, out of memory included
        if not prepare.is_gpu or config.prepare_device == "gpu":
            raise
        logger.warning(
            "attnquant: preparing weights on %s failed (%s); preparing them on the CPU instead "
            "(ATTNQUANT_PREPARE_DEVICE=cpu skips the attempt)", prepare.device, str(error).splitlines()[0],
        )  # fmt: skip
    finally:
        prepare_device.release(prepare)
    return precompute_outside(projections, config, keys=keys, head=head, importance=importance)
