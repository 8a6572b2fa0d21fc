"""Reading a Hugging Face checkpoint directory (safetensors + config.json)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

# Besides names, sizes and headers, the identity hashes a few small windows of
# each file's tensor data: a fine-tune keeps every shape (so every header) but
# changes the bytes everywhere, and three 64 KiB reads per file stay fast.
_SAMPLE_BYTES = 64 * 1024
_SAMPLE_POINTS = (0.0, 0.5, 1.0)
_HEADER_LENGTH_BYTES = 8
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def _existing_dir(model_dir: Path | str) -> Path:
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist or is not a directory")
    return directory


def safetensors_files(model_dir: Path | str) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, sorted by name.

    Raises:
        ValueError: for a missing or unreadable directory, or one without
            safetensors files.
    """
    directory = _existing_dir(model_dir)
    try:
        files = sorted(directory.glob("*.safetensors"))
    except OSError as error:
        raise ValueError(f"cannot list checkpoint directory {directory}: {error}") from error
    if not files:
        raise ValueError(
            f"no *.safetensors files in {directory}; attnquant reads Hugging Face "
            f"safetensors checkpoints (convert .bin weights first)"
        )
    return files


def load_state_dict(model_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in the directory (CPU).

    Raises:
        ValueError: as :func:`safetensors_files`, and for an unreadable or
            corrupt file or a tensor name found in two files.
    """
    state_dict: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in state_dict:
                        raise ValueError(f"tensor {name!r} is in both {origin[name]} and {path}")
                    state_dict[name] = f.get_tensor(name)
                    origin[name] = path
        except ValueError:
            raise
        except Exception as error:  # safetensors raises SafetensorError, OSError...
            raise ValueError(f"cannot read checkpoint file {path}: {error}") from error
    return state_dict


# Bytes per element of the safetensors dtype names a Gemma checkpoint uses.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


def tensor_shapes(model_dir: Path | str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each tensor's shape and bytes per element, from the safetensors
    headers alone (no tensor data is read: seconds for a 60 GB checkpoint).

    Raises:
        ValueError: as :func:`safetensors_files`, for a file that is not
            safetensors, or for a dtype this table does not know.
    """
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for path in safetensors_files(model_dir):
        with path.open("rb") as f:
            header = json.loads(_read_header(f, path, path.stat().st_size))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPE_BYTES:
                raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, unknown to attnquant")
            shapes[name] = (tuple(info["shape"]), _DTYPE_BYTES[info["dtype"]])
    return shapes


def read_config(model_dir: Path | str) -> dict[str, Any]:
    """The directory's ``config.json``.

    Raises:
        ValueError: when it is missing, unreadable or not a JSON object.
    """
    path = _existing_dir(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ValueError(f"no config.json in checkpoint directory {model_dir}") from error
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def checkpoint_identity(model_dir: Path | str) -> str:
    """A fast content hash of the checkpoint, for cache keys.

    Covers each safetensors file's name, size, header (names, dtypes, shapes,
    offsets) and three 64 KiB samples of its data, plus config.json. It
    reads well under a megabyte per file, whatever the model size; it does
    not notice an in-place edit that keeps every header and sampled byte.

    Raises:
        ValueError: as :func:`safetensors_files`, or for a file that is not
            safetensors.
    """
    digest = hashlib.sha256()
    for path in safetensors_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            header = _read_header(f, path, size)
            digest.update(header)
            data_start = _HEADER_LENGTH_BYTES + len(header)
            for point in _SAMPLE_POINTS:
                f.seek(data_start + int(point * max(0, size - data_start - _SAMPLE_BYTES)))
                digest.update(f.read(_SAMPLE_BYTES))
    config = Path(model_dir) / "config.json"
    if config.is_file():
        digest.update(b"config.json\0" + config.read_bytes())
    return digest.hexdigest()


def _read_header(f: Any, path: Path, size: int) -> bytes:
    raw_length = f.read(_HEADER_LENGTH_BYTES)
    if len(raw_length) < _HEADER_LENGTH_BYTES:
        raise ValueError(f"{path} is too short to be a safetensors file ({size} bytes)")
    (length,) = struct.unpack("<Q", raw_length)
    if length > min(_MAX_HEADER_BYTES, size - _HEADER_LENGTH_BYTES):
        raise ValueError(f"{path} is not a valid safetensors file (header length {length})")
    return f.read(length)
