"""The output head our architectures serve comes from the right tensor.

A checkpoint whose config unties the head (``tie_word_embeddings: false``)
has its own ``lm_head.weight``: attnquant serves that tensor (bf16) or
quantizes it (``ATTNQUANT_LM_HEAD=nvfp4``), never the embedding. A tied
checkpoint's head is the embedding. Loads run the pipeline MAX's Gemma 3
architecture calls, on its names (``models.gemma3.weight_adapters``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from max.dtype import DType

from attnquant.config import AttnQuantConfig
from attnquant.formats import nvfp4
from attnquant.load import pipeline
from attnquant.load.checkpoint import load_state_dict
from models.gemma3.model import output_head
from models.gemma3.weight_adapters import to_max_name
from tests.conftest import TINY_GEMMA3

HEAD = "language_model.lm_head"
EMBEDDING = "language_model.embed_tokens.weight"


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    tensors: dict[str, torch.Tensor]


def _checkpoint(directory: Path, *, tied: bool) -> Checkpoint:
    """A random bf16 Gemma 3 (2 layers), written and read back under MAX's names."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(1)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**TINY_GEMMA3, tie_word_embeddings=tied)).to(torch.bfloat16)
    model.save_pretrained(directory)
    return Checkpoint(directory, {to_max_name(name): t for name, t in load_state_dict(directory).items()})


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    checkpoint = _checkpoint(tmp_path_factory.mktemp("untied"), tied=False)
    assert f"{HEAD}.weight" in checkpoint.tensors
    assert not torch.equal(checkpoint.tensors[f"{HEAD}.weight"], checkpoint.tensors[EMBEDDING])
    return checkpoint


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    checkpoint = _checkpoint(tmp_path_factory.mktemp("tied"), tied=True)
    assert f"{HEAD}.weight" not in checkpoint.tensors
    return checkpoint


def _load(checkpoint: Checkpoint, tmp_path: Path, *, tied: bool, lm_head: str) -> pipeline.PreparedWeights:
    config = AttnQuantConfig(quant="nvfp4", lm_head=lm_head, cache_dir=tmp_path / "cache")
    return pipeline.prepare_weights(
        checkpoint.tensors, config, checkpoint_files=sorted(checkpoint.directory.glob("*.safetensors")), num_layers=2,
        dtype=DType.float32, device_api="cpu", head=output_head(tied),
    )  # fmt: skip


def _served_head(prepared: pipeline.PreparedWeights) -> torch.Tensor:
    """The head's weight as served: dequantized when it is NVFP4."""
    served = prepared.state_dict
    if served[f"{HEAD}.weight"].dtype != torch.uint8:
        return served[f"{HEAD}.weight"].float()
    packed = nvfp4.NVFP4Weight(
        served[f"{HEAD}.weight"],
        served[f"{HEAD}.weight_scale"].view(torch.float8_e4m3fn),
        served[f"{HEAD}.weight_scale_2"].reshape(()),
    )
    return nvfp4.dequantize(packed)


def _relative_error(served: torch.Tensor, source: torch.Tensor) -> float:
    source = source.float()
    return float((served - source).norm() / source.norm())


def test_an_untied_nvfp4_head_is_quantized_from_the_checkpoints_head(untied, tmp_path: Path) -> None:
    prepared = _load(untied, tmp_path, tied=False, lm_head="nvfp4")
    head = _served_head(prepared)
    assert prepared.plan[HEAD][0].kind == "nvfp4" and "lm_head=nvfp4" in prepared.report.line()
    assert _relative_error(head, untied.tensors[f"{HEAD}.weight"]) < 0.15  # NVFP4's rounding of this tensor
    assert _relative_error(head, untied.tensors[EMBEDDING]) > 0.9  # an independent random tensor


def test_an_untied_bf16_head_is_the_checkpoints_head(untied, tmp_path: Path) -> None:
    prepared = _load(untied, tmp_path, tied=False, lm_head="bf16")
    assert torch.equal(_served_head(prepared), untied.tensors[f"{HEAD}.weight"].float())
    assert prepared.plan[HEAD][0].shared_with == ""  # its own tensor, not an alias of the embedding


@pytest.mark.parametrize("lm_head", ["bf16", "nvfp4"])
def test_a_tied_head_is_the_embedding(tied, tmp_path: Path, lm_head: str) -> None:
    prepared = _load(tied, tmp_path, tied=True, lm_head=lm_head)
    assert _relative_error(_served_head(prepared), tied.tensors[EMBEDDING]) < (0.15 if lm_head == "nvfp4" else 1e-7)
    assert prepared.plan[HEAD][0].shared_with == (EMBEDDING if lm_head == "bf16" else "")


def test_an_untied_config_without_a_head_weight_is_refused(untied, tmp_path: Path) -> None:
    headless = {name: t for name, t in untied.tensors.items() if not name.startswith(HEAD)}
    with pytest.raises(ValueError, match=f"has no {HEAD}.weight .*set tie_word_embeddings in config.json"):
        _load(dataclasses.replace(untied, tensors=headless), tmp_path, tied=False, lm_head="nvfp4")
