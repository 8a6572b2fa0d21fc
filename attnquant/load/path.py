"""Which computation serves the projections: chosen once per load, logged with its reason.

Every path computes the same ``y = s*(x W0^T) + (x V) U^T`` (theta.py's
decomposition); they differ in when and where the weight is rebuilt:

``precompute-outside`` (default, ``ATTNQUANT_PRECOMPUTE_OUTSIDE=1``)
    W_eff built on the host at load, served as plain (or NVFP4) weights: the
    graph is the base model's.
``graph-fold`` (``ATTNQUANT_PRECOMPUTE_OUTSIDE=0 ATTNQUANT_PRECOMPUTE=1``)
    W_eff = s*W0 + U V^T written as graph ops on the theta weights, then one
    matmul. The expression depends on weights only, so MAX's compiler evaluates
    it once when the model loads and each step reads the folded W_eff: the
    decode step is precompute-outside's (``bench/checks/graph_fold_cpu.py``).
``gemm`` (``ATTNQUANT_GEMM=1``)
    the GEMM formulation: stock MAX matmuls ``x W0^T`` and ``(x V) U^T``, q|k|v
    and gate|up each as one group (``ATTNQUANT_QKV_FUSE``).
``generated`` (``ATTNQUANT_GEMM=0``)
    the ``generated_linear`` Mojo op: one dispatch per projection that never
    materializes ``[out, in]``; with ``ATTNQUANT_FUSED_MLP=1`` the MLP is one
    ``generated_mlp`` dispatch. Ranks above :data:`MAX_GENERATED_RANK` are
    refused (its per-block buffer holds 64 values per row of x).

With ``ATTNQUANT_GEMM`` unset the accelerator decides (:func:`choose_path`).
"""

from __future__ import annotations

from dataclasses import dataclass

from attnquant.config import AttnQuantConfig
from attnquant.plan import ReconstructionPath
from kernels import MAX_GENERATED_RANK


@dataclass(frozen=True)
class PathChoice:
    path: ReconstructionPath
    reason: str

    def __str__(self) -> str:
        return f"{self.path.value} ({self.reason})"


def choose_path(config: AttnQuantConfig, device_api: str, *, residual: bool) -> PathChoice:
    """The path for this load. ``device_api`` is ``max.driver.Device.api``
    (``"cpu"``, ``"cuda"``, ``"hip"``, ``"metal"``); ``residual`` says whether
    any layer has a low-rank residual (G < L and R > 0).

    Raises:
        ValueError: for a combination that cannot be served, naming the fix.
    """
    if config.precompute_outside:
        if config.precompute:
            raise ValueError(
                "ATTNQUANT_PRECOMPUTE=1 folds W_eff inside the graph and needs "
                "ATTNQUANT_PRECOMPUTE_OUTSIDE=0; unset ATTNQUANT_PRECOMPUTE to build "
                "W_eff on the host instead"
            )
        return PathChoice(ReconstructionPath.PRECOMPUTE_OUTSIDE, "ATTNQUANT_PRECOMPUTE_OUTSIDE=1")
    if config.quant != "none":
        raise ValueError(
            f"ATTNQUANT_QUANT={config.quant} quantizes the host-built W_eff and needs "
            "ATTNQUANT_PRECOMPUTE_OUTSIDE=1; in-graph reconstruction serves theta "
            "in the model dtype (set ATTNQUANT_QUANT=none)"
        )
    if config.precompute:
        return PathChoice(ReconstructionPath.GRAPH_FOLD, "ATTNQUANT_PRECOMPUTE=1")
    if config.gemm is not None:
        choice = PathChoice(ReconstructionPath.GEMM if config.gemm else ReconstructionPath.GENERATED, f"ATTNQUANT_GEMM={int(config.gemm)}")
    elif device_api in ("cuda", "hip"):
        # On the H200 GEMM (rows padded) gives torch's greedy text and takes
        # 0.78x generated_linear's time per token (docs/performance.md).
        choice = PathChoice(ReconstructionPath.GEMM, f"auto: {device_api} GPU, MAX's tensor-core matmuls")
    elif device_api == "metal":
        choice = PathChoice(ReconstructionPath.GENERATED, "auto: Metal, per-element rebuild beats matmuls at low rank")
    else:
        # Not measured against generated_linear on CPU yet: MAX's tuned matmuls
        # are the safer default than our straightforward parallel loop.
        choice = PathChoice(ReconstructionPath.GEMM, "auto: CPU, MAX's matmuls")
    if choice.path is ReconstructionPath.GENERATED and residual and config.rank > MAX_GENERATED_RANK:
        raise ValueError(
            f"ATTNQUANT_RANK={config.rank} exceeds generated_linear's limit of "
            f"{MAX_GENERATED_RANK}; use the GEMM formulation (ATTNQUANT_GEMM=1) or "
            f"ATTNQUANT_RANK<={MAX_GENERATED_RANK}"
        )
    return choice
