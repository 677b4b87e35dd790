"""Durable file writes: a crash leaves the old content or the new, never a torn file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_synced(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and flushes it to disk (not atomic: for files in a private staging directory)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces `path` with `data` atomically: written to a sibling temporary file, synced, renamed."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(handle)
    try:
        write_synced(Path(temp), data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def fsync_dir(path: Path) -> None:
    """Makes the renames and creations inside directory `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
