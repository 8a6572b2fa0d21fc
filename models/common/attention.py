"""The part of Gemma attention between the two projections, shared by Gemma 3 and 4.

RoPE on q and k, k/v stored in the paged cache, ragged flash attention with
a causal or sliding-window mask: MAX's own kernels, called as MAX's Gemma
attention calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from max.driver import CPU
from max.dtype import DType
from max.experimental import functional as F
from max.experimental.nn import Module
from max.experimental.nn.common_layers.functional_kernels import (
    flash_attention_ragged,
    rope_split_store_ragged,
)
from max.experimental.nn.common_layers.kv_cache import PagedCacheValues
from max.experimental.nn.norm import rms_norm
from max.experimental.sharding import DeviceMapping
from max.experimental.tensor import Tensor
from max.nn.attention import MHAMaskVariant
from max.nn.kv_cache import KVCacheParams

from .layer_subgraphs import subgraph_inputs


LayerValues = dict[str, Tensor]
"""What differs inside attention between decoder layers of one kind, as graph
values: ``cache_layer``, the layer's index in its KV-cache collection, and
``freqs_cis``, its rotary table, and whatever else a model adds (Gemma 4:
its q/k/v norm weights per head). A layer subgraph takes them as arguments."""


def layer_values(rope: Module, index_in_cache: int, **more: Callable[[], Tensor]) -> LayerValues:
    """A layer's :data:`LayerValues`: those it was built with (``more``'s made
    by calling them), or inside a shared layer subgraph, the subgraph's
    arguments. Values made of weights alone are made in the enclosing graph,
    which MAX evaluates once at load; inside a subgraph, where the weights
    are arguments, the same ops would run every step."""
    shared = subgraph_inputs()
    if shared is not None:
        return shared
    values = {"cache_layer": F.constant(index_in_cache, DType.uint32, device=CPU()), "freqs_cis": rope.freqs_cis}
    return values | {name: make() for name, make in more.items()}


def rope_store_attend(
    qkv: Tensor,
    *,
    kv_params: KVCacheParams,
    kv_collection: PagedCacheValues,
    input_row_offsets: Tensor,
    layer: LayerValues,
    interleaved: bool,
    n_heads: int,
    head_dim: int,
    sliding_window: int | None,
    scale: float,
) -> Tensor:
    """Attention over a fused [tokens, q|k|v] tensor; returns [tokens, n_heads * head_dim].

    ``layer``: the attending layer's :func:`layer_values`; ``interleaved``: its
    rotary embedding's layout (the same for every layer). ``sliding_window``
    None means full (causal) attention.
    """
    layer_idx = layer["cache_layer"]
    xq = rope_split_store_ragged(
        kv_params=kv_params,
        qkv=qkv,
        input_row_offsets=input_row_offsets,
        freqs_cis=layer["freqs_cis"],
        kv_collection=kv_collection,
        layer_idx=layer_idx,
        n_heads=n_heads // kv_collection.n_devices,
        interleaved=interleaved,
    ).rebind_mapping(qkv.mapping)
    xq = xq.reshape((-1, n_heads, head_dim))
    attn_out = flash_attention_ragged(
        kv_params,
        input=xq,
        kv_collection=kv_collection,
        layer_idx=layer_idx,
        input_row_offsets=input_row_offsets,
        mask_variant=(
            MHAMaskVariant.CAUSAL_MASK
            if sliding_window is None
            else MHAMaskVariant.SLIDING_WINDOW_CAUSAL_MASK
        ),
        scale=scale,
        local_window_size=-1 if sliding_window is None else sliding_window,
    ).rebind_mapping(xq.mapping)
    return attn_out.reshape((-1, n_heads * head_dim))


def shared_eps(model: str, norms: Sequence[Module]) -> float:
    """The one eps of ``norms`` (MAX builds a layer's q/k(/v) norms from one
    ``qk_norm_eps``), which :func:`normed_heads` needs to serve them all."""
    eps = {norm.eps for norm in norms}
    if len(eps) != 1:
        raise ValueError(f"{model}: the q/k(/v) norms have different eps {sorted(eps)}; one fused norm cannot serve them")
    return eps.pop()


def head_norm_scales(groups: Sequence[tuple[Tensor, int]], head_dim: int, offset: float = 0.0) -> Tensor:
    """[heads, head_dim] float32: for each (norm weight, head count) group,
    that many rows of ``offset + weight``: the table :func:`normed_heads`
    multiplies by. Made of weights alone: build it in the enclosing graph
    (a :data:`LayerValues` entry)."""
    rows = []
    for weight, count in groups:
        row = weight.cast(DType.float32)
        row = (row + offset if offset else row).reshape((1, head_dim))
        rows.append(F.broadcast_to(row, (count, head_dim)))
    return F.concat(rows, axis=0)


def normed_heads(x: Tensor, scales: Tensor, eps: float) -> Tensor:
    """An RMS norm of each head of ``x`` ([tokens, heads * head_dim]), each
    head then times its row of ``scales`` (:func:`head_norm_scales`) in float32.

    One kernel on a GPU where per-head norms of their own and their concat
    are several: the norm reads ``x`` in its own dtype (a cast in front would
    be a launch of its own: MAX fuses only view ops into a norm's input), the
    multiply and the cast after it fuse into the norm. In bfloat16 the
    normalized value is so rounded once before the multiply, which MAX's
    per-head norms do after it (``multiply_before_cast``): at most one
    bfloat16 step apart."""
    heads, head_dim = (int(d) for d in scales.shape)
    ones = Tensor.ones([head_dim], dtype=x.dtype, device=DeviceMapping.replicated(x.mesh))
    normed = rms_norm(x.reshape((-1, heads, head_dim)), ones, eps)
    return (normed.cast(DType.float32) * scales).cast(x.dtype).reshape((-1, heads * head_dim))
