"""Where load-time preparation runs (attnquant/prepare_device.py) and its CPU fallback.

CI has no GPU: the GPU itself is exercised on the H200 (bench/checks/prepare_device_check.py,
and every NVFP4 server's first load there); here the choice, the errors and the
fallback are checked with torch's CUDA queries patched.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from attnquant.formats.names import find_projections
from attnquant.load import pipeline as loading, prepare_device
from attnquant.load.checkpoint import load_state_dict
from attnquant.config import AttnQuantConfig
from attnquant.load.precompute import precompute_outside


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    """Pretend torch sees ``n`` GPUs."""

    def see(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return see


@pytest.mark.parametrize("setting", ["auto", "gpu"])
def test_the_serving_gpu_when_torch_can_use_it(gpus, setting: str) -> None:
    gpus(2)
    chosen = prepare_device.choose(setting, "cuda", 1)
    assert chosen.device == torch.device("cuda", 1) and chosen.is_gpu
    assert f"ATTNQUANT_PREPARE_DEVICE={setting}" in chosen.reason


@pytest.mark.parametrize(
    ("api", "serving_id", "seen", "why"),
    [
        ("cpu", 0, 1, "serving on cpu"),
        ("cuda", 0, 0, "no usable CUDA/ROCm device"),
        ("hip", 1, 1, "torch sees 1 GPU(s), serving on GPU 1"),
    ],
)
def test_auto_falls_back_to_the_cpu_and_says_why(gpus, api: str, serving_id: int, seen: int, why: str) -> None:
    gpus(seen)
    chosen = prepare_device.choose("auto", api, serving_id)
    assert chosen.device == torch.device("cpu") and not chosen.is_gpu
    assert why in chosen.reason


def test_gpu_required_but_unusable_names_the_setting_and_the_fix(gpus) -> None:
    gpus(0)
    with pytest.raises(ValueError, match=r"ATTNQUANT_PREPARE_DEVICE=gpu.*Install a CUDA .*auto or cpu"):
        prepare_device.choose("gpu", "cuda", 0)


def test_cpu_setting_wins_even_with_a_gpu(gpus) -> None:
    gpus(1)
    assert prepare_device.choose("cpu", "cuda", 0).device == torch.device("cpu")


def test_setting_is_validated() -> None:
    assert AttnQuantConfig.from_env({}).prepare_device == "auto"
    with pytest.raises(ValueError, match="ATTNQUANT_PREPARE_DEVICE='tpu' is invalid; allowed: auto, cpu, gpu"):
        AttnQuantConfig.from_env({"ATTNQUANT_PREPARE_DEVICE": "tpu"})


def _failing_on_gpu(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """precompute_outside raising a CUDA-like RuntimeError off the CPU; returns the devices tried."""
    tried: list[torch.device] = []

    def fake(projections, config, *, keys=None, head=None, importance=None, device=prepare_device.CPU, progress=True):
        tried.append(device)
        if device.type != "cpu":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
        return precompute_outside(projections, config, progress=False)

    monkeypatch.setattr(loading, "precompute_outside", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return tried


def test_auto_retries_on_the_cpu_after_a_gpu_failure(
    tiny_gemma3_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tried = _failing_on_gpu(monkeypatch)
    config = AttnQuantConfig(quant="nvfp4")
    gpu = prepare_device.PrepareDevice(torch.device("cuda", 0), "test")
    state = load_state_dict(tiny_gemma3_dir)
    with caplog.at_level(logging.WARNING, logger="max.pipelines.attnquant"):
        served = loading._precompute_on(gpu, state, find_projections(state), config, None, {})
    assert [d.type for d in tried] == ["cuda", "cpu"]
    assert "preparing weights on cuda:0 failed (CUDA out of memory. Tried to allocate 2.00 GiB)" in caplog.text
    assert served.state_dict.keys() == precompute_outside(state, config, progress=False).state_dict.keys()


def test_gpu_required_does_not_fall_back(tiny_gemma3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_on_gpu(monkeypatch)
    gpu = prepare_device.PrepareDevice(torch.device("cuda", 0), "test")
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        state = load_state_dict(tiny_gemma3_dir)
        config = AttnQuantConfig(quant="nvfp4", prepare_device="gpu")
        loading._precompute_on(gpu, state, find_projections(state), config, None, {})


def test_unquantized_passthrough_projections_are_not_copied(tiny_gemma3_dir: Path) -> None:
    state = load_state_dict(tiny_gemma3_dir)
    served = precompute_outside(
        state, AttnQuantConfig(quant="nvfp4", quant_ignore=("self_attn",)), progress=False, device=torch.device("cpu")
    ).state_dict
    attention = [name for name in state if ".self_attn." in name and name.endswith("_proj.weight")]
    assert attention and all(served[name] is state[name] for name in attention)
    assert all(t.device.type == "cpu" for t in served.values())


def test_device_check_warmup_is_a_checkpoint_preparation_accepts(tiny_gemma3_dir: Path) -> None:
    """bench/checks/prepare_device_check.py's warm-up slice is prepared, on the CPU here,
    whatever order the projections come in (a warm-up holding one layer-1
    tensor would be refused)."""
    from tests.bench_modules import bench_module

    check = bench_module("prepare_device_check")
    state = check.first_layers(tiny_gemma3_dir, 2)
    warmup = check.warmup_slice(dict(reversed(list(state.items()))))
    assert warmup and all(".layers.0." in name and t.shape[0] <= 16 for name, t in warmup.items())
    config = AttnQuantConfig(quant="nvfp4", cache=False)
    served = precompute_outside(warmup, config, progress=False, device=torch.device("cpu")).state_dict
    codes = [name for name, t in served.items() if t.dtype == torch.uint8]  # one NVFP4 code tensor each
    assert len(codes) == len(warmup) == 7  # q, k, v, o, gate, up, down
