"""Reading a Hugging Face checkpoint directory (safetensors + config.json):
validation before anything maps a file, and the identity cache keys are made of."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from attnquant.config import LOGGER_NAME
from attnquant.files import atomic_file

logger = logging.getLogger(LOGGER_NAME)

_HEADER_LENGTH_BYTES = 8
_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_HASH_CHUNK = 64 * 2**20
# A fingerprint is reused only for a file whose stat is unchanged and was
# already this old when it was hashed: a write within the same timestamp tick
# as the hash could otherwise leave the stat unchanged (git's "racy" entries).
_SETTLED_SECONDS = 2.0
_FINGERPRINT_VERSION = 1

# Bytes per element of the safetensors dtype names a Gemma checkpoint uses.
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1,
}  # fmt: skip


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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a safetensors header describes it."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def element_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


def read_header(path: Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensors, checked against the file before anything maps it.

    Every tensor's byte range must lie inside the file's data section and
    match its dtype and shape, and the ranges must cover the data section
    exactly: a truncated or overwritten file fails here, in one line naming
    it, instead of crashing the process that maps it.

    Raises:
        ValueError: naming the file and what is wrong.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = _read_header_bytes(f, path, size)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a valid safetensors file (unreadable header: {error})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a valid safetensors file (the header is not a JSON object)")
    data_size = size - _HEADER_LENGTH_BYTES - len(raw)
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _entry(path, name, info, data_size)
    covered = sum(e.end - e.start for e in entries.values())
    largest_end = max((e.end for e in entries.values()), default=0)
    if largest_end < data_size or covered != data_size:
        raise ValueError(
            f"{path} is damaged: its tensors cover {covered} of the {data_size} data bytes the file holds; "
            "download or copy it again"
        )
    return entries


def _entry(path: Path, name: str, info: Any, data_size: int) -> TensorEntry:
    try:
        dtype, shape, (start, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, unknown to attnquant")
    entry = TensorEntry(dtype, shape, int(start), int(end))
    expected = math.prod(shape) * entry.element_bytes
    if not 0 <= entry.start <= entry.end or entry.end - entry.start != expected:
        raise ValueError(
            f"{path}: tensor {name!r} ({dtype} {list(shape)}) spans bytes {entry.start}..{entry.end}, "
            f"which is not its size of {expected} bytes"
        )
    if entry.end > data_size:
        raise ValueError(
            f"{path} is truncated: tensor {name!r} ends at data byte {entry.end}, the file holds "
            f"{data_size}; download or copy it again"
        )
    return entry


def check_files(paths: Iterable[Path | str]) -> None:
    """Validates every ``*.safetensors`` file among ``paths`` (:func:`read_header`)."""
    for path in map(Path, paths):
        if path.suffix == ".safetensors":
            read_header(path)


def load_state_dict(model_dir: Path | str) -> dict[str, torch.Tensor]:
    """Every tensor of every ``*.safetensors`` file in the directory (CPU).

    Raises:
        ValueError: as :func:`safetensors_files` and :func:`read_header`,
            and for a tensor name found in two files.
    """
    state_dict: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for path in safetensors_files(model_dir):
        read_header(path)
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


def tensor_shapes(model_dir: Path | str) -> dict[str, tuple[tuple[int, ...], int]]:
    """Each tensor's shape and bytes per element, from the (checked) headers
    alone: no tensor data is read, seconds for a 60 GB checkpoint."""
    shapes: dict[str, tuple[tuple[int, ...], int]] = {}
    for path in safetensors_files(model_dir):
        for name, entry in read_header(path).items():
            shapes[name] = (entry.shape, entry.element_bytes)
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


def checkpoint_identity(model_dir: Path | str, fingerprints: Path | None = None) -> str:
    """A hash of every byte of the checkpoint's safetensors files and its
    config.json: any change to any weight gives another identity.

    Files are hashed in 64 MiB chunks on every core (SHA-256; hashlib lets
    the threads run in parallel). ``fingerprints``: a directory where a
    file's hash is kept with its ``stat`` (device, inode, size, modification
    and change times in nanoseconds); it is reused only while all of those are
    unchanged and only if the file had settled before it was hashed, so an
    edit, a copy over it or a re-download always hashes again.

    Raises:
        ValueError: as :func:`safetensors_files` and :func:`read_header`.
    """
    digest = hashlib.sha256()
    for path in safetensors_files(model_dir):
        read_header(path)
        digest.update(f"{path.name}\0{file_fingerprint(path, fingerprints)}\0".encode())
    config = Path(model_dir) / "config.json"
    if config.is_file():
        digest.update(b"config.json\0" + config.read_bytes())
    return digest.hexdigest()


def file_fingerprint(path: Path, store: Path | None = None) -> str:
    """SHA-256 tree hash of the file's bytes (reused from ``store`` when provably current)."""
    stat = path.stat()
    record = store / f"{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]}.json" if store else None
    key = _stat_key(stat)
    if record is not None and record.is_file():
        try:
            saved = json.loads(record.read_text())
            if saved.get("stat") == key and saved.get("version") == _FINGERPRINT_VERSION:
                return str(saved["sha256"])
        except (OSError, ValueError, KeyError):
            pass  # unreadable: hash again and rewrite it
    started = time.time()
    fingerprint = hash_file(path)
    settled = started - max(stat.st_mtime, stat.st_ctime) >= _SETTLED_SECONDS
    if record is not None and settled and _stat_key(path.stat()) == key:
        record.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(record) as temporary:
            temporary.write_text(json.dumps({"version": _FINGERPRINT_VERSION, "path": str(path), "stat": key, "sha256": fingerprint}))
    return fingerprint


def hash_file(path: Path, chunk: int = _HASH_CHUNK) -> str:
    """SHA-256 over the SHA-256 of each ``chunk`` of the file, chunks hashed in parallel."""
    size = path.stat().st_size
    starts = range(0, max(size, 1), chunk)
    fd = os.open(path, os.O_RDONLY)
    try:

        def part(start: int) -> bytes:
            return hashlib.sha256(os.pread(fd, chunk, start)).digest()

        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            parts = list(pool.map(part, starts))
    finally:
        os.close(fd)
    return hashlib.sha256(f"{size}:{chunk}:".encode() + b"".join(parts)).hexdigest()


def _stat_key(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_header_bytes(f: Any, path: Path, size: int) -> bytes:
    raw_length = f.read(_HEADER_LENGTH_BYTES)
    if len(raw_length) < _HEADER_LENGTH_BYTES:
        raise ValueError(f"{path} is too short to be a safetensors file ({size} bytes)")
    (length,) = struct.unpack("<Q", raw_length)
    if length > min(_MAX_HEADER_BYTES, size - _HEADER_LENGTH_BYTES):
        raise ValueError(f"{path} is not a valid safetensors file (header length {length})")
    return f.read(length)
