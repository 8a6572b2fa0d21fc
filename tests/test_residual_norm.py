"""Which residual norm a model's layers use (attnquant.graph.residual_norm): no graph compiled."""

from __future__ import annotations

import logging
import struct

import pytest
from max.dtype import DType

from attnquant.config import AttnQuantConfig
from attnquant.graph import residual_norm as rn



@pytest.mark.parametrize(
    ("config", "ok", "why"),
    [
        (rn.NormKernelConfig(5376, DType.bfloat16, "cuda"), True, "auto: an NVIDIA GPU"),
        (rn.NormKernelConfig(640, DType.float32, "cuda", True), True, "ATTNQUANT_NORM_KERNEL=1"),
        (rn.NormKernelConfig(5376, DType.bfloat16, "cuda", False), False, "ATTNQUANT_NORM_KERNEL=0"),
        (rn.NormKernelConfig(5376, DType.bfloat16, "cpu"), False, "this device is cpu"),
        (rn.NormKernelConfig(5376, DType.bfloat16, "hip", True), False, "this device is hip"),
        (rn.NormKernelConfig(5376, DType.int8, "cuda"), False, "activations are int8"),
        (rn.NormKernelConfig(5380, DType.bfloat16, "cuda"), False, "hidden size 5380: the kernel takes a multiple of 8 up to 8192"),
        (rn.NormKernelConfig(8200, DType.bfloat16, "cuda"), False, "hidden size 8200"),
        (rn.NormKernelConfig(8192, DType.bfloat16, "cuda"), True, "auto"),
    ],
)
def test_the_kernel_serves_what_it_can_take_and_says_why_not(config: rn.NormKernelConfig, ok: bool, why: str) -> None:
    got, reason = rn.can_use_kernel(config)
    assert got is ok and why in reason, reason


def test_the_choice_is_logged_once_per_config(caplog: pytest.LogCaptureFixture) -> None:
    rn.choose_norm_kernel.cache_clear()
    config = rn.NormKernelConfig(1152, DType.bfloat16, "cpu")
    with caplog.at_level(logging.INFO):
        assert rn.choose_norm_kernel(config) == rn.NormKernel(False)
        assert not rn.choose_norm_kernel(config)
    lines = [r.getMessage() for r in caplog.records if "residual norms" in r.getMessage()]
    assert lines == ["attnquant: residual norms (hidden 1152, bfloat16, cpu): MAX's ops (the kernel runs on NVIDIA GPUs, this device is cpu)"]


@pytest.mark.parametrize(
    "arch, pdl, why",
    [
        ("sm_90a", True, "attnquant's kernel (auto: an NVIDIA GPU, the hidden size fits; programmatic dependent launch (ATTNQUANT_PDL=1))"),
        ("sm_86", False, "ATTNQUANT_PDL=1 not taken: needs sm_90+, device is sm_86"),
    ],
)
def test_pdl_is_taken_on_sm90_and_said_otherwise(caplog: pytest.LogCaptureFixture, arch: str, pdl: bool, why: str) -> None:
    rn.choose_norm_kernel.cache_clear()
    config = rn.NormKernelConfig(5376, DType.bfloat16, "cuda", None, arch, pdl=True)
    with caplog.at_level(logging.INFO):
        assert rn.choose_norm_kernel(config) == rn.NormKernel(True, pdl)
    assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert rn.choose_norm_kernel(rn.NormKernelConfig(5376, DType.bfloat16, "cuda", None, arch)).pdl is False


def test_the_setting_is_read_from_the_environment() -> None:
    assert AttnQuantConfig.from_env({}).norm_kernel is None
    assert AttnQuantConfig.from_env({"ATTNQUANT_NORM_KERNEL": "0"}).norm_kernel is False
    with pytest.raises(ValueError, match="ATTNQUANT_NORM_KERNEL"):
        AttnQuantConfig.from_env({"ATTNQUANT_NORM_KERNEL": "fast"})


@pytest.mark.parametrize("value", [1e-6, 1e-5, 0.0, 1.0, -0.5])
def test_epsilons_and_offsets_travel_as_float32_bits(value: float) -> None:
    bits = rn._float_bits(value)
    assert struct.unpack("<f", struct.pack("<i", bits))[0] == struct.unpack("<f", struct.pack("<f", value))[0]
