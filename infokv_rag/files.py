"""Durable file writes (a crash leaves the old content or the new, never a torn file), and safetensors views."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_DTYPES = {
    "U8": torch.uint8,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}


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


def safetensors_header(buffer: Any) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file in `buffer` (bytes, mmap) and the offset its data starts at."""
    (length,) = struct.unpack("<Q", buffer[:8])
    header: dict[str, Any] = json.loads(bytes(buffer[8 : 8 + length]))
    return header, 8 + length


def safetensors_views(buffer: Any) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file in a writable `buffer` (a copy-on-write mmap), without copying them.

    Raises ValueError, KeyError or struct.error when the file is malformed.
    """
    header, start = safetensors_header(buffer)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = (start + offset for offset in info["data_offsets"])
        count = (end - begin) // dtype.itemsize
        if count != int(torch.Size(info["shape"]).numel()) or end > len(buffer):
            raise ValueError(f"tensor {name} does not fit its header")
        tensor = (
            torch.frombuffer(buffer, dtype=dtype, count=count, offset=begin) if count else torch.empty(0, dtype=dtype)
        )
        tensors[name] = tensor.reshape(info["shape"])
    return tensors
