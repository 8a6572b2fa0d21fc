"""The on-disk cache of quantized (precomputed) weights.

An entry is two files named by the key's digest:

* ``<digest>.safetensors``: the tensors;
* ``<digest>.json``: the manifest (key, file size, CRC-32 of the file).

Both are written to a temporary file in the cache directory, fsync'ed and
renamed into place, the manifest last, so an entry exists only once it is
complete: a process killed mid-write leaves at most a stray temporary file or
a data file without a manifest, neither of which is ever served. A hit
re-checks size and CRC before use; a mismatch is logged and rebuilt. One
file lock (``.lock``, the only one the directory ever holds) serializes
builders, so two processes starting together build once and both load the
same bytes. An entry carries, beside its tensors, a small JSON ``info``
object its builder returned (what a hit must still report).

Checksum choice: CRC-32 (zlib) runs at several GB/s on one core, about the
speed of reading the file, so verifying costs roughly one more read from the
page cache. SHA-256 (under 1 GB/s) would make a hit of a 15 GB entry seconds
slower than the disk; the checksum guards against torn writes and bit rot,
not tampering, so a CRC is enough.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from safetensors.torch import load_file, save_file

from attnquant.config import AttnQuantConfig, LOGGER_NAME
from attnquant.files import atomic_file

FORMAT_VERSION = 4  # 4: GPU-prepared block scales the bits the CPU gives
"""Bump when the produced tensors change for the same checkpoint and config."""

logger = logging.getLogger(LOGGER_NAME)

_READ_CHUNK = 16 * 2**20


@dataclass(frozen=True)
class CacheEntry:
    """What a key maps to: tensors, and a JSON-serializable ``info`` object."""

    tensors: dict[str, torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CacheKey:
    """What a cached entry depends on."""

    checkpoint: str
    weight_settings: str  # canonical JSON of AttnQuantConfig.weight_fingerprint()
    format_version: int = FORMAT_VERSION

    @classmethod
    def for_model(cls, checkpoint_identity: str, config: AttnQuantConfig) -> CacheKey:
        fingerprint = json.dumps(config.weight_fingerprint(), sort_keys=True)
        return cls(checkpoint_identity, fingerprint)

    def as_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "weight_settings": json.loads(self.weight_settings),
            "format_version": self.format_version,
        }

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.as_json(), sort_keys=True).encode()
        return hashlib.sha256(canonical).hexdigest()[:32]


class QuantizedWeightCache:
    """A directory of cached state dicts, safe across processes and crashes."""

    def __init__(self, root: Path) -> None:
        """Opens (creating if needed) the cache directory.

        Raises:
            ValueError: when the directory cannot be created or written.
        """
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.root):
                pass
        except OSError as error:
            raise ValueError(
                f"attnquant cache directory {self.root} is not writable ({error}); set "
                f"ATTNQUANT_CACHE_DIR to a writable directory or ATTNQUANT_CACHE=0"
            ) from error

    def data_path(self, key: CacheKey) -> Path:
        return self.root / f"{key.digest}.safetensors"

    def manifest_path(self, key: CacheKey) -> Path:
        return self.root / f"{key.digest}.json"

    def load_or_build(self, key: CacheKey, build: Callable[[], CacheEntry]) -> tuple[CacheEntry, bool]:
        """The cached entry for ``key`` (hit: True), or ``build()``'s, stored.

        Only one process builds at a time; the others wait and then load its
        result.
        """
        cached = self._load(key, log_corruption=False)  # the fast path takes no lock
        if cached is not None:
            return cached, True
        with FileLock(str(self.root / ".lock")):
            cached = self._load(key, log_corruption=True)  # built while we waited?
            if cached is not None:
                return cached, True
            # Holding the lock, no one else is writing: temporaries left by a
            # killed writer can go.
            for stale in self.root.glob(".*.tmp"):
                stale.unlink(missing_ok=True)
            entry = build()
            self._store(key, entry)
            return entry, False

    def _load(self, key: CacheKey, *, log_corruption: bool) -> CacheEntry | None:
        manifest_path, data_path = self.manifest_path(key), self.data_path(key)
        if not manifest_path.exists():
            return None
        try:
            manifest = json.loads(manifest_path.read_text())
            problem = self._verify(manifest, key, data_path)
            entry = None if problem else CacheEntry(load_file(str(data_path)), manifest.get("info", {}))
        except Exception as error:  # unreadable manifest or data: same remedy
            problem = f"{type(error).__name__}: {error}"
        if problem:
            if log_corruption:
                logger.warning(
                    "attnquant cache entry %s is corrupt (%s); rebuilding", data_path, problem
                )
            return None
        return entry

    @staticmethod
    def _verify(manifest: dict[str, Any], key: CacheKey, data_path: Path) -> str | None:
        """Why the entry cannot be used, or None when it can."""
        if manifest.get("key") != key.as_json():
            return "manifest is for another key"
        size = data_path.stat().st_size
        if size != manifest.get("size"):
            return f"size {size} != {manifest.get('size')} recorded"
        if _crc32_of(data_path) != manifest.get("crc32"):
            return "checksum mismatch"
        return None

    def _store(self, key: CacheKey, entry: CacheEntry) -> None:
        data_path = self.data_path(key)
        with atomic_file(data_path) as temporary:
            save_file({name: t.contiguous() for name, t in entry.tensors.items()}, str(temporary))
        manifest = {
            "key": key.as_json(),
            "file": data_path.name,
            "size": data_path.stat().st_size,
            "crc32": _crc32_of(data_path),
            "tensors": len(entry.tensors),
            "info": entry.info,
        }
        with atomic_file(self.manifest_path(key)) as temporary:
            temporary.write_text(json.dumps(manifest, indent=1))


def _crc32_of(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
