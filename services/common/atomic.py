"""Crash-safe file replacement: write a temp file, fsync it, rename over the target, fsync
the folder. A reader (or a restart after ``kill -9``) sees the old file or the new one,
never a torn one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush ``path`` to the disk: a file's data, or a folder's entries (a rename in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(path.parent)
