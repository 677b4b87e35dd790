"""Durable file writes (a crash leaves the old content or the new, never a torn file), and safetensors views."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import torch

# torch dtype names, not dtypes: torch is imported where tensors are made, so that reading a document
# (documents.py opens files through open_regular) does not load it.
SAFETENSORS_DTYPES = {
    "U8": "uint8",
    "I8": "int8",
    "I32": "int32",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
}


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading; OSError unless it is a regular file (a FIFO would block whoever reads it, a
    device such as a link to /dev/zero would read without end)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer opens at once
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(descriptor, "rb")


@dataclass(frozen=True)
class FileStamp:
    """Which file a memory map reads (device and inode), with its size and last modification when mapped.

    A copy-on-write map still reads from the file every page it has not copied, so a change made to the file in
    place (a copy or `rsync --inplace` over it, a truncation) would show through after the file was verified,
    and reading past a truncation kills the process (SIGBUS). A file replaced by a rename, or removed, leaves
    the map on the inode that was verified.
    """

    path: Path
    device: int
    inode: int
    size: int
    modified_ns: int

    @classmethod
    def of(cls, path: Path, handle: BinaryIO) -> FileStamp:
        status = os.fstat(handle.fileno())
        return cls(path, status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def changed_in_place(self) -> bool:
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: taken as changed
        if (now.st_dev, now.st_ino) != (self.device, self.inode):
            return False
        return (now.st_size, now.st_mtime_ns) != (self.size, self.modified_ns)


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


def replace_directory(staging: Path, target: Path) -> None:
    """Renames the complete `staging` directory to `target`, retiring a directory already there (moved into a
    `.<target name>.old-*` directory beside it, then removed; one a crash leaves is a leftover to sweep).

    Between retiring the old directory and renaming the new one, `target` does not exist: a crash there
    leaves none, never a mix of two. Another process may install the same target concurrently; the last
    rename wins (both are complete).
    """
    for attempt in range(5):
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            try:
                os.replace(target, retired / "cache")
            except FileNotFoundError:
                pass  # another process retired it first
        else:
            retired = None
        try:
            os.replace(staging, target)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == 4:
                raise
            # another save installed its cache between our retire and rename: retire that one too
        finally:
            if retired is not None:
                shutil.rmtree(retired, ignore_errors=True)


def safetensors_header(buffer: Any) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file in `buffer` (bytes, mmap) and the offset its data starts at."""
    (length,) = struct.unpack("<Q", buffer[:8])
    header: dict[str, Any] = json.loads(bytes(buffer[8 : 8 + length]))
    return header, 8 + length


def safetensors_views(buffer: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file in a writable `buffer` (a copy-on-write mmap), without copying them.

    Raises ValueError, KeyError or struct.error when the file is malformed.
    """
    import torch

    header, start = safetensors_header(buffer)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, SAFETENSORS_DTYPES[info["dtype"]])
        begin, end = (start + offset for offset in info["data_offsets"])
        count = (end - begin) // dtype.itemsize
        if count != int(torch.Size(info["shape"]).numel()) or end > len(buffer):
            raise ValueError(f"tensor {name} does not fit its header")
        tensor = (
            torch.frombuffer(buffer, dtype=dtype, count=count, offset=begin) if count else torch.empty(0, dtype=dtype)
        )
        tensors[name] = tensor.reshape(info["shape"])
    return tensors
