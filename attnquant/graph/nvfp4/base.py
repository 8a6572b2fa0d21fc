"""What every NVFP4 backend shares: the layer config, the backend interface,
and the token-count dispatch of the GPU backends.

A backend computes ``y[M, N] = x[M, K] . W^T`` with
``W = e2m1(code) * e4m3(block_scale) * global_scale`` from weights that
arrive in the ModelOpt layout (packed uint8 ``[N, K/2]``, low nibble = even
k; ``scale_bits`` uint8 ``[N, K/16]``, the raw float8_e4m3fn bits;
``global_scale`` float32 ``[1]``). At load it may re-lay the bytes out for
its kernel (``prepare_weights``); in the graph it runs (``apply``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.tensor import Tensor
from max.graph import DeviceRef, TensorType

from attnquant.formats.nvfp4 import BLOCK_SIZE
from attnquant.graph import matmul
from attnquant.graph.ops import custom_op, rowwise_op
from attnquant.max_compat import RowPadding, cuda_capability
from kernels.sm90_layout import TILE_N, check_modelopt_tensors, padded_shape

GEMV_MAX_M = 16
"""Above this many token rows the GPU backends dequantize once and use MAX's matmul."""


class WeightLayout(enum.Enum):
    MODELOPT = "modelopt"  # packed [N, K/2], scale_bits [N, K/16]
    SM90 = "sm90"  # kernels.sm90_layout.prepare_weights(): tile-ordered, re-encoded
    SM100 = "sm100"  # ModelOpt codes; scale bytes in MAX's TCGEN (rank-5) order, flattened

    @property
    def scale_dtype(self) -> DType:
        """dtype of the block-scale tensor: raw E4M3 bits as uint8 (MAX has no
        float8 on CPU and the Mojo kernels decode the bits), except for MAX's
        own SM100 kernel, which reads float8_e4m3fn (MAX graphs cannot bitcast)."""
        return DType.float8_e4m3fn if self is WeightLayout.SM100 else DType.uint8

    def shapes(self, n: int, k: int) -> tuple[list[int], list[int]]:
        """The packed-weight and scale shapes of an [N, K] weight in this layout."""
        if self is WeightLayout.SM90:
            n, k = padded_shape(n, k)
        return [n, k // 2], [n, k // BLOCK_SIZE]


@dataclass(frozen=True)
class NVFP4LayerConfig:
    """What a backend needs to know about one projection.

    Attributes:
        n, k: output and input features of the (unpadded) weight.
        act_dtype: dtype of the activations (and of the output).
        device_api: ``"cpu"``, ``"cuda"`` or ``"hip"`` (``max.driver.Device.api``).
        device_arch: e.g. ``"sm_90a"``; empty on CPU.
        max_m: the largest number of activation rows the layer will see, if
            known (only used to skip building the large-M branch).
        gemv_only: GPU backends run their GEMV kernel at every M instead of
            branching to dequantize + matmul above ``GEMV_MAX_M``
            (``ATTNQUANT_NVFP4_DISPATCH=gemv``).
        padding: how the large-M route's MAX matmul pads its rows.
        layout: if set, only backends reading weights in this layout qualify
            (for callers holding weights already laid out, e.g. benchmarks).
        sm90_variant: ``ATTNQUANT_SM90_VARIANT`` (a developer override of the
            sm90 GEMV kernel variant; empty: the measured choice).
        sm100_input_scale: ``ATTNQUANT_SM100_INPUT_SCALE`` (max-sm100's static
            activation scale).
        kernel_params: the backend's kernel parameters, once chosen
            (:meth:`NVFP4Backend.kernel_parameters`, recorded in the plan).
        gated: the weight is a gated MLP's gate|up with its rows interleaved
            (``kernels.sm90_layout.interleave_gate_up``), and the layer gives
            the hidden state ``gelu_tanh(gate) * up`` [M, n / 2]
            (:meth:`NVFP4Backend.gated_epilogue`).
        pdl: ``ATTNQUANT_PDL`` (launch the GEMV with programmatic dependent
            launch where the backend can).
    """

    n: int
    k: int
    act_dtype: DType
    device_api: str
    device_arch: str = ""
    max_m: int | None = None
    gemv_only: bool = False
    padding: RowPadding = RowPadding.OFF
    layout: WeightLayout | None = None
    sm90_variant: str = ""
    sm100_input_scale: float = 1.0
    kernel_params: tuple[tuple[str, int], ...] = ()
    gated: bool = False
    pdl: bool = False

    @property
    def out_features(self) -> int:
        """Columns of the layer's output: n, or n / 2 when gated."""
        return self.n // 2 if self.gated else self.n

    @property
    def cuda_capability(self) -> int:
        """NVIDIA compute capability as 90 for sm_90a; 0 if not NVIDIA."""
        return cuda_capability(self.device_api, self.device_arch)


class NVFP4Backend:
    """One backend. Subclasses set ``name``/``layout`` and implement
    ``can_implement`` and ``apply``; ``prepare_weights`` is the identity for
    the ModelOpt layout."""

    name: ClassVar[str]
    layout: ClassVar[WeightLayout] = WeightLayout.MODELOPT

    @classmethod
    def can_implement(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        raise NotImplementedError

    @classmethod
    def prepare_weights(cls, packed: torch.Tensor, scale_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Load time: the weight bytes as this backend's kernel reads them."""
        check_modelopt_tensors(packed, scale_bits)
        return packed, scale_bits

    @classmethod
    def kernel_parameters(cls, config: NVFP4LayerConfig) -> tuple[tuple[tuple[str, int], ...], str]:
        """The kernel parameters this layer runs with, and why (none by default)."""
        return (), ""

    @classmethod
    def gated_epilogue(cls, config: NVFP4LayerConfig) -> tuple[bool, str]:
        """Whether this backend's kernel can apply a gated MLP's activation
        and product to ``config`` (a gate|up layer) in its epilogue, and why."""
        return False, f"{cls.name} has no gated epilogue"

    @classmethod
    def apply(
        cls, x: Tensor, packed: Tensor, scale_bits: Tensor, global_scale: Tensor, config: NVFP4LayerConfig
    ) -> Tensor:
        """Graph time: ``x @ dequant(W).T`` for ``x`` [M, K], in ``x``'s dtype."""
        raise NotImplementedError


def common_refusal(backend: type[NVFP4Backend], config: NVFP4LayerConfig) -> str | None:
    """Why no backend of ``backend``'s layout can take ``config``, or None."""
    if config.layout is not None and config.layout is not backend.layout:
        return f"takes the {backend.layout.value} layout, weights are {config.layout.value}"
    if config.k % BLOCK_SIZE != 0:
        return f"K={config.k} is not a multiple of {BLOCK_SIZE}"
    return None


def gemv_or_dequant_matmul(
    x: Tensor,
    weights: list[Tensor],
    config: NVFP4LayerConfig,
    *,
    gemv_op: str,
    dequant_op: str,
    weight_dtype: DType,
) -> Tensor:
    """The GEMV op for decode-sized M (with the layer's ``kernel_params``,
    gated in its epilogue when ``config.gated``); for prefill, decode W once
    and use MAX's matmul (then the gate with MAX's ops)."""
    weights = matmul.in_enclosing_block(weights)

    def gemv() -> Tensor:
        params = dict(config.kernel_params) | ({"gated": True} if config.gated else {})
        return rowwise_op(gemv_op, x, weights, config.out_features, params)

    def dequant_matmul() -> Tensor:
        w = custom_op(dequant_op, x, weights, [config.n, config.k], weight_dtype)
        # Every M here is above GEMV_MAX_M: the one-row branch would never run.
        padding = RowPadding.OFF if config.padding is RowPadding.OFF else RowPadding.FIXED
        y = matmul.linear(x, w, padding)
        return gate_interleaved(y) if config.gated else y

    return dispatch_on_m(x, config, gemv, dequant_matmul)


def dispatch_on_m(
    x: Tensor, config: NVFP4LayerConfig, small: Callable[[], Tensor], large: Callable[[], Tensor]
) -> Tensor:
    """``small()`` for M <= GEMV_MAX_M, else ``large()``. Decided while
    building the graph when M is static (or ``config.max_m`` bounds it), at run
    time with ``F.cond`` when M is symbolic; always ``small()`` (correct at
    any M) with ``config.gemv_only``."""
    if config.gemv_only:
        return small()
    m = x.shape[0]
    bound = int(m) if matmul.is_static_dim(m) else config.max_m
    if bound is not None and bound <= GEMV_MAX_M:
        return small()
    if matmul.is_static_dim(m):
        return large()
    pred = F.shape_to_tensor([m])[0] <= GEMV_MAX_M
    out = TensorType(x.dtype, [m, config.out_features], DeviceRef.from_device(x.device))
    (y,) = F.cond(pred, [out], small, large)
    return y


def gate_interleaved(y: Tensor) -> Tensor:
    """``gelu_tanh(gate) * up`` [M, F] from a gate|up output [M, 2F] whose
    columns are interleaved as the gated kernels' weights are
    (``kernels.sm90_layout.interleave_gate_up``: 8 gate outputs, then the same
    8 up outputs): the large-M route of a gated layer, in MAX's ops."""
    m, n = y.shape[0], int(y.shape[1])
    blocks = F.reshape(y, [m, n // TILE_N, 2, TILE_N // 2])
    gate, up = (F.reshape(half, [m, n // 2]) for half in F.split(blocks, [1, 1], axis=2))
    return F.gelu(gate, approximate="tanh") * up
