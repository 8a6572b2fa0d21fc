"""attnquant's configuration: the ATTNQUANT_* environment variables.

:data:`SETTINGS` is the single table of every variable (name, field, default,
allowed values, effect). Parsing, :meth:`AttnQuantConfig.describe`,
:meth:`AttnQuantConfig.weight_fingerprint` and the table in
``docs/configuration.md`` (see :func:`settings_markdown_table`) all read it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ENV_PREFIX = "ATTNQUANT_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError


def _parse_int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw.strip())  # ValueError for "2.5", "x"
        if value < minimum:
            raise ValueError
        return value

    return parse


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower()
        if value not in choices:
            raise ValueError
        return value

    return parse


def _parse_auto_or_bool(raw: str) -> bool | None:
    return None if raw.strip().lower() == "auto" else _parse_bool(raw)


def _parse_fragments(raw: str) -> tuple[str, ...]:
    """Comma list of dotted module-name fragments, deduplicated and sorted
    (order has no meaning, and a canonical form keeps cache keys stable)."""
    fragments = {part.strip() for part in raw.split(",") if part.strip()}
    if any(not all(fragment.split(".")) for fragment in fragments):
        raise ValueError  # "a..b", ".mlp", "mlp."
    return tuple(sorted(fragments))


def _parse_sm90_variant(raw: str) -> str:
    value = raw.strip()
    fields = value.split(":")
    if not 1 <= len(fields) <= 4 or not all(f.lstrip("-").isdigit() for f in fields):
        raise ValueError
    return value


def _parse_positive_float(raw: str) -> float:
    value = float(raw.strip())
    if not math.isfinite(value) or value <= 0:
        raise ValueError
    return value


def _parse_log_level(raw: str) -> str:
    return _parse_choice("debug", "info", "warning", "error")(raw).upper()


def _default_cache_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "attnquant"


@dataclass(frozen=True)
class Setting:
    """One environment variable: how to read it and what it does."""

    env: str
    field: str
    parse: Callable[[str], Any]
    default: Callable[[Mapping[str, str]], Any]
    default_text: str
    allowed: str
    effect: str
    changes_weights: bool = False
    choices: tuple[str, ...] = ()
    """The values a choice setting takes (empty for other settings)."""


def _choice(
    env: str, field: str, choices: tuple[str, ...], default: str, effect: str, *, changes_weights: bool = False
) -> Setting:
    """A setting that takes one of ``choices``; its parser and allowed-values
    text come from the one tuple."""
    return Setting(
        env, field, _parse_choice(*choices), _constant(default), default, ", ".join(choices), effect,
        changes_weights=changes_weights, choices=choices,
    )  # fmt: skip


def _constant(value: Any) -> Callable[[Mapping[str, str]], Any]:
    return lambda env: value


_BOOL = "1/0, true/false, yes/no, on/off"

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "ATTNQUANT_BLOCKS", "blocks", _parse_int_at_least(1), _constant(None),
        "layer count", "integer >= 1 dividing the layer count",
        "G: bands of contiguous layers sharing one W0 per projection family. "
        "The layer count is passthrough (every weight exact).",
        changes_weights=True,
    ),
    Setting(
        "ATTNQUANT_RANK", "rank", _parse_int_at_least(0), _constant(16),
        "16", "integer >= 0",
        "R: rank of each layer's residual U·Vᵀ (unused when passthrough).",
        changes_weights=True,
    ),
    Setting(
        "ATTNQUANT_PRECOMPUTE_OUTSIDE", "precompute_outside", _parse_bool, _constant(True),
        "1", _BOOL,
        "Build W_eff on the host at load time and serve plain (or NVFP4) weights. "
        "0: serve theta and rebuild in the graph (GEMM formulation or generated_linear, "
        "see ATTNQUANT_GEMM); needs ATTNQUANT_QUANT=none.",
        changes_weights=True,
    ),
    Setting(
        "ATTNQUANT_PRECOMPUTE", "precompute", _parse_bool, _constant(False),
        "0", _BOOL,
        "With PRECOMPUTE_OUTSIDE=0: build W_eff = s*W0 + U*V^T inside the graph, then one "
        "matmul; MAX folds it once at load, so each step reads W_eff "
        "(refused with PRECOMPUTE_OUTSIDE=1).",
    ),
    _choice(
        "ATTNQUANT_QUANT", "quant", ("none", "nvfp4"), "none",
        "nvfp4: quantize every projection (not in QUANT_IGNORE) to NVFP4 at load time.",
        changes_weights=True,
    ),
    Setting(
        "ATTNQUANT_QUANT_IGNORE", "quant_ignore", _parse_fragments, _constant(()),
        "(empty)", "comma list of dotted module-name fragments",
        "Projections left unquantized: a fragment matches whole name components, "
        "e.g. self_attn, mlp, o_proj, layers.0.",
        changes_weights=True,
    ),
    _choice(
        "ATTNQUANT_LM_HEAD", "lm_head", ("bf16", "nvfp4"), "bf16",
        "The output head (the tied embedding, or the checkpoint's own lm_head): bf16 = "
        "the model dtype; nvfp4 = a packed NVFP4 copy read by the NVFP4 kernels (the "
        "embedding stays for the token lookup), cached like the projections.",
        changes_weights=True,
    ),
    _choice(
        "ATTNQUANT_SCALE_SEARCH", "scale_search", ("weighted", "rtn", "mse"), "weighted",
        "NVFP4 block scales: weighted tries RTN's and 8 other E4M3 scales per block and keeps "
        "the least error weighted by each input column's importance, estimated from the "
        "checkpoint (no calibration data; docs/quality.md prices it); rtn is MAX's reference "
        "rounding; mse tries 5 scales and keeps the least plain squared error.",
        changes_weights=True,
    ),
    _choice(
        "ATTNQUANT_PREPARE_DEVICE", "prepare_device", ("auto", "cpu", "gpu"), "auto",
        "Where load-time W_eff and NVFP4 quantization run: auto = the serving GPU when "
        "torch can use it (a CUDA or ROCm build), else the CPU; gpu = that GPU or an "
        "error. Same weights either way (the same bits); the default scale search "
        "quantizes ~6 GB/s of bf16 weights on an H200, ~70 MB/s on a 2-core host "
        "(docs/performance.md).",
    ),
    _choice(
        "ATTNQUANT_NVFP4_DISPATCH", "nvfp4_dispatch", ("auto", "gemv"), "auto",
        "NVFP4 projections on a GPU: auto = the GEMV kernel up to 16 tokens, dequantize + "
        "MAX matmul above, chosen each step by a branch per projection; gemv = the GEMV "
        "kernel at every token count (no branch; prefill re-reads the weights every 16 tokens).",
    ),
    Setting(
        "ATTNQUANT_SM90_VARIANT", "sm90_variant", _parse_sm90_variant, _constant(""),
        "(measured)", "variant[:kw[:splitk[:pdl]]] integers",
        "Developer override of the sm90 NVFP4 GEMV kernel for every layer at every token count "
        "(empty: the kernels measured fastest for each shape, one up to 8 tokens and one above, "
        "docs/dev/kernels.md; -1: the original kernels everywhere); layers it cannot run on keep "
        "the original kernel, and the log says why.",
    ),
    Setting(
        "ATTNQUANT_SM100_INPUT_SCALE", "sm100_input_scale", _parse_positive_float, _constant(1.0),
        "1.0", "a number > 0",
        "Blackwell (max-sm100 backend, W4A4): the static per-tensor scale activations are "
        "quantized with (x / scale). Compile-checked only; no Blackwell GPU has run it.",
    ),
    Setting(
        "ATTNQUANT_ROW_PADDING", "row_padding", _parse_auto_or_bool, _constant(None),
        "auto", f"auto, {_BOOL}",
        "Pad the token rows of our MAX matmuls to a multiple of 64 (1 row stays 1): "
        "auto = bf16 on sm_90 GPUs, where MAX 26.7's matmul writes a partial 64-row tile "
        "past its output (modular/modular#6883); 1 = on every device; 0 = never (a MAX "
        "with the fix). With captured decode steps one row skips the padding entirely.",
    ),
    Setting(
        "ATTNQUANT_GEMM", "gemm", _parse_auto_or_bool, _constant(None),
        "auto", f"auto, {_BOOL}",
        "In-graph reconstruction path: 1 = GEMM formulation (stock MAX matmuls), "
        "0 = generated_linear Mojo op (rank <= 64); auto: generated_linear on Metal, "
        "GEMM otherwise (faster on the H200, docs/performance.md). Logged once at load "
        "with the reason.",
    ),
    Setting(
        "ATTNQUANT_QKV_FUSE", "qkv_fuse", _parse_bool, _constant(True),
        "1", _BOOL,
        "Fuse the q, k and v projections (and gate/up) into one matmul each.",
    ),
    Setting(
        "ATTNQUANT_FUSED_MLP", "fused_mlp", _parse_bool, _constant(True),
        "1", _BOOL,
        "On the generated_linear path: gate, up, the activation and down as one "
        "generated_mlp dispatch.",
    ),
    Setting(
        "ATTNQUANT_GATED_GEMV", "gated_gemv", _parse_auto_or_bool, _constant(None),
        "auto", f"auto, {_BOOL}",
        "NVFP4 on Hopper: the fused gate/up GEMV applies gelu_tanh(gate) * up in its "
        "epilogue (per layer one kernel and the gate/up output's round trip fewer, M<=16). "
        "auto = on for gate/up weights of >= 100 MiB packed (the shape Gemma 3 27B and "
        "Gemma 4 31B share), measured faster end to end at the 31B geometry and not at 1B "
        "(docs/performance.md); 1 = every "
        "gate/up the kernel can take; 0 = never (the activation runs as MAX ops after the "
        "GEMV). The log says which and why.",
    ),
    Setting(
        "ATTNQUANT_NORM_KERNEL", "norm_kernel", _parse_auto_or_bool, _constant(None),
        "auto", f"auto, {_BOOL}",
        "On an NVIDIA GPU, each decoder layer's two 'norm, add to the residual, next norm' "
        "steps run as attnquant's kernel (attnquant.residual_rms_norm: one block a row, "
        "every load before the first reduction) instead of MAX's fused norm. auto = the "
        "kernel wherever it can take the hidden size (a multiple of 8, at most 8192); "
        "0 = MAX's ops. The log says which and why.",
    ),
    Setting(
        "ATTNQUANT_PDL", "pdl", _parse_bool, _constant(False),
        "0", _BOOL,
        "On NVIDIA sm_90+: attnquant's GEMVs (the register and bulk-ring kernels, which run "
        "every step of up to 8 token rows) and residual norm kernel "
        "launch with programmatic dependent launch, so each may start while the one before it "
        "finishes (the launch overlaps the earlier kernel's last wave; each still waits for "
        "its input). Same outputs either way; off by default because the measured gain is small "
        "(docs/performance.md). The log says which layers take it.",
    ),
    _choice(
        "ATTNQUANT_LAYER_SUBGRAPHS", "layer_subgraphs", ("always", "cpu"), "always",
        "Decoder layers of one structure compiled once, as a MAX subgraph every such layer "
        "calls (compile ~2x faster at 26 layers, decode as fast; docs/performance.md): "
        "always = on every device; cpu = on a CPU only, every layer inlined on a GPU. "
        "MAX's --no-use-subgraphs inlines every layer either way.",
    ),
    Setting(
        "ATTNQUANT_CACHE", "cache", _parse_bool, _constant(True),
        "1", _BOOL,
        "Keep quantized weights in an on-disk cache so the next load skips quantization.",
    ),
    Setting(
        "ATTNQUANT_CACHE_DIR", "cache_dir", lambda raw: Path(raw.strip()).expanduser(),
        _default_cache_dir,
        "${XDG_CACHE_HOME:-~/.cache}/attnquant", "a writable directory path",
        "Where the quantized-weight cache lives.",
    ),
    Setting(
        "ATTNQUANT_LOG_LEVEL", "log_level", _parse_log_level, _constant("INFO"),
        "INFO", "DEBUG, INFO, WARNING, ERROR",
        "Level of attnquant's log lines.",
    ),
    Setting(
        "ATTNQUANT_DEMO_MODEL_DIR", "demo_model_dir", lambda raw: Path(raw.strip()).expanduser(),
        _constant(None), "${XDG_CACHE_HOME:-~/.cache}/attnquant/models/gemma3-270m",
        "a writable directory path",
        "Where the embedded Gemma 3 270M is built (attnquant demo-model, run_max.py's default model).",
    ),
    Setting(
        "ATTNQUANT_IGNORE_UNKNOWN", "ignore_unknown", _parse_bool, _constant(False),
        "0", _BOOL,
        "1: an ATTNQUANT_* name that is not a setting is a warning, not an error (for "
        "environments shared by several attnquant versions).",
    ),
)  # fmt: skip

REMOVED: dict[str, str] = {
    "ATTNQUANT_GEMMA4_GRAPH_CAPTURE": (
        "was removed: attnquant's Gemma 4 always declares device graph capture; pass "
        "--no-device-graph-capture to MAX to turn capture off"
    ),
    "ATTNQUANT_MTP_ON_GPU": (
        "was removed: Gemma 4 with an MTP drafter is served on GPUs without it "
        "(docs/quickstart.md, Speculative decoding); unset it"
    ),
}
"""Settings that no longer exist, with what to do instead."""

_SETTING_BY_ENV = {setting.env: setting for setting in SETTINGS}


def choices_of(env: str) -> tuple[str, ...]:
    """The values the choice setting ``env`` takes (for flags that stand for it)."""
    return _SETTING_BY_ENV[env].choices


@dataclass(frozen=True)
class AttnQuantConfig:
    """Every attnquant setting; see :data:`SETTINGS` for each one's meaning."""

    blocks: int | None = None
    rank: int = 16
    precompute_outside: bool = True
    precompute: bool = False
    quant: Literal["none", "nvfp4"] = "none"
    quant_ignore: tuple[str, ...] = ()
    lm_head: Literal["bf16", "nvfp4"] = "bf16"
    scale_search: Literal["weighted", "rtn", "mse"] = "weighted"
    prepare_device: Literal["auto", "cpu", "gpu"] = "auto"
    nvfp4_dispatch: Literal["auto", "gemv"] = "auto"
    sm90_variant: str = ""
    sm100_input_scale: float = 1.0
    row_padding: bool | None = None
    gemm: bool | None = None
    qkv_fuse: bool = True
    fused_mlp: bool = True
    gated_gemv: bool | None = None
    norm_kernel: bool | None = None
    pdl: bool = False
    layer_subgraphs: Literal["always", "cpu"] = "always"
    cache: bool = True
    cache_dir: Path = dataclasses.field(default_factory=lambda: _default_cache_dir(os.environ))
    log_level: str = "INFO"
    demo_model_dir: Path | None = None
    ignore_unknown: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> AttnQuantConfig:
        """Reads every ATTNQUANT_* variable; unset or empty means the default.

        Raises:
            ValueError: one error listing every invalid variable, its value
                and what it allows, and every ATTNQUANT_* name that is not a
                setting with the closest valid name (a warning instead with
                ATTNQUANT_IGNORE_UNKNOWN=1).
        """
        values: dict[str, Any] = {}
        problems: list[str] = []
        for setting in SETTINGS:
            raw = env.get(setting.env, "")
            if not raw.strip():
                values[setting.field] = setting.default(env)
                continue
            try:
                values[setting.field] = setting.parse(raw)
            except ValueError:
                problems.append(f"{setting.env}={raw!r} is invalid; allowed: {setting.allowed}")
        unknown = _unknown_names(env)
        if unknown and values.get("ignore_unknown"):
            for problem in unknown:
                warnings.warn(f"attnquant: {problem} (ignored: ATTNQUANT_IGNORE_UNKNOWN=1)", UserWarning, stacklevel=2)
        else:
            problems += unknown
        if problems:
            raise ValueError("invalid attnquant configuration: " + "; ".join(problems))
        return cls(**values)

    def weight_fingerprint(self) -> dict[str, Any]:
        """The settings that change the produced weights (cache-key material)."""
        return {
            setting.field: _json_value(getattr(self, setting.field))
            for setting in SETTINGS
            if setting.changes_weights
        }

    def describe(self, *, weights_only: bool = False) -> str:
        """The settings for logs, e.g. ``blocks=layers rank=16 ...`` (only
        those that change the served weights with ``weights_only``)."""
        return " ".join(
            f"{setting.field}={_display(setting, getattr(self, setting.field))}"
            for setting in SETTINGS
            if setting.changes_weights or not weights_only
        )

    def apply_log_level(self) -> None:
        """Sets attnquant's loggers (children of MAX's) to ``log_level``."""
        logging.getLogger(LOGGER_NAME).setLevel(self.log_level)


LOGGER_NAME = "max.pipelines.attnquant"
"""attnquant's logger: a child of MAX's, so its lines show in ``max serve`` output."""


def _unknown_names(env: Mapping[str, str]) -> list[str]:
    problems = []
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in _SETTING_BY_ENV:
            continue
        if name in REMOVED:
            problems.append(f"{name} {REMOVED[name]}")
            continue
        close = difflib.get_close_matches(name, _SETTING_BY_ENV, n=1, cutoff=0.0)
        problems.append(f"{name} is not an attnquant setting" + (f"; did you mean {close[0]}?" if close else ""))
    return problems


def _json_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _display(setting: Setting, value: Any) -> str:
    if value is None:
        return "layers" if setting.field == "blocks" else "auto"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, tuple):
        return ",".join(value) or "-"
    return str(value) or "-"


def settings_markdown_table() -> str:
    """The table docs/configuration.md carries (a test keeps them equal)."""
    lines = [
        "| Variable | Default | Allowed | Effect |",
        "| --- | --- | --- | --- |",
        *(f"| `{s.env}` | `{s.default_text}` | {s.allowed} | {s.effect} |" for s in SETTINGS),
    ]
    return "\n".join(lines) + "\n"


# The table and the dataclass must describe the same fields, in the same order.
assert [s.field for s in SETTINGS] == [f.name for f in dataclasses.fields(AttnQuantConfig)]
