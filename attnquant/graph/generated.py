"""Graph wrappers for the in-graph reconstruction ("generated") Mojo ops.

A projection weight is described by a *theta*: ``w0 [N, K]`` (model dtype),
``scale [N]``, ``u [N, r]`` and ``v [K, r]`` (float32), with
``W = scale[:, None] * w0 + u @ v.T``. The ops compute, with float32
accumulation and without ever materializing ``W``::

    generated_linear:  y = scale * (x @ w0.T) + (x @ v) @ u.T
    generated_mlp:     y = down(gelu_tanh(gate(x)) * up(x))   (Gemma's MLP)

Both take ``max.experimental`` tensors (ModuleV3) and load the attnquant ops
package into the graph being built (once per graph, ``attnquant.graph.ops``). The kernels live in
``kernels/attnquant_ops/generated_linear.mojo``.

The rank is limited to :data:`MAX_GENERATED_RANK` (the GPU kernel keeps
``x @ v`` in a fixed shared-memory buffer); :func:`check_rank` refuses larger
ranks while the graph is built, and the kernel raises the same message at run
time if a symbolic rank turns out larger.
"""

from __future__ import annotations

from dataclasses import dataclass

from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor

from attnquant.graph.matmul import is_static_dim
from attnquant.graph.ops import rowwise_op
from kernels import GELU_TANH_NAMES, MAX_GENERATED_RANK

MLP_ACTIVATIONS = GELU_TANH_NAMES
"""Activation names (Hugging Face config spelling) generated_mlp implements."""

_GEMM_HINT = "use the GEMM formulation (ATTNQUANT_GEMM=1) or ATTNQUANT_RANK<=64"


def check_rank(rank: int) -> None:
    """Raises ValueError unless ``0 <= rank <= MAX_GENERATED_RANK``."""
    if not 0 <= rank <= MAX_GENERATED_RANK:
        raise ValueError(
            f"generated ops: rank {rank} is outside 0..{MAX_GENERATED_RANK} "
            f"(the kernel's shared-memory buffer for x @ v); {_GEMM_HINT}"
        )


@dataclass(frozen=True)
class Theta:
    """One generated projection: ``W = scale[:, None] * w0 + u @ v.T``.

    Attributes:
        w0: ``[N, K]``, the model dtype (the activations' dtype).
        scale: ``[N]`` float32.
        u: ``[N, r]`` float32.
        v: ``[K, r]`` float32.
    """

    w0: Tensor
    scale: Tensor
    u: Tensor
    v: Tensor

    def tensors(self) -> list[Tensor]:
        return [self.w0, self.scale, self.u, self.v]

    @property
    def out_features(self):  # Dim or int
        return self.w0.shape[0]

    @property
    def rank(self):  # Dim or int
        return self.u.shape[1]


def _as_theta(t: Theta | tuple[Tensor, Tensor, Tensor, Tensor] | list[Tensor]) -> Theta:
    if isinstance(t, Theta):
        return t
    if len(t) != 4:
        raise ValueError(f"a theta is (w0, scale, u, v), got {len(t)} tensors")
    return Theta(*t)


def _check_theta(name: str, theta: Theta, k: object, act_dtype: DType) -> None:
    """Build-time checks of what is known: dtypes, tensor ranks, and K and r
    where static (the kernel checks every shape again at run time)."""
    if theta.w0.rank != 2 or theta.u.rank != 2 or theta.v.rank != 2 or theta.scale.rank != 1:
        raise ValueError(
            f"{name}: expected w0 [N, K], scale [N], u [N, r], v [K, r]; got ranks "
            f"{theta.w0.rank}, {theta.scale.rank}, {theta.u.rank}, {theta.v.rank}"
        )
    if theta.w0.dtype != act_dtype:
        raise ValueError(f"{name}: w0 is {theta.w0.dtype}, the activations are {act_dtype}")
    for field in ("scale", "u", "v"):
        dtype = getattr(theta, field).dtype
        if dtype != DType.float32:
            raise ValueError(f"{name}: {field} must be float32, got {dtype}")
    w0_k = theta.w0.shape[1]
    if is_static_dim(w0_k) and is_static_dim(k) and int(w0_k) != int(k):  # type: ignore[call-overload]
        raise ValueError(f"{name}: w0 is {list(theta.w0.shape)}, the input has K={k} features")
    if is_static_dim(theta.rank):
        check_rank(int(theta.rank))


def _flatten(x: Tensor) -> tuple[Tensor, list, object]:
    """x as [M, K] plus its leading dims (to restore them) and K (int if static)."""
    if x.rank < 2:
        raise ValueError(f"expected activations of rank >= 2 ([..., K]), got shape {list(x.shape)}")
    k = x.shape[-1]
    k = int(k) if is_static_dim(k) else k
    lead = list(x.shape[:-1])
    x2 = x if x.rank == 2 else F.reshape(x, [-1, k])
    return x2, lead, k


def _restore(y: Tensor, x: Tensor, lead: list, n) -> Tensor:
    return y if x.rank == 2 else F.reshape(y, [*lead, n])


def generated_linear(x: Tensor, w0: Tensor, scale: Tensor, u: Tensor, v: Tensor) -> Tensor:
    """``scale * (x @ w0.T) + (x @ v) @ u.T`` in ``x``'s dtype (float32
    accumulation), one ``attnquant.generated_linear`` call.

    ``x`` may have any leading dims (``[M, K]`` or ``[B, S, K]``, flattened
    to ``[M, K]`` for the op and restored after), the last being K. Shapes are
    checked here where static and by the kernel at run time. A static rank
    above :data:`MAX_GENERATED_RANK` raises ValueError (see
    :func:`check_rank`); rank 0 goes to the kernel as zero-width ``u``/``v``,
    which MAX passes and the kernel supports (y = scale * (x @ w0.T)).
    """
    theta = Theta(w0, scale, u, v)
    x2, lead, k = _flatten(x)
    _check_theta("generated_linear", theta, k, x.dtype)
    n = theta.out_features
    return _restore(rowwise_op("attnquant.generated_linear", x2, theta.tensors(), n), x, lead, n)


def generated_mlp(
    x: Tensor,
    gate: Theta | tuple[Tensor, Tensor, Tensor, Tensor],
    up: Theta | tuple[Tensor, Tensor, Tensor, Tensor],
    down: Theta | tuple[Tensor, Tensor, Tensor, Tensor],
) -> Tensor:
    """``down(gelu_tanh(gate(x)) * up(x))``, each projection a theta, as one
    ``attnquant.generated_mlp`` call (Gemma's MLP; the intermediate
    ``[M, I]`` is kept in float32 inside the op).

    gate and up are ``[I, H]`` thetas, down is ``[H', I]``; the result is
    ``[..., H']`` in ``x``'s dtype. Each theta is a :class:`Theta` or a
    ``(w0, scale, u, v)`` tuple.
    """
    gate, up, down = _as_theta(gate), _as_theta(up), _as_theta(down)
    x2, lead, k = _flatten(x)
    _check_theta("generated_mlp gate", gate, k, x.dtype)
    _check_theta("generated_mlp up", up, k, x.dtype)
    inter = gate.out_features
    _check_theta("generated_mlp down", down, inter, x.dtype)
    n = down.out_features
    weights = [*gate.tensors(), *up.tensors(), *down.tensors()]
    return _restore(rowwise_op("attnquant.generated_mlp", x2, weights, n), x, lead, n)


__all__ = [
    "MAX_GENERATED_RANK",
    "MLP_ACTIVATIONS",
    "Theta",
    "check_rank",
    "generated_linear",
    "generated_mlp",
]
