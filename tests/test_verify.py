"""``attnquant verify``: the metrics, the windows, the text, and both logit paths.

The metric tests check :class:`Comparison` against independent formulas
(torch's ``kl_div`` and ``cross_entropy``). The transformers-path tests run
the real Gemma 3 270M on a few windows. The MAX tests (``-m max``) build
our MAX architecture with all-position logits, passthrough only: one graph,
shared by the identical-model, perturbed-model and cross-check tests.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from attnquant.tools import verify
from attnquant.load.checkpoint import load_state_dict, safetensors_files
from attnquant.tools.cli import build_parser, main
from attnquant.tools.corpus import DEFAULT_TEXT_PATH, default_text, load_text
from attnquant.tools.demo_model import ensure_demo_model

JSON_KEYS = {
    "kl_mean", "kl_median", "kl_p99", "top1_agreement",
    "ppl_ref", "ppl_quant", "max_abs_logit_diff", "tokens",
}  # fmt: skip


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_demo_model()


@pytest.fixture(scope="session")
def windows(model_dir: Path) -> list[list[int]]:
    """Two windows of the default text: 2 x 47 scored predictions."""
    return verify.text_windows(model_dir, default_text(), window=48, tokens=94)


@pytest.fixture(scope="session")
def perturbed_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with Gaussian noise (5% of each tensor's RMS) added to
    every MLP down projection; same names, shapes and dtypes."""
    out = tmp_path_factory.mktemp("perturbed")
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    generator = torch.Generator().manual_seed(0)
    state = load_state_dict(model_dir)
    for name, tensor in state.items():
        if name.endswith("mlp.down_proj.weight"):
            weight = tensor.float()
            noise = torch.randn(weight.shape, generator=generator) * weight.pow(2).mean().sqrt()
            state[name] = (weight + 0.05 * noise).to(tensor.dtype)
    save_file(state, str(out / safetensors_files(model_dir)[0].name), metadata={"format": "pt"})
    return out


def _fixed(logits: torch.Tensor):
    """A logit source returning ``logits`` rows for a window of that length."""

    def source(window: Sequence[int]) -> torch.Tensor:
        assert len(window) == logits.shape[0]
        return logits

    return source


# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def test_identical_logits_give_zero_kl_and_full_agreement() -> None:
    logits = torch.randn(40, 1000) * 3
    report = verify.compare(_fixed(logits), _fixed(logits.clone()), [list(range(40))])
    assert report.kl_mean == report.kl_median == report.kl_p99 == 0.0
    assert report.top1_agreement == 100.0
    assert report.ppl_ref == report.ppl_quant
    assert report.max_abs_logit_diff == 0.0
    assert report.tokens == 39  # the last position has no target


def test_metrics_match_independent_formulas() -> None:
    torch.manual_seed(0)
    ref, quant = torch.randn(2, 200, 500) * 2
    quant = ref + 0.5 * quant  # related, so top-1 agrees sometimes
    targets = torch.randint(0, 500, (200,))
    comparison = verify.Comparison()
    comparison.add(ref, quant, targets)
    report = comparison.report()

    log_p = torch.log_softmax(ref.double(), -1)
    log_q = torch.log_softmax(quant.double(), -1)
    kl = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    assert report.kl_mean == pytest.approx(float(kl.mean()), rel=1e-9)
    assert report.kl_p99 == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-9)
    assert report.kl_mean > 0.05
    agree = (ref.argmax(-1) == quant.argmax(-1)).double().mean() * 100
    assert report.top1_agreement == pytest.approx(float(agree))
    assert 0 < report.top1_agreement < 100
    ce = torch.nn.functional.cross_entropy(ref.double(), targets)
    assert report.ppl_ref == pytest.approx(math.exp(float(ce)), rel=1e-9)
    assert report.max_abs_logit_diff == pytest.approx(float((ref - quant).abs().max()), rel=1e-6)
    assert report.tokens == 200


def test_comparison_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="shapes differ"):
        verify.Comparison().add(torch.zeros(3, 10), torch.zeros(3, 11), torch.zeros(3))


def test_windows_score_exactly_the_requested_tokens() -> None:
    ids = list(range(100, 200))
    windows = verify.token_windows(ids, bos=2, window=8, tokens=30)
    assert all(w[0] == 2 and len(w) <= 8 for w in windows)
    assert [t for w in windows for t in w[1:]] == ids[:30]
    assert sum(len(w) - 1 for w in windows) == 30
    with pytest.raises(ValueError, match="more than the text has"):
        verify.token_windows(ids, bos=2, window=8, tokens=101)


def test_reference_drops_weight_settings_and_flags_override_the_environment() -> None:
    env = {"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_BLOCKS": "6", "ATTNQUANT_CACHE": "0", "X": "1"}
    assert verify.reference_env(env) == {"ATTNQUANT_CACHE": "0", "X": "1"}
    args = verify_args("--quant", "none", "--ignore", "mlp", "o_proj", "--scale-search", "mse")
    candidate = verify.candidate_env(args, env)
    assert candidate["ATTNQUANT_QUANT"] == "none"
    assert candidate["ATTNQUANT_QUANT_IGNORE"] == "mlp,o_proj"
    assert candidate["ATTNQUANT_SCALE_SEARCH"] == "mse"
    assert candidate["ATTNQUANT_BLOCKS"] == "6"  # not a flag: the environment's stands
    assert verify.candidate_env(verify_args(), {})["ATTNQUANT_QUANT"] == "nvfp4"


def test_attnquant_environ_sets_only_attnquant_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNQUANT_QUANT", "nvfp4")
    monkeypatch.setenv("ATTNQUANT_RANK", "4")
    with verify._attnquant_environ({"ATTNQUANT_RANK": "8", "PATH": "/nowhere"}):
        assert "ATTNQUANT_QUANT" not in os.environ
        assert os.environ["ATTNQUANT_RANK"] == "8"
        assert os.environ["PATH"] != "/nowhere"
    assert os.environ["ATTNQUANT_QUANT"] == "nvfp4" and os.environ["ATTNQUANT_RANK"] == "4"


def verify_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["verify", *argv])


# ---------------------------------------------------------------------------
# The text
# ---------------------------------------------------------------------------


def test_default_text_is_the_pinned_novel_and_long_enough(model_dir: Path) -> None:
    text = default_text()
    assert text.body.startswith("CHAPTER I\nBecause of an hereditary recklessness")
    assert text.body.rstrip().endswith("--(THE END)--")
    assert "Gutenberg" not in text.body  # header and licence stripped
    windows = verify.text_windows(model_dir, text, window=512, tokens=verify.DEFAULT_TOKENS)
    assert sum(len(w) - 1 for w in windows) == verify.DEFAULT_TOKENS >= 20_000


def test_text_file_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read --text"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_text(tmp_path / "empty.txt")
    assert DEFAULT_TEXT_PATH.is_file()


# ---------------------------------------------------------------------------
# The transformers path (real Gemma 3 270M, a few windows)
# ---------------------------------------------------------------------------


def test_transformers_identical_models_agree_exactly(model_dir: Path, windows) -> None:
    source = verify.transformers_source(model_dir, {})
    report = verify.compare(source, verify.transformers_source(model_dir, {}), windows)
    assert report.kl_mean == report.kl_p99 == report.max_abs_logit_diff == 0.0
    assert report.top1_agreement == 100.0
    assert report.ppl_ref == report.ppl_quant
    assert 1 < report.ppl_ref < 1000  # a real model on real text


def test_transformers_perturbed_weights_give_positive_kl(
    model_dir: Path, perturbed_model_dir: Path, windows
) -> None:
    reference = verify.transformers_source(model_dir, {})
    report = verify.compare(reference, verify.transformers_source(perturbed_model_dir, {}), windows)
    assert report.kl_mean > 1e-3
    assert report.max_abs_logit_diff > 0.1


def test_cli_json_has_every_key(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    argv = ["verify", str(model_dir), "--reference", "transformers", "--json"]
    assert main([*argv, "--tokens", "40", "--window", "41", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == JSON_KEYS
    assert report["tokens"] == 40
    assert report["kl_mean"] > 0  # NVFP4 on every projection moves the distribution
    assert report["top1_agreement"] <= 100


def test_cli_rejects_bad_values(capsys: pytest.CaptureFixture[str], model_dir: Path) -> None:
    argv = ["verify", str(model_dir), "--reference", "transformers"]
    assert main([*argv, "--tokens", "10000000"]) == 2
    assert "more than the text has" in capsys.readouterr().err
    assert main(["verify", str(model_dir), "--window", "2048"]) == 2
    assert "--window must be below 1024" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# The MAX path: one graph (passthrough, all-position logits)
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def max_reference(model_dir: Path) -> verify.MaxSource:
    return verify.MaxSource(model_dir, verify.reference_env(os.environ))


@pytest.mark.max
def test_max_identical_models_agree_exactly(max_reference, model_dir: Path, windows) -> None:
    again = verify.MaxSource(model_dir, verify.reference_env(os.environ))
    report = verify.compare(max_reference, again, windows)
    assert report.kl_mean == report.kl_p99 == report.max_abs_logit_diff == 0.0
    assert report.top1_agreement == 100.0


@pytest.mark.max
def test_max_perturbed_weights_give_positive_kl(
    max_reference, perturbed_model_dir: Path, windows
) -> None:
    perturbed = verify.MaxSource(perturbed_model_dir, verify.reference_env(os.environ))
    report = verify.compare(max_reference, perturbed, windows)
    assert report.kl_mean > 1e-3


@pytest.mark.max
def test_max_logits_match_transformers(max_reference, model_dir: Path, windows) -> None:
    """Every position's full row, not just the last: the MAX path is exact."""
    report = verify.compare(verify.transformers_source(model_dir, {}), max_reference, windows)
    assert report.kl_mean < 1e-4
    assert report.top1_agreement >= 99
    assert report.ppl_quant == pytest.approx(report.ppl_ref, rel=1e-3)
