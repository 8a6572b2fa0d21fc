"""Publishing files and directories so that a crash never leaves one half-written.

Everything attnquant writes for later use (cache entries, ``attnquant
quantize`` output, the demo model) is written beside its destination and
renamed into place once complete: a rename within a filesystem is atomic, so
a reader sees the old state or the new one, never a mix.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from attnquant.config import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

_PARTIAL = ".partial-"


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final``; on success it is fsync'ed and renamed
    over ``final``, on failure removed."""
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    temporary = Path(name)
    try:
        yield temporary
        _fsync(temporary)
        os.replace(temporary, final)
        _fsync_directory(final.parent)
    finally:
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """A staging directory ``.<name>.partial-<pid>`` beside ``final``.

    On success its files are fsync'ed and it replaces ``final`` (an existing
    ``final`` is moved aside first, then removed); on failure it is removed.
    Staging directories left by processes that no longer run (killed before
    they could clean up) are removed before a new one is made.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(final)
    staging = final.parent / f".{final.name}{_PARTIAL}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        for path in staging.rglob("*"):
            if path.is_file():
                _fsync(path)
        previous = final.parent / f".{final.name}.previous-{os.getpid()}"
        if final.exists():
            os.replace(final, previous)
        os.replace(staging, final)
        _fsync_directory(final.parent)
        shutil.rmtree(previous, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_stale_partials(final: Path) -> list[Path]:
    """Removes the staging directories of ``final`` whose writer is dead; returns them."""
    removed = []
    for leftover in final.parent.glob(f".{final.name}{_PARTIAL}*"):
        pid = leftover.name.rsplit(_PARTIAL, 1)[1]
        if pid.isdigit() and not _process_alive(int(pid)):
            logger.info("attnquant: removing %s, left by a process that no longer runs", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _fsync(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_directory(directory: Path) -> None:
    """Makes a rename durable: the directory entry must reach the disk too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
