"""ATTNQUANT_* parsing, error messages, and docs/configuration.md in step."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from attnquant.config import SETTINGS, AttnQuantConfig, settings_markdown_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_defaults() -> None:
    config = AttnQuantConfig.from_env({"XDG_CACHE_HOME": "/xdg"})
    assert config == AttnQuantConfig(cache_dir=Path("/xdg/attnquant"))
    assert (config.blocks, config.rank, config.quant, config.gemm, config.quant_ignore) == (
        None,
        16,
        "none",
        None,
        (),
    )
    assert AttnQuantConfig.from_env({}).cache_dir == Path("~/.cache/attnquant").expanduser()


def test_every_variable_is_read() -> None:
    env = {
        "ATTNQUANT_BLOCKS": "2",
        "ATTNQUANT_RANK": " 0 ",
        "ATTNQUANT_PRECOMPUTE_OUTSIDE": "off",
        "ATTNQUANT_PRECOMPUTE": "Yes",
        "ATTNQUANT_QUANT": "NVFP4",
        "ATTNQUANT_QUANT_IGNORE": "mlp, self_attn.o_proj,,mlp",
        "ATTNQUANT_SCALE_SEARCH": "mse",
        "ATTNQUANT_GEMM": "1",
        "ATTNQUANT_ROW_PADDING": "0",
        "ATTNQUANT_QKV_FUSE": "false",
        "ATTNQUANT_FUSED_MLP": "0",
        "ATTNQUANT_GATED_GEMV": "on",
        "ATTNQUANT_NORM_KERNEL": "off",
        "ATTNQUANT_PDL": "yes",
        "ATTNQUANT_LAYER_SUBGRAPHS": "CPU",
        "ATTNQUANT_CACHE": "no",
        "ATTNQUANT_CACHE_DIR": "/tmp/aq",
        "ATTNQUANT_LOG_LEVEL": "debug",
        "ATTNQUANT_LM_HEAD": "NVFP4",
        "ATTNQUANT_PREPARE_DEVICE": "cpu",
        "ATTNQUANT_NVFP4_DISPATCH": "gemv",
        "ATTNQUANT_SM90_VARIANT": "3:4:2",
        "ATTNQUANT_SM100_INPUT_SCALE": "2.5",
        "ATTNQUANT_DEMO_MODEL_DIR": "/tmp/demo",
        "ATTNQUANT_IGNORE_UNKNOWN": "1",
    }
    assert AttnQuantConfig.from_env(env) == AttnQuantConfig(
        blocks=2, rank=0, precompute_outside=False, precompute=True, quant="nvfp4",
        quant_ignore=("mlp", "self_attn.o_proj"), lm_head="nvfp4", scale_search="mse", prepare_device="cpu",
        nvfp4_dispatch="gemv", sm90_variant="3:4:2", sm100_input_scale=2.5, gemm=True, row_padding=False, qkv_fuse=False, fused_mlp=False,
        gated_gemv=True, norm_kernel=False, pdl=True, layer_subgraphs="cpu", cache=False,
        cache_dir=Path("/tmp/aq"), log_level="DEBUG", demo_model_dir=Path("/tmp/demo"), ignore_unknown=True,
    )  # fmt: skip
    assert set(env) == {setting.env for setting in SETTINGS}, "every setting is exercised here"
    assert AttnQuantConfig.from_env({"ATTNQUANT_GEMM": "auto", "ATTNQUANT_BLOCKS": ""}).gemm is None


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("ATTNQUANT_BLOCKS", "0", "integer >= 1"),
        ("ATTNQUANT_BLOCKS", "two", "integer >= 1"),
        ("ATTNQUANT_RANK", "-1", "integer >= 0"),
        ("ATTNQUANT_RANK", "1.5", "integer >= 0"),
        ("ATTNQUANT_QUANT", "fp8", "none, nvfp4"),
        ("ATTNQUANT_SCALE_SEARCH", "gptq", "rtn, mse"),
        ("ATTNQUANT_GEMM", "maybe", "auto, 1/0"),
        ("ATTNQUANT_ROW_PADDING", "64", "auto, 1/0"),
        ("ATTNQUANT_CACHE", "2", "1/0, true/false, yes/no, on/off"),
        ("ATTNQUANT_QUANT_IGNORE", "mlp,.o_proj", "dotted module-name fragments"),
        ("ATTNQUANT_LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR"),
        ("ATTNQUANT_LM_HEAD", "int4", "bf16, nvfp4"),
        ("ATTNQUANT_SM90_VARIANT", "fast", "variant[:kw[:splitk[:pdl]]]"),
        ("ATTNQUANT_SM100_INPUT_SCALE", "-1", "a number > 0"),
    ],
)
def test_invalid_value_names_variable_value_and_allowed(
    name: str, value: str, allowed: str
) -> None:
    with pytest.raises(ValueError) as error:
        AttnQuantConfig.from_env({name: value})
    assert f"{name}={value!r} is invalid; allowed: " in str(error.value)
    assert allowed in str(error.value)


def test_all_invalid_values_come_in_one_line() -> None:
    with pytest.raises(ValueError) as error:
        AttnQuantConfig.from_env({"ATTNQUANT_RANK": "x", "ATTNQUANT_QUANT": "int4", "ATTNQUANT_BLOCK": "2"})
    message = str(error.value)
    assert "\n" not in message
    assert "ATTNQUANT_RANK='x'" in message and "ATTNQUANT_QUANT='int4'" in message
    assert "ATTNQUANT_BLOCK is not an attnquant setting; did you mean ATTNQUANT_BLOCKS?" in message


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        ("ATTNQUANT_BLOCK", "ATTNQUANT_BLOCKS"),
        ("ATTNQUANT_QUANT_IGNROE", "ATTNQUANT_QUANT_IGNORE"),
        ("ATTNQUANT_CACHEDIR", "ATTNQUANT_CACHE_DIR"),
    ],
)
def test_unknown_name_is_an_error_with_the_closest_valid_name(typo: str, suggestion: str) -> None:
    """A misspelled variable would otherwise be ignored, and the server would
    compile for minutes a model configured otherwise than asked."""
    with pytest.raises(ValueError, match=f"{typo} is not an attnquant setting; did you mean {suggestion}\\?"):
        AttnQuantConfig.from_env({typo: "1", "OTHER_VARIABLE": "x"})
    # The escape hatch: a warning instead, the rest of the configuration read.
    with pytest.warns(UserWarning, match=f"{typo} is not an attnquant setting.*ATTNQUANT_IGNORE_UNKNOWN=1"):
        config = AttnQuantConfig.from_env({typo: "1", "ATTNQUANT_IGNORE_UNKNOWN": "1", "ATTNQUANT_RANK": "4"})
    assert config.rank == 4


def test_weight_fingerprint_has_exactly_the_weight_changing_fields() -> None:
    config = AttnQuantConfig(blocks=2, quant_ignore=("mlp",), gemm=True, cache=False)
    assert config.weight_fingerprint() == {
        "blocks": 2, "rank": 16, "precompute_outside": True, "quant": "none",
        "quant_ignore": ["mlp"], "lm_head": "bf16", "scale_search": "weighted",
    }  # fmt: skip
    # Settings that only change how weights run leave the fingerprint alone.
    assert (
        dataclasses.replace(config, gemm=False, qkv_fuse=False).weight_fingerprint()
        == config.weight_fingerprint()
    )


def test_describe_is_one_line_naming_every_field() -> None:
    line = AttnQuantConfig(quant="nvfp4", quant_ignore=("mlp", "o_proj")).describe()
    assert "\n" not in line
    assert (
        "blocks=layers" in line
        and "quant=nvfp4" in line
        and "quant_ignore=mlp,o_proj" in line
        and "gemm=auto" in line
    )
    assert all(f"{field.name}=" in line for field in dataclasses.fields(AttnQuantConfig))


def doc_table_rows() -> list[list[str]]:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `ATTNQUANT_")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]


def test_doc_table_is_in_step_with_the_dataclass() -> None:
    rows = doc_table_rows()
    documented = [re.fullmatch(r"`(ATTNQUANT_\w+)`", row[0])[1] for row in rows]
    assert documented == [setting.env for setting in SETTINGS]
    assert [setting.field for setting in SETTINGS] == [
        field.name for field in dataclasses.fields(AttnQuantConfig)
    ]
    for row, setting in zip(rows, SETTINGS, strict=True):
        assert row[1] == f"`{setting.default_text}`" and row[2] == setting.allowed and row[3]
    assert (
        settings_markdown_table() in DOC.read_text()
    ), "regenerate the table in docs/configuration.md"


def test_documented_defaults_are_the_parsed_defaults() -> None:
    defaults = AttnQuantConfig.from_env({})
    for setting in SETTINGS:
        value = getattr(defaults, setting.field)
        if (
            setting.default_text not in ("layer count", "auto", "(empty)", "(measured)")
            and setting.field not in ("cache_dir", "demo_model_dir")
        ):
            assert setting.parse(setting.default_text) == value, setting.env
    assert defaults == dataclasses.replace(AttnQuantConfig(), cache_dir=defaults.cache_dir)
