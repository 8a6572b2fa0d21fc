"""Converting prepared weights for the serving device, once per load.

The load pipeline (``attnquant.load``) produces device-independent weights:
dense tensors, theta tensors and ModelOpt-layout NVFP4 (what the cache
holds). This step makes the run-time decisions that depend on the device and
records them in the plan, so the graph modules decide nothing again:

* each NVFP4 part's backend (``attnquant.graph.nvfp4.choose_backend``),
  with its bytes re-laid out for that backend's kernel;
* whether an NVFP4 gate|up applies the MLP's activation in its kernel's
  epilogue (``ATTNQUANT_GATED_GEMV``; its rows are then interleaved);
* how our MAX matmuls pad their token rows (``attnquant.max_compat.row_padding``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import MutableMapping

import torch
from max.driver import Device
from max.dtype import DType

from attnquant.config import AttnQuantConfig, LOGGER_NAME
from attnquant.formats.names import GATE_UP_MEMBERS
from attnquant.graph.nvfp4 import GEMV_MAX_M, NVFP4Backend, NVFP4LayerConfig, choose_backend
from attnquant.max_compat import SM90_ROW_TILE, RowPadding, device_arch, row_padding
from attnquant.plan import PartPlan, ProjectionPlan, part_name
from kernels import GELU_TANH_NAMES
from kernels.sm90_layout import interleave_gate_up

logger = logging.getLogger(LOGGER_NAME)


def for_device(
    state_dict: MutableMapping[str, torch.Tensor],
    plan: ProjectionPlan,
    config: AttnQuantConfig,
    *,
    dtype: DType,
    device: Device,
    graph_capture: bool | None,
    mlp_activation: str = "",
) -> ProjectionPlan:
    """The plan completed for ``device``; NVFP4 tensors in ``state_dict`` are
    replaced, in place, by their backend's layout.

    ``graph_capture``: whether MAX replays decode steps from a captured device
    graph (``pipeline_config.runtime.device_graph_capture``; None: unknown);
    ``mlp_activation``: the MLP's activation (Hugging Face spelling; empty:
    unknown, and no gate|up is gated).
    """
    api, arch = str(device.api), device_arch(device)
    padding = row_padding(config.row_padding, dtype, api, arch, graph_capture)
    _log_padding(padding, config.row_padding, arch or api)
    converted: ProjectionPlan = {}
    for group, parts in plan.items():
        converted[group] = tuple(
            _for_device(state_dict, part_name(group, i, len(parts)), part, config, dtype, api, arch, padding,
                        mlp_activation)
            for i, part in enumerate(parts)
        )
    if any(part.kind == "nvfp4" for parts in converted.values() for part in parts):
        advice = capture_off_advice(config.nvfp4_dispatch, api, graph_capture)
        if advice:
            logger.warning(advice)
    return converted


def _for_device(
    state_dict: MutableMapping[str, torch.Tensor],
    name: str,
    part: PartPlan,
    config: AttnQuantConfig,
    dtype: DType,
    api: str,
    arch: str,
    padding: RowPadding,
    mlp_activation: str,
) -> PartPlan:
    part = dataclasses.replace(part, row_padding=padding.value)
    if part.kind != "nvfp4":
        return part
    gemv_only = config.nvfp4_dispatch == "gemv"
    layer = NVFP4LayerConfig(
        part.out_dim, part.in_dim, dtype, api, arch, gemv_only=gemv_only, padding=padding,
        sm90_variant=config.sm90_variant, sm100_input_scale=config.sm100_input_scale, pdl=config.pdl,
    )  # fmt: skip
    backend = choose_backend(layer)
    packed, scales = state_dict[f"{name}.weight"], state_dict[f"{name}.weight_scale"]
    gated = False
    if part.members == GATE_UP_MEMBERS:
        gated, why = _gating(part, layer, backend, config, mlp_activation)
        _log_gating(layer.n, layer.k, gated, why)
        if gated:
            packed, scales = interleave_gate_up(packed), interleave_gate_up(scales)
    packed, scales = backend.prepare_weights(packed, scales)
    state_dict[f"{name}.weight"], state_dict[f"{name}.weight_scale"] = packed, scales
    params, _ = backend.kernel_parameters(layer)
    return dataclasses.replace(part, backend=backend.name, gemv_only=gemv_only, kernel_params=params, gated=gated)


def _gating(
    part: PartPlan, layer: NVFP4LayerConfig, backend: type[NVFP4Backend], config: AttnQuantConfig, activation: str
) -> tuple[bool, str]:
    """Whether this gate|up part applies the MLP's activation in its kernel, and why."""
    if config.gated_gemv is False:
        return False, "ATTNQUANT_GATED_GEMV=0"
    if activation not in GELU_TANH_NAMES:
        return False, f"the MLP's activation {activation or '(unknown)'!r} is not the kernels' {GELU_TANH_NAMES}"
    if part.per_row_scale:
        return False, "gate and up have different global scales (applied after the matmul)"
    ok, why = backend.gated_epilogue(dataclasses.replace(layer, gated=True))
    if ok and config.gated_gemv is None:
        return _gating_auto(layer, why)
    return ok, why


GATED_AUTO_MIN_MIB = 100
"""``ATTNQUANT_GATED_GEMV=auto`` gates a gate|up whose packed E2M1 weight is at
least this large. Measured end to end on the H200 with the gated epilogue:
faster at the Gemma 4 31B geometry's 43008x5376 (110 MiB; 0.05 ms per step in
each of 4 rounds), not at the 1B geometry's 13824x1152 (7.6 MiB; slower at one
request in 3 of 3 comparisons, within the host's noise). The sizes between
(4B: 25 MiB, 12B: 56 MiB) are unmeasured and keep the activation after the
GEMV, the path measured most."""


def _gating_auto(layer: NVFP4LayerConfig, why_possible: str) -> tuple[bool, str]:
    mib = layer.n * layer.k / 2 / 2**20
    if mib >= GATED_AUTO_MIN_MIB:
        return True, f"{why_possible}; auto: the weight is {mib:.1f} MiB >= {GATED_AUTO_MIN_MIB} MiB"
    return False, (
        f"auto: the weight is {mib:.1f} MiB < {GATED_AUTO_MIN_MIB} MiB, where the gated epilogue "
        "was not measured faster end to end; ATTNQUANT_GATED_GEMV=1 gates it"
    )


@functools.lru_cache(maxsize=None)
def _log_gating(n: int, k: int, gated: bool, why: str) -> None:
    how = "gated in the kernel" if gated else "activation after the matmul"
    logger.info("attnquant: NVFP4 gate|up [%d, %d]: %s (%s)", n, k, how, why)


def capture_off_advice(dispatch: str, device_api: str, graph_capture: bool | None) -> str | None:
    """A warning when NVFP4 projections on a GPU keep their per-projection
    token-count branch (``ATTNQUANT_NVFP4_DISPATCH=auto``) and the server runs
    without device graph capture: uncaptured, every branch is a host-side
    step. None when that cost does not apply (or capture is not known)."""
    if dispatch != "auto" or device_api == "cpu" or graph_capture is not False:
        return None
    return (
        "attnquant: NVFP4 on a GPU without device graph capture: each projection chooses "
        "GEMV or dequantize+matmul with a run-time branch, a host-side step that costs "
        "about 2.4 ms per decode step at Gemma 3 1B geometry on an H200 (docs/performance.md). "
        "Remove --no-device-graph-capture (MAX captures attnquant's architectures by default), "
        "or set ATTNQUANT_NVFP4_DISPATCH=gemv (no branch; prefill re-reads the weights every "
        f"{GEMV_MAX_M} tokens)."
    )


@functools.lru_cache(maxsize=None)
def _log_padding(padding: RowPadding, mode: bool | None, where: str) -> None:
    if padding is RowPadding.OFF:
        if mode is False and where.startswith("sm_90"):
            logger.warning(
                "attnquant: ATTNQUANT_ROW_PADDING=0 on %s: bf16 matmuls run unpadded, and MAX 26.7's "
                "sm_90 matmul then gives wrong outputs for 2-63 token rows (modular/modular#6883). "
                "Unset it unless your MAX has the fix.",
                where,
            )  # fmt: skip
        return
    why = "ATTNQUANT_ROW_PADDING=1" if mode else (
        f"MAX 26.7's sm_90 matmul writes a partial {SM90_ROW_TILE}-row tile past its output, "
        "modular/modular#6883"
    )  # fmt: skip
    how = "one row skips it (a branch, free in captured decode steps)" if padding is RowPadding.BRANCH else (
        "no branch, as decode steps are not captured"
    )  # fmt: skip
    logger.info(
        "attnquant: matmuls on %s: token rows padded to a multiple of %d (%s); %s", where, SM90_ROW_TILE, why, how
    )
