"""``mojo-sm90``: the tensor-core GEMV over weights re-laid out at load.

``mma.sync`` bf16 with float32 accumulation on NVIDIA sm_80+ (built for and
measured on sm_90: Hopper has no FP4 tensor cores, so the E2M1 codes are
decoded to bf16 in registers). M <= ``GEMV_MAX_M`` runs the GEMV; larger M
(prefill) dequantizes to bf16 once per call and uses MAX's matmul. The
kernels, their variants and their layout: docs/dev/kernels.md.

Which GEMV kernels a layer runs is chosen once, with the backend
(:meth:`MojoSM90Backend.kernel_parameters`): the kernels ``SM90_TUNED``
records as measured fastest for its shape (one for M <= 8, one above), or
``ATTNQUANT_SM90_VARIANT`` to force one at every M; otherwise, and wherever
the fast variants cannot run (below sm_90, shapes that are not whole 16 x 64
tiles), the original kernels, with the reason logged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from max.dtype import DType
from max.experimental.tensor import Tensor

from attnquant.graph.nvfp4.base import (
    GEMV_MAX_M,
    NVFP4Backend,
    NVFP4LayerConfig,
    WeightLayout,
    common_refusal,
    gemv_or_dequant_matmul,
)
from attnquant.graph.ops import pdl_refusal
from kernels.sm90_layout import TILE_K, TILE_N, prepare_weights


@dataclass(frozen=True)
class SM90Tuned:
    """One shape's GEMV kernels, measured on the H200 to be faster than the
    original ones over a whole range of token rows: ``(variant, kw)`` for
    M <= 8 (``narrow``) and for 8 < M <= 16 (``wide``); None keeps that
    range's original kernel (variant 0, resp. 1, with kw picked)."""

    narrow: tuple[int, int] | None = None
    wide: tuple[int, int] | None = None

    def kernels(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(variant, kw) for M <= 8 and for M > 8, the original kernels
        (kw 0: picked) where a range was not measured faster."""
        return self.narrow or (0, 0), self.wide or (1, 0)


SM90_TUNED: dict[tuple[int, int], SM90Tuned] = {
    # Gemma 3 270M: q|k|v, o, gate|up, down
    (1536, 640): SM90Tuned(wide=(0, 10)),
    (640, 1024): SM90Tuned(narrow=(4, 8), wide=(3, 8)),
    (4096, 640): SM90Tuned(wide=(2, 10)),
    (640, 2048): SM90Tuned(wide=(0, 16)),
    # Gemma 3 1B: q|k|v, o, down
    (1536, 1152): SM90Tuned(narrow=(0, 10), wide=(0, 8)),
    (1152, 1024): SM90Tuned(wide=(0, 8)),
    (1152, 6912): SM90Tuned(wide=(2, 16)),
    # Gemma 3 4B: q|k|v, o, gate|up
    (4096, 2560): SM90Tuned(wide=(2, 10)),
    (2560, 2048): SM90Tuned(wide=(2, 8)),
    (20480, 2560): SM90Tuned(narrow=(3, 2), wide=(5, 2)),
    # Gemma 3 12B and 27B: o
    (3840, 4096): SM90Tuned(wide=(2, 10)),
    (5376, 4096): SM90Tuned(wide=(2, 6)),
}
"""(N, K) -> the kernels measured fastest for that shape, per range of M: each
took at most 0.96x the original kernel's time at every M of its range in each
of two sweeps on the H200 (``bench/kernel_timing/kernels_h200.py --ranges``;
``bench/kernel_timing/range_choice.py`` prints this table from the stored
sweeps; figures in docs/dev/kernels.md). Shapes not listed (the 31B ones, and
the others where nothing won) keep the original kernels. Entries name only
``SM90_GPU_CHECKED`` variants."""
SM90_GPU_CHECKED = frozenset({0, 1, 2, 3, 4, 5})
"""The op variants whose launch through the op has run on an H200 and matched
float64 (bench/kernel_timing/sm90_tuned_h200.py; 0 and 1 are the original
kernels every served model runs). tests/test_kernel_sweep.py checks that
``SM90_TUNED`` is what the stored sweeps justify among these."""
TUNED_ON = 90  # the compute capability SM90_TUNED was measured on (the H200)
SM90_MAX_VARIANT = 8  # nvfp4_gemv_bulk.mojo: SM90_VARIANTS - 1
_PDL_VARIANTS = (-1, 0, 2, 3, 4, 5, 6, 8)
"""The op variants that launch with programmatic dependent launch when asked
(the register kernels 0 and 2, the bulk rings; -1 up to 8 rows, where it runs 0)."""


class MojoSM90Backend(NVFP4Backend):
    name = "mojo-sm90"
    layout = WeightLayout.SM90

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        if (why := common_refusal(cls, config)) is not None:
            return False, why
        if config.device_api != "cuda":
            return False, f"needs an NVIDIA GPU, device is {config.device_api}"
        if config.cuda_capability < 80:
            return False, f"needs mma.sync bf16 (sm_80+), device is {config.device_arch}"
        if config.act_dtype != DType.bfloat16:
            return False, f"needs bf16 activations, got {config.act_dtype}"
        return True, f"tensor-core GEMV for M<={GEMV_MAX_M} on {config.device_arch}"

    @classmethod
    def prepare_weights(cls, packed: torch.Tensor, scale_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return prepare_weights(packed, scale_bits)

    @classmethod
    def gated_epilogue(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        ok, why = cls.can_implement(config)
        if not ok:
            return False, why
        if config.n % TILE_N:
            return False, f"{config.n} gate|up rows are not whole tiles of {TILE_N // 2} gate + {TILE_N // 2} up rows"
        return True, f"{cls.name} applies gelu_tanh(gate) * up in the GEMV's epilogue (M<={GEMV_MAX_M})"

    @classmethod
    def kernel_parameters(cls, config: NVFP4LayerConfig) -> tuple[tuple[tuple[str, int], ...], str]:
        """The GEMV kernels for this layer (empty: the original kernels) and why."""
        params, why = _forced_parameters(config) if config.sm90_variant else _tuned_parameters(config)
        if not config.pdl or dict(params).get("pdl"):
            return params, why
        if refusal := pdl_refusal(config.device_api, config.device_arch):
            return params, f"{why}; ATTNQUANT_PDL=1 not taken: {refusal}"
        return (*params, ("pdl", True)), f"{why}; programmatic dependent launch (ATTNQUANT_PDL=1; the register and bulk-ring kernels)"

    @classmethod
    def apply(cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig) -> Tensor:
        return gemv_or_dequant_matmul(
            x, [packed, scale_bits, global_scale], config,
            gemv_op="attnquant.nvfp4_gemv_sm90", dequant_op="attnquant.nvfp4_dequant_sm90",
            weight_dtype=DType.bfloat16,
        )  # fmt: skip


def _tuned_parameters(config: NVFP4LayerConfig) -> tuple[tuple[tuple[str, int], ...], str]:
    """The kernels ``SM90_TUNED`` names for this layer's shape (empty: the original kernels) and why."""
    tuned = SM90_TUNED.get((config.n, config.k))
    if tuned is None:
        return (), "original kernels (no variant measured faster for this shape)"
    if config.cuda_capability != TUNED_ON:
        return (), f"original kernels (the table was measured on sm_{TUNED_ON}, device is {config.device_arch})"
    narrow, wide = tuned.kernels()
    source = f"the kernels measured fastest for this shape (M<=8: {_named(narrow)}; M>8: {_named(wide)})"
    for variant, kw in (narrow, wide):
        problem = _fast_variant_problem({"variant": variant, "kw": kw, "splitk": 1, "pdl": 0}, config)
        if problem:
            return (), f"{source} not taken: {problem}; original kernels"
    splitk = 1 if max(narrow[0], wide[0]) >= 3 else 0  # 1: never the op's own (cluster) pick
    return (
        ("variant", narrow[0]), ("kw", narrow[1]), ("splitk", splitk),
        ("wide_variant", wide[0]), ("wide_kw", wide[1]),
    ), source  # fmt: skip


def _forced_parameters(config: NVFP4LayerConfig) -> tuple[tuple[tuple[str, int], ...], str]:
    """``ATTNQUANT_SM90_VARIANT=v[:kw[:splitk[:pdl]]]``: one kernel at every M."""
    fields = [int(f) for f in config.sm90_variant.split(":")] + [0, 0, 0]
    wanted = {"variant": fields[0], "kw": fields[1], "splitk": fields[2], "pdl": fields[3]}
    source = f"ATTNQUANT_SM90_VARIANT={config.sm90_variant}"
    problem = _fast_variant_problem(wanted, config)
    if problem:
        return (), f"{source} not taken: {problem}; original kernels"
    if wanted["variant"] >= 3 and wanted["splitk"] == 0:
        wanted["splitk"] = 1  # 0 would let the op pick a cluster split-K (not offered, above)
    if wanted["pdl"]:
        wanted["pdl"] = True  # the op's parameter is a Bool: an integer does not convert
    else:
        del wanted["pdl"]
    return tuple(wanted.items()), source


def _named(choice: tuple[int, int]) -> str:
    variant, kw = choice
    return f"variant {variant}, kw {kw or 'picked'}"


def _fast_variant_problem(wanted: dict[str, int], config: NVFP4LayerConfig) -> str | None:
    """Why this layer cannot run the variant asked for, or None."""
    if not -1 <= wanted["variant"] <= SM90_MAX_VARIANT or wanted["splitk"] not in (0, 1, 2, 4) or wanted["kw"] < 0:
        return f"variant -1..{SM90_MAX_VARIANT}, splitk 0/1/2/4 and kw >= 0 are the choices"
    if wanted["splitk"] > 1:
        return (
            "cluster split-K is not offered: it timed slower than no split on every Gemma shape, "
            "and no GPU has run it through MAX (docs/dev/kernels.md)"
        )
    if wanted["pdl"] and wanted["variant"] not in _PDL_VARIANTS:
        return f"programmatic dependent launch needs one of the variants {_PDL_VARIANTS}"
    if wanted["pdl"] and (refusal := pdl_refusal(config.device_api, config.device_arch)):
        return f"programmatic dependent launch {refusal}"
    if wanted["variant"] < 3:
        return None
    if config.cuda_capability < 90:
        return f"the fast variants need sm_90 (bulk copies, clusters), device is {config.device_arch}"
    if config.n % TILE_N or config.k % TILE_K:
        return f"[{config.n}, {config.k}] is not whole {TILE_N}x{TILE_K} tiles (the fast variants stream whole tiles)"
    return None
