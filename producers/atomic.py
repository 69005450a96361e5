"""Atomic file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
import re
from typing import BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Write via ``write(handle)`` to a temp file in the same directory, fsync, rename over."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            flush_to_disk(handle)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def flush_to_disk(handle: BinaryIO) -> None:
    """Push ``handle``'s bytes to the disk: where a full disk or a failing device reports."""
    handle.flush()
    os.fsync(handle.fileno())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    def write(handle: BinaryIO) -> None:
        handle.write(data)

    atomic_write(path, write)


def _fsync_dir(directory: Path) -> None:
    # The rename itself is durable only once the directory entry is on disk.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


_TEMP = re.compile(
    r"^\.(?P<target>.+)\.[^.]+\.tmp$"
)  # ".<target name>.<random>.tmp", as mkstemp names it


def remove_stale_temps(
    directory: str | os.PathLike, owned: Callable[[str], bool] | None = None
) -> int:
    """Delete temp files left by a crash mid-write; returns how many.

    With ``owned(target_name)``, only the temps of files the caller writes: in a
    directory shared by several writers (ranks), another writer's temp may be a
    write in flight, not a leftover.
    """
    removed = 0
    for tmp in Path(directory).glob(".*.tmp"):
        m = _TEMP.match(tmp.name)
        if owned is not None and (m is None or not owned(m.group("target"))):
            continue
        try:
            tmp.unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
