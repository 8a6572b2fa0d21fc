"""The generated-weight ops (attnquant.generated_linear / generated_mlp) on CPU.

One MAX graph is compiled for the whole module (a compile costs a minute on
2 cores): every rank and M is symbolic, so the cases below only feed it
different shapes. It holds generated_linear on [M, K] and on [1, M, K]
activations and the fused MLP. Each case draws fresh random inputs and
compares with a float64 torch reference of
``W = s[:, None] * W0 + u @ v.T``: y = x @ W.T (and, for the MLP,
down(gelu_tanh(gate(x)) * up(x))). The GPU kernels are checked on the H200
by bench/checks/generated_linear_h200.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from attnquant.graph import generated as G

pytestmark = pytest.mark.max

H, N, INTER = 45, 24, 56  # K = H is odd: exercises the kernels' scalar tails
RTOL = 1e-5  # float32 accumulation


@pytest.fixture(scope="module")
def graph():
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental import functional as F
    from max.experimental.sharding import TensorLayout

    from attnquant.graph.ops import custom_extensions_path

    device = CPU()
    f32 = DType.float32

    def theta_types(n: int, k: int, r: str, rv: str | None = None) -> list:
        return [
            TensorLayout(f32, [n, k], device),
            TensorLayout(f32, [n], device),
            TensorLayout(f32, [n, r], device),
            TensorLayout(f32, [k, rv or r], device),
        ]

    def forward(x, w0, s, u, v, gw0, gs, gu, gv, uw0, us, uu, uv, dw0, ds, du, dv):
        y = G.generated_linear(x, w0, s, u, v)
        y3 = G.generated_linear(F.reshape(x, [1, -1, H]), w0, s, u, v)
        mlp = G.generated_mlp(x, G.Theta(gw0, gs, gu, gv), (uw0, us, uu, uv), (dw0, ds, du, dv))
        return y, y3, mlp

    # u and v of the linear get separate rank symbols so that a mismatch
    # reaches the kernel's own shape check.
    types = [
        TensorLayout(f32, ["m", H], device),
        *theta_types(N, H, "r", "rv"),
        *theta_types(INTER, H, "rg"),
        *theta_types(INTER, H, "ru"),
        *theta_types(H, INTER, "rd"),
    ]
    return compilation.compile(forward, custom_extensions=[custom_extensions_path()])(*types)


def random_theta(n: int, k: int, r: int, rv: int | None = None) -> list[torch.Tensor]:
    return [
        torch.randn(n, k) / math.sqrt(k),
        torch.empty(n).uniform_(0.5, 1.5),
        torch.randn(n, r) * 0.3,
        torch.randn(k, r if rv is None else rv) * 0.3,
    ]


def weight(theta: list[torch.Tensor]) -> torch.Tensor:
    """float64 W = s[:, None] * W0 + u @ v.T."""
    w0, s, u, v = (t.double() for t in theta)
    return s[:, None] * w0 + u @ v.T


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def run(graph, x, lin, gate, up, down) -> list[torch.Tensor]:
    from max.experimental.tensor import Tensor

    args = [x, *lin, *gate, *up, *down]
    return [torch.from_dlpack(o).clone() for o in graph(*[Tensor.from_dlpack(t.contiguous()) for t in args])]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out.double() - ref).norm() / ref.norm())


def random_mlp(rg: int, ru: int, rd: int) -> tuple[list, list, list]:
    return random_theta(INTER, H, rg), random_theta(INTER, H, ru), random_theta(H, INTER, rd)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("r", [0, 1, 4, 32, 64])
def test_generated_linear_matches_float64(graph, m: int, r: int) -> None:
    x = torch.randn(m, H)
    lin = random_theta(N, H, r)
    y, y3, _ = run(graph, x, lin, *random_mlp(2, 2, 2))
    ref = x.double() @ weight(lin).T
    assert y.shape == (m, N) and y3.shape == (1, m, N)
    assert rel_err(y, ref) < RTOL
    assert torch.equal(y3[0], y)


def test_generated_linear_uses_the_low_rank_term(graph) -> None:
    """The u v^T term is not dropped: zeroing s leaves exactly (x v) u^T."""
    x = torch.randn(3, H)
    lin = random_theta(N, H, 7)
    lin[1].zero_()
    y, _, _ = run(graph, x, lin, *random_mlp(1, 1, 1))
    ref = (x.double() @ lin[3].double()) @ lin[2].double().T
    assert rel_err(y, ref) < RTOL


@pytest.mark.parametrize(
    "m,ranks", [(1, (4, 4, 4)), (3, (0, 5, 64)), (17, (64, 1, 0)), (5, (32, 32, 32))]
)
def test_generated_mlp_matches_float64(graph, m: int, ranks: tuple[int, int, int]) -> None:
    x = torch.randn(m, H)
    gate, up, down = random_mlp(*ranks)
    _, _, y = run(graph, x, random_theta(N, H, 3), gate, up, down)
    h = gelu_tanh(x.double() @ weight(gate).T) * (x.double() @ weight(up).T)
    ref = h @ weight(down).T
    assert y.shape == (m, H)
    assert rel_err(y, ref) < RTOL


def test_empty_batch(graph) -> None:
    y, y3, mlp = run(graph, torch.randn(0, H), random_theta(N, H, 4), *random_mlp(4, 4, 4))
    assert y.shape == (0, N) and y3.shape == (1, 0, N) and mlp.shape == (0, H)


# ---------------------------------------------------------------------------
# Rank and shape guards
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [65, 128, -1])
def test_check_rank_refuses(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank {rank}\b.*ATTNQUANT_GEMM=1.*ATTNQUANT_RANK<=64"):
        G.check_rank(rank)


def test_check_rank_accepts_0_to_64() -> None:
    for rank in (0, 1, random.randint(2, 63), G.MAX_GENERATED_RANK):
        G.check_rank(rank)


def test_kernel_refuses_rank_65(graph) -> None:
    """A symbolic rank is only known at run time: the kernel raises."""
    with pytest.raises(Exception, match=r"generated_linear: rank r=65 exceeds MAX_GENERATED_RANK=64.*ATTNQUANT_GEMM=1"):
        run(graph, torch.randn(2, H), random_theta(N, H, 65), *random_mlp(1, 1, 1))
    gate, up, _ = random_mlp(1, 1, 1)
    with pytest.raises(Exception, match=r"generated_mlp down: rank r=65 exceeds"):
        run(graph, torch.randn(2, H), random_theta(N, H, 1), gate, up, random_theta(H, INTER, 65))


def test_kernel_names_a_bad_shape(graph) -> None:
    with pytest.raises(Exception, match=r"generated_linear: v is \[45, 4\], expected \[K=45, r=3\]"):
        run(graph, torch.randn(2, H), random_theta(N, H, 3, rv=4), *random_mlp(1, 1, 1))


def test_graph_build_refuses_a_static_rank_above_64() -> None:
    """Traced only (compilation.stage): the wrapper refuses before any op."""
    from max.driver import CPU
    from max.dtype import DType
    from max.experimental import compilation
    from max.experimental.sharding import TensorLayout

    f32, cpu = DType.float32, CPU()
    types = [TensorLayout(f32, shape, cpu) for shape in (["m", H], [N, H], [N], [N, 65], [H, 65])]
    with pytest.raises(ValueError, match=r"rank 65 .*ATTNQUANT_GEMM=1"):
        compilation.stage(G.generated_linear)(*types)
