"""The one line a load (or ``attnquant quantize``) reports: what was served and what it cost."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from attnquant.formats.names import ProjectionKey

LOAD_PREFIX = "attnquant load:"

THETA_ERROR_WARNING = 0.05
"""Worst per-layer relative reconstruction error above which a load warns
that the served model departs from the checkpoint. NVFP4's own per-layer
error on the Gemma 3 270M is 0.086-0.094, for a mean KL of 0.12-0.18 nats;
every theta setting of that model below full rank rebuilds its layers with
an error of 0.5 or more and a KL above 10 (docs/quality.md, "The theta
dial"). The crossing lies between those points; half NVFP4's error warns
before a setting can cost what NVFP4 does."""


@dataclass(frozen=True)
class LoadReport:
    """Path, theta, NVFP4 coverage, bytes and where the weights came from.

    Bytes are counted as prepared, before any cast to the model dtype (so a
    float32 CPU run reports checkpoint-dtype bytes); a tensor aliased by
    several layers (a band's shared W0) counts once. "Per decode token" is
    every served tensor once: at batch 1 each step reads every weight (the
    tied embedding once, as the output head); the KV cache is not counted.
    A projection the checkpoint stores as NVFP4 counts, before, as the bf16
    weight it encodes (its packed codes and scales are what is served), so
    the ratio is against the unquantized model either way.
    """

    path: str
    blocks: int
    num_layers: int
    rank: int
    quant: str
    projections: int
    quantized: int
    projection_bytes_before: int
    projection_bytes_after: int
    decode_bytes_before: int
    decode_bytes_after: int
    source: str
    layer_errors: Mapping[int, float]
    extra_resident_bytes: int = 0
    """Bytes held beyond the served tensors (the graph fold's W_eff)."""
    head: str = ""
    """How the output head is served, when attnquant computes it (``lm_head=nvfp4``)."""

    @classmethod
    def measure(
        cls,
        *,
        before: Mapping[str, torch.Tensor],
        served: Mapping[str, torch.Tensor],
        keys: Sequence[ProjectionKey],
        quantized: int,
        path: str,
        blocks: int,
        num_layers: int,
        rank: int,
        quant: str,
        source: str,
        layer_errors: Mapping[int, float],
        folded: bool = False,
        lookup_only: Collection[str] = (),
        head: str = "",
        stored: Collection[ProjectionKey] = (),
    ) -> LoadReport:
        """``folded``: MAX folds W_eff from theta at load (the graph fold), so
        it holds theta and a dense W_eff and each step reads the W_eff.
        ``lookup_only``: served tensors a decode step reads a few rows of, not
        whole (an embedding the output head is not tied to, or whose head is
        served packed). ``stored``: projections the checkpoint stores as NVFP4."""
        modules = {key.module_name for key in keys}
        encoded = {key.weight_name: _bf16_nbytes_of_packed(before[key.weight_name]) for key in stored}
        projection_before = sum(encoded.get(key.weight_name) or _nbytes(before[key.weight_name]) for key in keys)
        projection_after = unique_nbytes(t for name, t in served.items() if name.rsplit(".", 1)[0] in modules)
        stored_modules = {key.module_name for key in stored}
        unquantized = (t for name, t in before.items() if name.rsplit(".", 1)[0] not in stored_modules)
        decode_before = unique_nbytes(unquantized) + sum(encoded.values())
        decode_after = unique_nbytes(t for name, t in served.items() if name not in lookup_only)
        return cls(
            path=path, blocks=blocks, num_layers=num_layers, rank=rank, quant=quant,
            projections=len(keys), quantized=quantized,
            projection_bytes_before=projection_before, projection_bytes_after=projection_after,
            decode_bytes_before=decode_before,
            decode_bytes_after=decode_before if folded else decode_after,
            source=source, layer_errors=dict(layer_errors),
            extra_resident_bytes=projection_before if folded else 0, head=head,
        )  # fmt: skip

    @property
    def theta_error_mean(self) -> float:
        return sum(self.layer_errors.values()) / len(self.layer_errors) if self.layer_errors else 0.0

    @property
    def theta_error_max(self) -> float:
        return max(self.layer_errors.values(), default=0.0)

    def theta_warning(self) -> str | None:
        """A warning when theta's reconstruction error is large enough to change
        the model's predictions more than NVFP4 does; None otherwise."""
        if self.blocks == self.num_layers or self.theta_error_max <= THETA_ERROR_WARNING:
            return None
        return (
            f"attnquant: the served model departs from the checkpoint: theta G={self.blocks}/{self.num_layers} "
            f"R={self.rank} rebuilds its layers with a relative error of {self.theta_error_mean:.3g} on average, "
            f"{self.theta_error_max:.3g} at worst (above {THETA_ERROR_WARNING}). Measure what it does to the "
            f"predictions with `attnquant verify --blocks {self.blocks} --rank {self.rank} --quant {self.quant}` "
            f"before serving it; docs/quality.md prices each setting."
        )

    def line(self, prefix: str = LOAD_PREFIX) -> str:
        passthrough = self.blocks == self.num_layers
        theta = "passthrough" if passthrough else f"R={self.rank}"
        resident = self.projection_bytes_after + self.extra_resident_bytes
        folded = (
            f" + {self.extra_resident_bytes / 2**20:.1f} MiB W_eff folded by MAX at load"
            if self.extra_resident_bytes
            else ""
        )
        errors = (
            ""
            if passthrough
            else f"; theta error per layer mean {self.theta_error_mean:.3g} max {self.theta_error_max:.3g}"
        )
        return (
            f"{prefix} path={self.path} theta G={self.blocks}/{self.num_layers} ({theta}) "
            f"quant={self.quant}{' ' + self.head if self.head else ''}; NVFP4 {self.quantized}/{self.projections} "
            "projections; projection "
            f"bytes {self.projection_bytes_before / 2**20:.1f} MiB -> {self.projection_bytes_after / 2**20:.1f} MiB"
            f"{folded} ({self.projection_bytes_before / max(resident, 1):.2f}x); weights per decode token "
            f"{self.decode_bytes_before / 2**30:.2f} GiB -> {self.decode_bytes_after / 2**30:.2f} GiB"
            f"{errors}; {self.source}"
        )


def unique_nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct tensor objects (an aliased W0 counts once)."""
    return sum(_nbytes(t) for t in {id(t): t for t in tensors}.values())


def _bf16_nbytes_of_packed(packed: torch.Tensor) -> int:
    """Bytes of the bf16 [N, K] weight that [N, K/2] packed E2M1 pairs encode."""
    return packed.numel() * 2 * 2


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
