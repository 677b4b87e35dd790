"""Durable file writes (a crash leaves the old content or the new, never a torn file), and safetensors views."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
import struct
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from .errors import NotARegularFileError

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

_SAFETENSORS_ORDER = ("U8", "I8", "F16", "BF16", "I32", "F32", "I64")
"""The dtypes of `SAFETENSORS_DTYPES` in the order of safetensors' own dtype enum, which orders a file's tensors."""


def open_regular(path: Path, directory: int | None = None) -> BinaryIO:
    """`path` (relative to the open `directory`, when given) opened for reading; OSError unless it is a regular
    file (a FIFO would block whoever reads it, a device such as a link to /dev/zero would read without end)."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK, dir_fd=directory)  # a FIFO without a writer opens at once
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise NotARegularFileError(errno.EINVAL, "not a regular file", str(path))
    return os.fdopen(descriptor, "rb")


class FileStamp:
    """The file a memory map reads, held open, with its size, last modification and status change when mapped.

    A copy-on-write map still reads from the file every page it has not copied, so a change made to the file in
    place (a copy or `rsync --inplace` over it, a truncation) would show through after the file was verified,
    and reading past a truncation kills the process (SIGBUS). The stamp keeps a descriptor of the mapped file and
    checks the file through it, so it checks the inode that was verified wherever that lies now: a path would
    name another file (or none) once the cache directory is moved, or the process changes directory after a load
    by a relative path. A file replaced by a rename, or removed, leaves the map on the inode that was verified:
    not a change. The descriptor is closed when the stamp goes, with the map it stamps (a `ColdTier` holds both).
    The map keeps a descriptor of its own (Python's `mmap` duplicates the one it maps), so a loaded cold tier holds
    two: a process keeping many loaded caches needs an open-files limit of twice their count.
    """

    def __init__(self, path: Path, handle: BinaryIO) -> None:
        self.path = path
        """Names the file in messages (where it was when mapped)."""
        self._descriptor = os.dup(handle.fileno())
        weakref.finalize(self, os.close, self._descriptor)
        status = os.fstat(self._descriptor)
        self.size, self.modified_ns, self._status_changed_ns = status.st_size, status.st_mtime_ns, status.st_ctime_ns
        self.verified_sha256: str | None = None
        """The content's sha256 once its reader has verified it: a file of the same size whose modification or status
        changed (a `touch`, a chmod, a link, a write, also one whose modification time was set back as `touch -r` or
        `cp -p` over it do) is hashed again."""

    def __copy__(self) -> FileStamp:
        return self  # a copy of the descriptor's number would outlive it (closed with the original)

    def __deepcopy__(self, memo: dict[int, Any]) -> FileStamp:
        return self

    def changed_in_place(self) -> bool:
        try:
            now = os.fstat(self._descriptor)
            if now.st_size != self.size:
                return True
            # A write of the same size, or a status change (a chmod, a link made or removed, a `touch`, a write
            # whose modification time was set back) is judged by the content, hashed once: the same bytes written
            # again (a `cp` or `rsync --inplace` of the same file) are no change. A removal changes the status.
            if (now.st_mtime_ns, now.st_ctime_ns) == (self.modified_ns, self._status_changed_ns):
                return False
            if self.verified_sha256 is None or _descriptor_sha256(self._descriptor) != self.verified_sha256:
                return True
        except OSError:
            return True  # cannot tell: taken as changed
        self.modified_ns, self._status_changed_ns = now.st_mtime_ns, now.st_ctime_ns
        return False


def _descriptor_sha256(descriptor: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while block := os.pread(descriptor, 1 << 22, offset):
        digest.update(block)
        offset += len(block)
    return digest.hexdigest()


def write_synced(path: Path, data: bytes) -> None:
    """Writes `data` to `path` and flushes it to disk (not atomic: for files in a private staging directory)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes) -> None:
    """Replaces `path` with `data` atomically and durably: written to a sibling temporary file, synced, renamed,
    and the rename synced (its directory's), so that whoever is told it was written finds it after a crash."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(handle)
    try:
        write_synced(Path(temp), data)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Makes the renames and creations inside directory `path` durable."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


TEMPORARY_DIGITS = 16
TEMPORARY_SUFFIX = re.compile(f"[0-9a-f]{{{TEMPORARY_DIGITS}}}")
"""What follows the prefix in the name of a directory `make_temporary_directory` makes."""


def make_temporary_directory(parent: Path, prefix: str, *, private: bool = True) -> Path:
    """A new directory in `parent` named `prefix` and 16 random hex digits (`is_temporary_name`): private, or (not
    `private`: one to be installed as a new directory) of the mode the umask gives a new directory."""
    directory = parent / f"{prefix}{secrets.token_hex(TEMPORARY_DIGITS // 2)}"
    directory.mkdir(mode=0o700 if private else 0o777)
    return directory


EARLIER_TEMPORARY_SUFFIX = re.compile("[a-z0-9_]{8}")
"""What followed the prefix in the names `tempfile.mkdtemp` gave these directories before `make_temporary_directory`
(up to cache format 8): a save killed under such a release left one."""


def is_temporary_name(name: str, prefix: str) -> bool:
    """Whether `name` is one that `make_temporary_directory`, or an earlier release's `tempfile.mkdtemp`, gives a
    directory made with `prefix`."""
    suffix = name[len(prefix) :]
    return name.startswith(prefix) and any(
        form.fullmatch(suffix) for form in (TEMPORARY_SUFFIX, EARLIER_TEMPORARY_SUFFIX)
    )


def retired_prefix(target: Path) -> str:
    """The name prefix of the directories that `replace_directory` moves an earlier `target` into."""
    return f".{target.name}.old-"


def replace_directory(staging: Path, target: Path) -> None:
    """Renames the complete `staging` directory to `target`, replacing a directory already there.

    Where the system can (Linux 3.15 and later, on most local filesystems), the two are exchanged in one step
    (`renameat2` with RENAME_EXCHANGE) and the earlier one, now at `staging`, removed: `target` always names a
    whole directory, the old or the new (a crash before the removal leaves the old at `staging`, a leftover to
    sweep). Elsewhere the earlier directory is retired first (renamed over a fresh empty `retired_prefix`
    directory beside it, then removed), and between that and renaming the new one `target` does not exist: a crash
    there leaves none, never a mix of two; a rename that fails there, or an interruption (Ctrl-C), puts the old one
    back. Another process may install the same target concurrently; the last rename wins (both are complete).
    """
    for attempt in range(5):
        retired = None
        installed = False
        try:
            if target.exists() and _exchanged(staging, target):
                shutil.rmtree(staging, ignore_errors=True)
                return
            if target.exists():
                retired = make_temporary_directory(target.parent, retired_prefix(target))
                try:
                    os.replace(target, retired)
                except FileNotFoundError:
                    retired.rmdir()  # another process retired it first: nothing of ours to put back
                    retired = None
            os.replace(staging, target)
            installed = True
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == 4:
                raise
            # another save installed its cache between our retire and rename: retire that one too
        finally:
            if retired is not None:
                if not installed:
                    # A save that failed (or was interrupted) between the renames loses nothing: the earlier
                    # directory goes back, unless another save's took its place meanwhile.
                    with contextlib.suppress(OSError):
                        os.rename(retired, target)
                shutil.rmtree(retired, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
try:
    _renameat2: Any = ctypes.CDLL(None, use_errno=True).renameat2
except (AttributeError, OSError, TypeError):  # not glibc 2.28+ or musl 1.2.4+: no exchange (macOS, Windows)
    _renameat2 = None


def _exchanged(first: Path, second: Path) -> bool:
    """Whether `first` and `second` were exchanged in one step; False where the system or filesystem cannot (or
    `second` went meanwhile: its caller renames then)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOENT):
        return False
    raise OSError(error, os.strerror(error), str(second))


def safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """`tensors` (any device) as a safetensors file, byte for byte what `safetensors.torch.save` writes. Written
    here: safetensors 0.8 wraps each tensor's memory in a ctypes array type made for its byte size, which ctypes
    keeps for the life of the process, so every save of a cache of a new size grew a long-running process for good
    (about 100-450 KiB a document)."""
    import torch

    codes = {getattr(torch, name): code for code, name in SAFETENSORS_DTYPES.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    flat: list[torch.Tensor] = []
    size = 0
    # safetensors' order: its dtype enum's, descending, then the names.
    for name in sorted(tensors, key=lambda key: (-_SAFETENSORS_ORDER.index(codes[tensors[key].dtype]), key)):
        tensor = tensors[name].detach().cpu().contiguous().reshape(-1)
        shape = list(tensors[name].shape)
        header[name] = {"dtype": codes[tensor.dtype], "shape": shape, "data_offsets": [size, size + tensor.nbytes]}
        flat.append(tensor)
        size += tensor.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    out = bytearray(8 + len(text) + size)
    out[: 8 + len(text)] = struct.pack("<Q", len(text)) + text
    position = 8 + len(text)
    for tensor in flat:
        if tensor.nbytes:
            out[position : position + tensor.nbytes] = tensor.view(torch.uint8).numpy().data
        position += tensor.nbytes
    return bytes(out)


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
