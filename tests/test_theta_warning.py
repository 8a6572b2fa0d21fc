"""The load line's theta warning: a dial setting that rebuilds the layers
badly is named on load, the default (passthrough) never is."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from max.dtype import DType

from attnquant.config import LOGGER_NAME, AttnQuantConfig
from attnquant.load.checkpoint import load_state_dict
from attnquant.load.pipeline import prepare_weights
from attnquant.load.report import THETA_ERROR_WARNING


def load_messages(
    directory: Path, config: AttnQuantConfig, caplog: pytest.LogCaptureFixture
) -> tuple[list[str], list[str], float]:
    """(info lines, warning lines, worst layer error) of one load of ``directory``."""
    state = load_state_dict(directory)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        prepared = prepare_weights(
            state, config, checkpoint_files=sorted(directory.glob("*.safetensors")), num_layers=2,
            dtype=DType.float32, device_api="cpu",
        )  # fmt: skip
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return infos, warnings, prepared.report.theta_error_max


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_passthrough_never_warns(tiny_gemma3_dir: Path, tmp_path: Path, quant: str,
                                 caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    config = AttnQuantConfig(quant=quant, cache_dir=tmp_path)
    infos, warnings, worst = load_messages(tiny_gemma3_dir, config, caplog)
    assert worst == 0.0
    assert any("theta G=2/2 (passthrough)" in line for line in infos)
    assert not [w for w in warnings if "departs from the checkpoint" in w]


def test_far_below_the_layer_count_warns_with_the_command(
    tiny_gemma3_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Two random layers share almost nothing: one band at rank 4 rebuilds them badly.
    config = AttnQuantConfig(blocks=1, rank=4, quant="nvfp4", cache_dir=tmp_path)
    _, warnings, worst = load_messages(tiny_gemma3_dir, config, caplog)
    assert worst > THETA_ERROR_WARNING
    (warning,) = [w for w in warnings if "departs from the checkpoint" in w]
    assert "theta G=1/2 R=4" in warning
    assert f"{worst:.3g} at worst" in warning
    assert "attnquant verify --blocks 1 --rank 4 --quant nvfp4" in warning
    # The second load is a cache hit; the warning comes with it, from the cached errors.
    _, again, _ = load_messages(tiny_gemma3_dir, config, caplog)
    assert [w for w in again if "departs from the checkpoint" in w] == [warning]


def test_exact_rank_below_the_layer_count_does_not_warn(
    tiny_gemma3_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Full rank rebuilds every layer to bf16 rounding: below the threshold.
    full_rank = max(min(t.shape) for n, t in load_state_dict(tiny_gemma3_dir).items() if n.endswith("proj.weight"))
    config = AttnQuantConfig(blocks=1, rank=full_rank, quant="none", cache_dir=tmp_path)
    _, warnings, worst = load_messages(tiny_gemma3_dir, config, caplog)
    assert 0.0 < worst <= THETA_ERROR_WARNING
    assert not [w for w in warnings if "departs from the checkpoint" in w]
    assert torch.isfinite(torch.tensor(worst))
