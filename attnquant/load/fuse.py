"""The run-time layout: fused projection groups, as the graph modules take them.

Load time produces one tensor set per projection (a dense ``weight``, or the
ModelOpt NVFP4 set ``weight``/``weight_scale``/``weight_scale_2``/
``input_scale``). At run time q|k|v and gate|up are each one matmul, so this
step concatenates their tensors along the output rows once, at load.

Members of a group fuse only with neighbours of the same kind: with
``ATTNQUANT_QUANT_IGNORE=q_proj`` the attention input becomes a dense part
(q) and an NVFP4 part (k|v). A group with one part is stored under the group
name itself (``qkv_proj.weight``); one with several under ``qkv_proj.0.``,
``qkv_proj.1.`` and so on.

NVFP4 parts carry their decode scale as ``weight_scale_2``: a ``[1]`` tensor
when every member has the same global scale (one projection, or a group that
``load.precompute`` quantized with one amax, as it does), else a per-output-row
``[N]`` vector (``PartPlan.per_row_scale``), applied after the matmul.

Theta parts (in-graph reconstruction, ``ATTNQUANT_PRECOMPUTE_OUTSIDE=0``)
arrive as ``w0`` (the band's shared block), ``scale`` and, when the layer has
a residual, ``u``/``v`` per projection. Fused, they become ``w0`` = the
members' blocks stacked by rows, ``scale`` concatenated, ``v`` concatenated by
columns and ``u`` block-diagonal, so ``s*(x W0^T) + (x V) U^T`` is one
computation for the group. Layers that share the same blocks get the *same*
fused ``w0`` tensor object, and the part records which part first owned it
(``PartPlan.shared_with``): the graph modules alias it, so MAX holds one copy
per band, which is the point of serving theta instead of W_eff.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, MutableMapping

import torch

from attnquant.formats.names import BLOCK_PATTERN, FUSED_GROUPS
from attnquant.plan import Kind, PartPlan, ProjectionPlan, part_name

_BLOCK_RE = re.compile(rf"^(?P<block>.*layers\.\d+\.(?:{BLOCK_PATTERN}))\.")


def kind_of(state_dict: Mapping[str, torch.Tensor], module: str) -> Kind:
    if f"{module}.w0" in state_dict:
        return "theta"
    return "nvfp4" if f"{module}.weight_scale" in state_dict else "dense"


def _out_in(state_dict: Mapping[str, torch.Tensor], module: str) -> tuple[int, int]:
    if kind_of(state_dict, module) == "theta":
        return tuple(state_dict[f"{module}.w0"].shape)  # type: ignore[return-value]
    rows, cols = state_dict[f"{module}.weight"].shape
    # A packed NVFP4 row holds two values per byte.
    return rows, cols * (2 if kind_of(state_dict, module) == "nvfp4" else 1)


def plan_group(
    state_dict: Mapping[str, torch.Tensor],
    block: str,
    members: tuple[str, ...],
    fuse: bool,
) -> tuple[PartPlan, ...]:
    """Splits a group's present members into runs of one kind (singletons if not ``fuse``)."""
    runs: list[list[str]] = []
    for member in members:
        module = f"{block}.{member}"
        if kind_of(state_dict, module) == "dense" and f"{module}.weight" not in state_dict:
            continue  # e.g. Gemma 4 layers where k and v share one projection
        same_kind = runs and kind_of(state_dict, f"{block}.{runs[-1][-1]}") == kind_of(
            state_dict, module
        )
        if fuse and same_kind:
            runs[-1].append(member)
        else:
            runs.append([member])
    parts = []
    for run in runs:
        shapes = [_out_in(state_dict, f"{block}.{m}") for m in run]
        in_dims = {k for _, k in shapes}
        if len(in_dims) != 1:
            raise ValueError(f"cannot fuse {block}.{run}: input widths differ {shapes}")
        parts.append(
            PartPlan(
                kind=kind_of(state_dict, f"{block}.{run[0]}"),
                members=tuple(run),
                out_dims=tuple(n for n, _ in shapes),
                in_dim=in_dims.pop(),
                rank=sum(_rank(state_dict, f"{block}.{m}") for m in run),
            )
        )
    return tuple(parts)


def _rank(state_dict: Mapping[str, torch.Tensor], module: str) -> int:
    u = state_dict.get(f"{module}.u")
    return 0 if u is None else u.shape[1]


def _fuse_dense(sd: MutableMapping[str, torch.Tensor], modules: list[str]) -> dict[str, torch.Tensor]:
    weights = [sd.pop(f"{m}.weight") for m in modules]
    # One member keeps its tensor object (an output head aliasing the embedding stays an alias).
    return {"weight": weights[0] if len(weights) == 1 else torch.cat(weights)}


def _fuse_nvfp4(sd: MutableMapping[str, torch.Tensor], modules: list[str]) -> dict[str, torch.Tensor]:
    packed = [sd.pop(f"{m}.weight") for m in modules]
    scale_bits = [sd.pop(f"{m}.weight_scale").view(torch.uint8) for m in modules]
    globals_ = [sd.pop(f"{m}.weight_scale_2").float().reshape(1) for m in modules]
    for m in modules:
        sd.pop(f"{m}.input_scale", None)  # weight-only: activations stay unquantized
    if all(torch.equal(g, globals_[0]) for g in globals_):
        global_scale = globals_[0]  # one projection, or members quantized with one amax
    else:
        global_scale = torch.cat(
            [g.expand(p.shape[0]) for g, p in zip(globals_, packed, strict=True)]
        )
    return {
        "weight": torch.cat(packed),
        "weight_scale": torch.cat(scale_bits),
        "weight_scale_2": global_scale.contiguous(),
    }


class _SharedBlocks:
    """Fused ``w0`` per distinct tuple of member blocks, so aliases stay aliases."""

    def __init__(self) -> None:
        self._fused: dict[tuple[int, ...], tuple[torch.Tensor, str]] = {}

    def fuse(self, blocks: list[torch.Tensor], dtype: torch.dtype, owner: str) -> tuple[torch.Tensor, str]:
        key = tuple(id(b) for b in blocks)
        if key not in self._fused:
            self._fused[key] = (torch.cat(blocks).to(dtype), owner)
        return self._fused[key]


def _fuse_theta(
    sd: MutableMapping[str, torch.Tensor],
    modules: list[str],
    dtype: torch.dtype,
    factor_dtype: torch.dtype,
    shared: _SharedBlocks,
    name: str,
    rank_multiple: int,
) -> tuple[dict[str, torch.Tensor], str]:
    """Stacks theta members; returns the tensors and the owner of their ``w0``.
    The residual width is padded with zero columns of U and V to a multiple
    of ``rank_multiple`` (the product ``(x V) U^T`` does not change)."""
    w0, owner = shared.fuse([sd.pop(f"{m}.w0") for m in modules], dtype, name)
    scales = [sd.pop(f"{m}.scale") for m in modules]
    tensors = {"w0": w0, "scale": torch.cat(scales).to(factor_dtype)}
    us = [sd.pop(f"{m}.u", None) for m in modules]
    vs = [sd.pop(f"{m}.v", None) for m in modules]
    if any(u is not None for u in us):
        k = w0.shape[1]
        # A member without a residual is a zero-width block.
        us = [torch.zeros(s.shape[0], 0) if u is None else u for u, s in zip(us, scales, strict=True)]
        vs = [torch.zeros(k, 0) if v is None else v for v in vs]
        u, v = torch.block_diag(*us), torch.cat(vs, dim=1)
        pad = -u.shape[1] % rank_multiple
        tensors["u"] = torch.nn.functional.pad(u, (0, pad)).to(factor_dtype)
        tensors["v"] = torch.nn.functional.pad(v, (0, pad)).to(factor_dtype)
    return tensors, owner


def _lay_out_group(
    sd: MutableMapping[str, torch.Tensor],
    plan: ProjectionPlan,
    block: str,
    group: str,
    members: tuple[str, ...],
    fuse: bool,
    *,
    dtype: torch.dtype,
    factor_dtype: torch.dtype,
    shared: _SharedBlocks,
    rank_multiple: int,
) -> None:
    """Replaces the members' tensors in ``sd`` by their parts' and plans ``block.group``."""
    parts = plan_group(sd, block, members, fuse)
    if not parts:
        return
    new_parts = []
    for i, part in enumerate(parts):
        modules = [f"{block}.{m}" for m in part.members]
        name = part_name(f"{block}.{group}", i, len(parts))
        if part.kind == "theta":
            tensors, owner = _fuse_theta(sd, modules, dtype, factor_dtype, shared, name, rank_multiple)
            rank = tensors["u"].shape[1] if "u" in tensors else 0
            part = dataclasses.replace(part, shared_with=owner, rank=rank)
        elif part.kind == "nvfp4":
            tensors = _fuse_nvfp4(sd, modules)
            part = dataclasses.replace(part, per_row_scale=tensors["weight_scale_2"].numel() > 1)
        else:
            tensors = _fuse_dense(sd, modules)
        sd.update({f"{name}.{k}": v for k, v in tensors.items()})
        new_parts.append(part)
    plan[f"{block}.{group}"] = tuple(new_parts)


def to_runtime_layout(
    state_dict: Mapping[str, torch.Tensor],
    *,
    fuse: bool,
    dtype: torch.dtype,
    theta_factor_dtype: torch.dtype | None = None,
    theta_rank_multiple: int = 1,
    singles: tuple[str, ...] = (),
) -> tuple[dict[str, torch.Tensor], ProjectionPlan]:
    """Fuses projection groups; casts dense floating tensors to ``dtype``.

    ``singles``: modules outside the decoder layers laid out and planned on
    their own, under their own name (the output head).

    Theta ``scale``/``u``/``v`` go to ``theta_factor_dtype`` (default
    ``dtype``: the GEMM formulation computes in the input dtype; the
    generated_linear kernel takes them in float32). Each theta part's
    residual width (its plan's ``rank``) is padded to a multiple of
    ``theta_rank_multiple`` (``attnquant.max_compat.MIN_INNER_MULTIPLE`` for the
    paths that multiply by U with MAX's matmul)."""
    factor_dtype = dtype if theta_factor_dtype is None else theta_factor_dtype
    sd = dict(state_dict)
    blocks = sorted({m.group("block") for k in sd if (m := _BLOCK_RE.match(k))})
    plan: ProjectionPlan = {}
    shared = _SharedBlocks()
    theta = dict(dtype=dtype, factor_dtype=factor_dtype, shared=shared, rank_multiple=theta_rank_multiple)
    for block in blocks:
        for fused in FUSED_GROUPS:
            if block.endswith(fused.block):
                _lay_out_group(sd, plan, block, fused.name, fused.members, fuse, **theta)
    for module in singles:
        block, member = module.rsplit(".", 1)
        _lay_out_group(sd, plan, block, member, (member,), False, **theta)
    cast: dict[int, torch.Tensor] = {}  # one cast per tensor object: aliases stay aliases
    keep = ("weight_scale_2",) if factor_dtype == dtype else ("weight_scale_2", ".scale", ".u", ".v")
    for key, value in sd.items():
        if value.is_floating_point() and value.dtype != dtype and not key.endswith(keep):
            if id(value) not in cast:
                cast[id(value)] = value.to(dtype)
            sd[key] = cast[id(value)]
    return sd, plan
