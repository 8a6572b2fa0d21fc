"""Run-time theta projections (in-graph reconstruction), one module per path.

Each declares the tensors the load writes for a theta part (``load.fuse``):
``w0`` [N, K] (the band's block, the same Tensor object in every layer that
shares it), ``scale`` [N] and, when the part has a residual, ``u`` [N, R] and
``v`` [K, R], all in the model dtype. The three modules compute the same
``y = s*(x W0^T) + (x V) U^T``; ``attnquant.load.path`` says which one a
load uses and why.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from max.dtype import DType
from max.experimental.nn import Module
from max.experimental.tensor import Tensor

from attnquant.graph import generated, matmul
from attnquant.max_compat import RowPadding
from attnquant.plan import GENERATED_MLP, PartPlan, ReconstructionPath

_SHARED_BLOCKS: contextvars.ContextVar[dict[str, Tensor] | None] = contextvars.ContextVar(
    "attnquant_shared_blocks", default=None
)


@contextlib.contextmanager
def shared_blocks() -> Iterator[None]:
    """Build a model's projections inside this: theta parts that share a
    band's ``w0`` then hold one Tensor, which MAX binds as one weight."""
    token = _SHARED_BLOCKS.set({})
    try:
        yield
    finally:
        _SHARED_BLOCKS.reset(token)


class ThetaTensors(Module[[Tensor], Tensor]):
    """The tensors of one theta part; subclasses say how to compute with them."""

    factor_dtype: DType | None = None
    """dtype of scale/u/v; None: the model dtype."""

    def __init__(self, part: PartPlan) -> None:
        super().__init__()
        registry = _SHARED_BLOCKS.get()
        if registry is None:
            raise RuntimeError(
                "theta projections must be built inside attnquant.graph.theta.shared_blocks() "
                "so that layers sharing a band's W0 share one weight"
            )
        n, k = part.out_dim, part.in_dim
        if part.shared_with not in registry:
            registry[part.shared_with] = Tensor.zeros([n, k])
        self.w0 = registry[part.shared_with]
        self.out_features, self.in_features, self.rank = n, k, part.rank
        self.padding = RowPadding(part.row_padding)
        dtype = {} if self.factor_dtype is None else {"dtype": self.factor_dtype}
        self.scale = Tensor.zeros([n], **dtype)
        if part.rank:
            self.u = Tensor.zeros([n, part.rank], **dtype)
            self.v = Tensor.zeros([k, part.rank], **dtype)

    def factors(self) -> list[Tensor]:
        """``[w0, scale, u, v]`` (``u``/``v`` only with a residual)."""
        return [self.w0, self.scale, self.u, self.v] if self.rank else [self.w0, self.scale]


class GemmThetaProjection(ThetaTensors):
    """The GEMM formulation: ``s*(x W0^T) + (x V) U^T`` with MAX's matmuls.

    ``W0`` is not concatenated with ``V`` into one ``[K, N + R]`` operand: W0
    is shared by every layer of a band and V is not, so that operand would
    copy W0 into each layer and give back the memory this path exists to save.
    """

    def forward(self, x: Tensor) -> Tensor:
        factors = self.factors()
        if self.padding is RowPadding.BRANCH:
            factors = matmul.in_enclosing_block(factors)
        # Both matmuls are MAX's: pad the rows once for the pair.
        return matmul.on_full_row_tiles(
            lambda rows: _gemm(rows, *factors), x, self.padding, out_features=self.out_features
        )


def _gemm(x: Tensor, w0: Tensor, scale: Tensor, u: Tensor | None = None, v: Tensor | None = None) -> Tensor:
    y = matmul.linear_as_given(x, w0) * scale
    return y if u is None else y + (x @ v) @ u.T


class FoldThetaProjection(ThetaTensors):
    """``ATTNQUANT_PRECOMPUTE=1``: ``W = s*W0 + U V^T`` in the graph, then ``x W^T``.

    ``W`` depends on weights only: MAX evaluates it once at load, not per
    step (``bench/checks/graph_fold_cpu.py``), so this serves a dense W_eff."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.w0 * self.scale.reshape([-1, 1])
        if self.rank:
            w = w + self.u @ self.v.T
        return matmul.linear(x, w, self.padding)


class GeneratedThetaProjection(ThetaTensors):
    """The ``generated_linear`` Mojo op: one dispatch, no ``[N, K]`` temporary.

    The op takes ``scale``/``u``/``v`` in float32. A part without a residual
    passes zero-width ``u``/``v`` (the kernel's rank-0 case)."""

    factor_dtype = DType.float32

    def theta_args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(w0, scale, u, v)`` as the generated ops take them."""
        if self.rank:
            return self.w0, self.scale, self.u, self.v
        device = self.w0.device
        u = Tensor.zeros([self.out_features, 0], dtype=DType.float32, device=device)
        v = Tensor.zeros([self.in_features, 0], dtype=DType.float32, device=device)
        return self.w0, self.scale, u, v

    def forward(self, x: Tensor) -> Tensor:
        return generated.generated_linear(x, *self.theta_args())


THETA_MODULES: dict[str, type[ThetaTensors]] = {
    ReconstructionPath.GEMM.value: GemmThetaProjection,
    ReconstructionPath.GRAPH_FOLD.value: FoldThetaProjection,
    ReconstructionPath.GENERATED.value: GeneratedThetaProjection,
    # MLP parts of a fused generated_mlp (GeneratedMLP normally builds
    # them; as plain projections they compute the same).
    GENERATED_MLP: GeneratedThetaProjection,
}


def build_theta_part(part: PartPlan) -> ThetaTensors:
    if part.reconstruction not in THETA_MODULES:
        raise ValueError(f"theta part {part.members} has no in-graph path ({part.reconstruction!r})")
    return THETA_MODULES[part.reconstruction](part)
