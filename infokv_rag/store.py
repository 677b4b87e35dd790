"""Saving, verifying and loading compressed document caches.

A saved cache is a directory:
  manifest.json        format version, model fingerprint, config, document hash and page map, token
                       counts, stats, and the sha256 of every other file; itself checksummed
  tensors.safetensors  its binding to the rest of the cache in its metadata (`hot_binding`), and per layer:
                       keys.L, values.L (kv_heads, kept_L, head_dim), positions.L, scores.L
                       (kv_heads, kept_L); with summaries (`infokv_rag.summaries`) summary_keys.L,
                       summary_values.L (kv_heads, m_L, head_dim) and summary_log_counts.L (kv_heads, m_L);
                       with per-head budgets (`infokv_rag.cache.HeadExtras`) extra_keys.L, extra_values.L
                       (entries_L, head_dim), extra_positions.L (entries_L,) and extra_counts.L (kv_heads,);
                       information_reference (n,) when the method computed it. A cache held in codes
                       (`CompressionConfig.stored_bits`, `infokv_rag.coded_cache`) has codes.<name>.L instead
                       of keys.L and values.L, and extra_codes.<name>.L.H (head H's extras) instead of
                       extra_keys.L and extra_values.L, <name> each of `infokv_rag.quantisation.TENSOR_NAMES`
  document.txt         the document text (page spans in the manifest index into it)
  cold.safetensors     the cold tier, when the config keeps one (`infokv_rag.cold_tier`), its metadata holding
                       its binding to the hot cache (the sha256 of tensors.safetensors): verified on load, then
                       memory-mapped from a local directory (a page is read when a question recalls it)
Saving writes a sibling temporary directory, fsyncs it and renames it into place, so a crash leaves the
old cache or none, never a half-written one. Loading verifies everything before any tensor is used.

Format 10 binds the hot tensors to the text, the model, the config and the token counts (`hot_binding`), and the
cold tier to the hot tensors' bytes: a cold tier of an earlier format (format 9 bound it to the kept positions
only, which another cache's entries share) is refused (ingest the document again); an earlier cache without one
is read as it was, its hot tensors unbound, a binding checked where its tensors hold one.
Format 9 first bound the cold tier, by the kept positions. Format 8 keeps each head's extras out of the cold tier
(`infokv_rag.cold_tier`); format 7 may hold its entries in codes; format 6 may hold per-head extras; format 5 may
hold summaries of the evicted entries; format 4 may hold a cold tier; format 3 stores the config as its shared
fields plus `settings`, the method's own; format 2 (one flat dict of every field) is read too, each field that the
method does not take dropped; a config without `summaries` had none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

import torch
from safetensors.torch import load

from . import scorers
from .cache import DocumentCache, EvictedSummary, HeadExtras, LayerKV, ResidentCache
from .coded_cache import CodedCache, CodedExtras, CodedLayer
from .cold_tier import ColdTier
from .config import CompressionConfig
from .documents import Document
from .errors import CacheStoreError, ConfigError, InfoKVError, cache_read_error
from .files import (
    TEMPORARY_DIGITS,
    FileStamp,
    fsync_dir,
    is_temporary_name,
    make_temporary_directory,
    open_regular,
    replace_directory,
    retired_prefix,
    safetensors_bytes,
    safetensors_header,
    safetensors_views,
    write_synced,
)
from .ingestion import DocumentStats, ProgressCallback
from .quantisation import TENSOR_NAMES, QuantisedEntries

if TYPE_CHECKING:
    from .document import CompressedDocument
    from .engine import InfoKVEngine
    from .model_runner import ModelRunner

log = logging.getLogger(__name__)

FORMAT_VERSION = 10
READABLE_VERSIONS = (2, 3, 4, 5, 6, 7, 8, 9, 10)
BOUND_FROM = 10
"""The first format whose tensors carry their bindings (`hot_binding`; the cold tier's to the hot tensors' bytes):
an earlier cold tier is refused, earlier hot tensors without a binding are read as they were."""
BINDING = "binding"
"""The key of a binding in the metadata of tensors.safetensors and cold.safetensors."""
BOUND_RECORDS = ("config", "document", "tokens", "cold_tier")
"""The manifest's records that the hot tensors are bound to (`hot_binding`)."""
MAX_MANIFEST_BYTES = 16 << 20
"""A manifest larger than this is damaged (a saved one holds a few kilobytes per hundred pages): never parsed."""
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
TEXT = "document.txt"
COLD = "cold.safetensors"
SUMMARY_TENSORS = ("keys", "values", "log_counts")
EXTRA_TENSORS = ("keys", "values", "positions", "counts")
STALE_SECONDS = 3600.0
"""Leftover staging / retired directories of a save killed this long ago are removed by the next save."""


def _sha256(data: bytes | bytearray | mmap.mmap) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest_checksum(manifest: dict[str, Any]) -> str:
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return _sha256(json.dumps(body, sort_keys=True).encode())


def encode_document(document: CompressedDocument) -> dict[str, bytes]:
    """The files of `document`'s saved cache, by name, the manifest last (the order to write them in)."""
    from . import __version__

    text_bytes = document.document.text.encode("utf-8")
    manifest: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "library_version": __version__,
        "model": {"name": document.engine.name, "fingerprint": document.engine.fingerprint},
        "config": document.config.to_dict(),
        "document": document.document.layout(),
        "tokens": {
            "document": document.cache.document_tokens,
            "head": document.engine.prompt.head_tokens,
            "sink_tokens": document.cache.sink_tokens,
            "kept_per_layer": document.cache.kept_per_layer,
        },
        "stats": document.stats.to_dict(),
    }
    if document.cold_tier is not None:
        manifest["cold_tier"] = {"bits": document.cold_tier.bits}
    tensors = _cache_tensors(document.cache)
    if document.information_reference is not None:
        tensors["information_reference"] = document.information_reference
    tensor_bytes = safetensors_bytes(
        tensors,
        metadata={BINDING: hot_binding(text_bytes, document.engine.fingerprint, manifest)},
    )
    cold: dict[str, bytes] = {}
    if document.cold_tier is not None:
        cold[COLD] = _encode_cold_tier(document.cold_tier, _sha256(tensor_bytes))
    manifest["files"] = {
        name: {"sha256": _sha256(data), "bytes": len(data)}
        for name, data in {TENSORS: tensor_bytes, TEXT: text_bytes, **cold}.items()
    }
    manifest["checksum"] = _manifest_checksum(manifest)
    # The manifest goes last: a cache whose manifest is missing is never loadable.
    return {TENSORS: tensor_bytes, TEXT: text_bytes, **cold, MANIFEST: json.dumps(manifest, indent=1).encode()}


def hot_binding(text: bytes, fingerprint: str, manifest: dict[str, Any]) -> str:
    """What ties tensors.safetensors to the rest of its cache: a sha256 over the text's sha256, the model's
    fingerprint and the manifest's `BOUND_RECORDS` as saved. Another cache's tensors or text fit the shapes of any
    cache of as many tokens, and a config or token count edited in a re-signed manifest would read the tensors
    otherwise than they were made (ignore some, place the question elsewhere): each would answer from a mix."""
    record = [_sha256(text), fingerprint, *(manifest.get(key) for key in BOUND_RECORDS)]
    return _sha256(json.dumps(record, sort_keys=True).encode())


def _encode_cold_tier(cold_tier: ColdTier, bound_to: str) -> bytes:
    """The cold tier's file, bound to the hot tensors whose sha256 is `bound_to` (in its metadata). A loaded one
    maps its file: changed in place since it was verified, the map would read the new bytes, saved here under fresh
    checksums as if verified (or die on a truncation), so the file is checked first (`CacheStoreError`), and
    again after it was read for a change made meanwhile."""
    cold_tier.check_source()
    data = safetensors_bytes(cold_tier.tensors(), {BINDING: bound_to})
    cold_tier.check_source()
    return data


CACHE_FILES = frozenset((MANIFEST, TENSORS, TEXT, COLD))


def check_save_target(directory: str | os.PathLike[str], *, owned: bool = False) -> Path:
    """The resolved path a cache may be saved to: one that does not exist and can be made, an empty directory, or
    an earlier cache (`is_saved_cache`), which a save replaces. Anything else (a file, a directory holding other
    files or files that only share a cache's names, a path under a file, the working directory) is refused with
    `CacheStoreError`: a save must never delete what is not a cache. An `owned` directory (named by a store for its
    own caches: a `CacheStore` entry, the service's, never a path a user gave) may also be what is left of a
    damaged cache: a cache's file names only, its manifest unreadable."""
    try:
        target = local_path(directory).resolve()
        present = _identity(target)
    except (OSError, RuntimeError) as exc:  # a name too long; a symlink loop (RuntimeError before Python 3.13)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CacheStoreError(f"cannot save a cache to {directory} ({reason}): save the cache to another path") from exc
    # Another save to the same path replaces the directory while it is checked (`replace_directory`): what went or
    # came meanwhile is that save's whole cache, checked again, never a reason to refuse.
    for attempt in range(REREAD_ATTEMPTS):
        if present is None:
            break
        try:
            _check_replaceable(target, owned)
            break
        except (CacheStoreError, OSError) as exc:
            now = _identity(target)
            if now == present or attempt == REREAD_ATTEMPTS - 1:
                if isinstance(exc, CacheStoreError):
                    raise
                raise CacheStoreError(f"cannot read {target} ({exc}): save the cache to another path") from exc
            present = now
    _check_can_make(target)
    return target


def local_path(directory: str | os.PathLike[str]) -> Path:
    """`directory` as a local path (`~` expanded); `CacheStoreError` for a name no file system takes (a NUL)."""
    path = Path(directory).expanduser()
    if "\0" in str(path):
        raise CacheStoreError(f"{str(path)!r} holds a NUL character, which no path can: check the path")
    return path


def _identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what `path` names itself (a symlink, not what it points at); None when nothing is there."""
    try:
        status = path.lstat()
    except (FileNotFoundError, NotADirectoryError):  # the second: a path under a file (`_check_can_make` says so)
        return None
    return status.st_dev, status.st_ino


def _working_directory() -> Path | None:
    """The process's working directory; None when it was removed (no save target is then the same)."""
    try:
        return Path.cwd()
    except FileNotFoundError:
        return None


def _check_replaceable(target: Path, owned: bool) -> None:
    """Refuses (`CacheStoreError`) an existing `target` that a save must not replace (`check_save_target`)."""
    if not target.is_dir() or target.is_symlink():
        raise CacheStoreError(f"{target} exists and is not a cache directory: save the cache to another path")
    if _working_directory() == target:
        # The save renames the directory aside and removes it: the process would stand in a deleted directory,
        # where `.` names nothing, and the cache it saved lies at the absolute path only.
        raise CacheStoreError(
            f"{target} is the working directory, which a save replaces: save the cache to a directory below it "
            "(e.g. ./cache) or elsewhere"
        )
    names = {entry.name for entry in target.iterdir()}
    others = sorted(names - CACHE_FILES)
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise CacheStoreError(
            f"{target} holds other files than a saved cache ({shown}): a save replaces the whole directory, so "
            "save the cache to a new or empty directory"
        )
    if names and not owned and not is_saved_cache(target):
        raise CacheStoreError(
            f"{target} is not a cache that infokv-rag saved (no readable {MANIFEST} of ours), so a save will not "
            "replace it: save the cache to a new or empty directory"
        )
    # The save removes the cache it replaces, which takes a directory it may write: else it would fail at the
    # end, leaving the old cache and the new one's copy beside it.
    if not os.access(target, os.W_OK | os.X_OK):
        raise CacheStoreError(
            f"{target} is read-only (mode {stat.S_IMODE(target.stat().st_mode):o}), and a save replaces the "
            "directory: make it writable (chmod u+w) or save the cache to another path"
        )


def is_saved_cache(directory: Path) -> bool:
    """Whether `directory` holds a manifest that infokv-rag wrote (a JSON object of a known format whose checksum
    holds: `read_manifest`): its other files may be damaged, but the directory is a cache, never a user's files of
    the same names."""
    try:
        read_manifest(directory)
    except CacheStoreError:
        return read_whole(directory, _of_a_later_format)
    return True


LATER_MANIFEST_KEYS = frozenset(
    {"format_version", "library_version", "model", "config", "document", "files", "checksum"}
)
"""What every manifest infokv-rag has written holds, whatever its format."""


def _of_a_later_format(files: DirectoryFiles) -> bool:
    """Whether the manifest of `files` is one a later release wrote (this one cannot check its checksum): a JSON
    object of a format beyond those read here with every key a cache's manifest has, whose `files` name the cache's
    tensors and text, and exactly the other files of its directory. Another tool's manifest.json beside a user's own
    document.txt is not one."""
    try:
        manifest = json.loads(files.read(MANIFEST, MAX_MANIFEST_BYTES))
        present = {entry.name for entry in files.path.iterdir()} - {MANIFEST}
    except (OSError, ValueError, RecursionError):
        return False
    return (
        isinstance(manifest, dict)
        and LATER_MANIFEST_KEYS <= set(manifest)
        and type(manifest["format_version"]) is int
        and manifest["format_version"] > max(READABLE_VERSIONS)
        and isinstance(manifest["files"], dict)
        and {TENSORS, TEXT} <= set(manifest["files"]) == present
    )


def _check_can_make(target: Path) -> None:
    """Refuses (`CacheStoreError`) a target whose parent cannot be made or written, before any work is done: the
    nearest existing directory above it must be a directory this process may write."""
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise CacheStoreError(f"cannot make {target}: {existing} is not a directory; save the cache to another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CacheStoreError(f"cannot write into {existing}: save the cache to another path")
    # A save writes beside the target into a directory named after it and longer (`_staging_prefix`).
    longest = len(os.fsencode(_staging_prefix(target))) + TEMPORARY_DIGITS
    try:
        most = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        most = 255
    if longest > most:
        raise CacheStoreError(
            f"cannot save a cache to {target}: a save writes it first into a directory beside it named "
            f"{_staging_prefix(target)}<{TEMPORARY_DIGITS} hex digits>, {longest} bytes, and a name here holds at "
            f"most {most}; name the cache directory {longest - most} bytes shorter"
        )


def save_document(document: CompressedDocument, directory: str | os.PathLike[str], *, owned: bool = False) -> Path:
    """Writes `document` to `directory` atomically, replacing a cache there (`check_save_target` says what may
    be replaced; a replaced directory keeps its permissions, a new one takes the umask's, or 0700 when `owned`: a
    cache store's entry)."""
    target = check_save_target(directory, owned=owned)
    files = encode_document(document)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _sweep_leftovers(target)
        # A store's own entry stays private (README: it holds the text); a user's save takes the umask's mode.
        staging = make_temporary_directory(target.parent, _staging_prefix(target), private=owned)
    except OSError as exc:
        raise CacheStoreError(f"cannot write a cache into {target.parent}: {exc}") from exc
    try:
        for name, data in files.items():
            write_synced(staging / name, data)
        fsync_dir(staging)
        try:
            kept_mode: int | None = stat.S_IMODE(target.stat().st_mode)  # a directory the user made or shared
        except FileNotFoundError:
            kept_mode = None
        replace_directory(staging, target)
        if kept_mode is not None:
            # Given once installed: a staging directory that failed to install must stay writable to be removed.
            with contextlib.suppress(FileNotFoundError):
                target.chmod(kept_mode)
        fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, OSError):
            raise CacheStoreError(f"cannot write the cache to {target}: {exc}") from exc
        raise
    return target


def _staging_prefix(target: Path) -> str:
    """The name prefix of the directories a save of `target` writes its files into before installing them."""
    return f".{target.name}.saving-"


def _sweep_leftovers(target: Path) -> None:
    """Removes staging and retired directories that killed saves of `target` left behind: only directories named
    as a save names them that hold nothing but a cache's files (never a user's `.cache.old-photos`, nor one that
    merely shares such a name), and only old ones: a young one may belong to a save running in another process.
    """
    cutoff = time.time() - STALE_SECONDS
    prefixes = (_staging_prefix(target), retired_prefix(target))
    try:
        with os.scandir(target.parent) as entries:
            candidates = [entry for entry in entries if any(is_temporary_name(entry.name, p) for p in prefixes)]
    except OSError:
        return  # no parent yet, or unreadable: nothing to sweep
    for leftover in candidates:
        try:
            if (
                leftover.is_dir(follow_symlinks=False)
                and leftover.stat(follow_symlinks=False).st_mtime < cutoff
                and _holds_only_cache_files(leftover.path)
            ):
                shutil.rmtree(leftover.path, ignore_errors=True)
        except OSError:
            pass  # removed meanwhile by another save's sweep, or unreadable: left alone


def _holds_only_cache_files(directory: str) -> bool:
    """Whether `directory` holds a cache's files and nothing else, or (as a retired directory did up to format 8)
    only a `cache` directory of them."""
    with os.scandir(directory) as scanned:
        entries = list(scanned)
    if len(entries) == 1 and entries[0].name == "cache" and entries[0].is_dir(follow_symlinks=False):
        return _holds_only_cache_files(entries[0].path)
    return all(entry.name in CACHE_FILES and entry.is_file(follow_symlinks=False) for entry in entries)


class CacheFiles(Protocol):
    """The files of one saved cache, wherever they lie (a directory, an object store)."""

    @property
    def where(self) -> str:
        """Names the cache in messages (a path or a URL)."""
        ...

    def read(self, name: str, most: int) -> bytes:
        """The file's bytes, at most `most` + 1 of them (a file longer than its caller takes shows as longer without
        being read whole: a damaged one may be of any size); FileNotFoundError when it is absent, OSError when it
        cannot be read."""
        ...


class DirectoryFiles:
    """A saved cache in a local directory, read from one opening of it (`read_whole` opens and closes it).

    The directory and every cache file in it are opened at the first read, each file relative to the directory
    opened: a save that replaces the cache meanwhile (`replace_directory` renames the old directory aside, then
    removes it) neither mixes its files into the ones read nor takes away one already open.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._directory: int | None = None
        self._handles: dict[str, BinaryIO] = {}

    @property
    def where(self) -> str:
        return str(self.path)

    def __enter__(self) -> DirectoryFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles.values():
            handle.close()
        if self._directory is not None:
            os.close(self._directory)

    def _open(self, name: str) -> BinaryIO:
        if self._directory is None:
            self._directory = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
            for cache_file in CACHE_FILES:
                with contextlib.suppress(OSError):  # opened again when it is read, to say why it cannot be
                    self._handles[cache_file] = open_regular(Path(cache_file), self._directory)
        if name not in self._handles:
            self._handles[name] = open_regular(Path(name), self._directory)
        handle = self._handles[name]
        handle.seek(0)
        return handle

    def read(self, name: str, most: int) -> bytes:
        handle = self._open(name)
        # Never more than the file holds: `most` comes from a manifest, and read() allocates what it is asked for.
        return handle.read(min(most, os.fstat(handle.fileno()).st_size) + 1)

    def map(self, name: str) -> tuple[mmap.mmap | bytearray, FileStamp]:
        """The file's bytes, memory-mapped copy-on-write (writable, so tensors can view them; an empty file,
        which cannot be mapped, is read), and the stamp that tells when the file changes under the map."""
        handle = self._open(name)
        stamp = FileStamp(self.path / name, handle)
        if stamp.size == 0:
            return bytearray(), stamp
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY), stamp

    def replaced(self) -> bool:
        """Whether a save replaced the cache while it was read: `path` names another directory now than the one
        opened, or none could be opened and now one is there, or is being put there (a save retiring the old)."""
        try:
            now: os.stat_result | None = os.stat(self.path)
        except OSError:
            now = None
        if self._directory is not None:
            opened = os.fstat(self._directory)
            return now is None or (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino)
        if now is not None:
            return stat.S_ISDIR(now.st_mode)
        try:
            neighbours = os.listdir(self.path.parent)
        except OSError:
            return False
        return any(is_temporary_name(name, retired_prefix(self.path)) for name in neighbours)


REREAD_ATTEMPTS = 5
"""Reads of a local cache that saves replace while they read it start again this many times in all (`read_whole`)."""
REREAD_PAUSE_SECONDS = 0.02
"""The wait before a read starts again: a save installs its cache one rename after it retired the old one."""
Read = TypeVar("Read")


def read_whole(directory: str | os.PathLike[str], read: Callable[[DirectoryFiles], Read]) -> Read:
    """What `read` makes of the saved cache in `directory`, its files all read from one directory (`DirectoryFiles`).

    A save that replaces the cache leaves no directory there for an instant, then removes the one it retired,
    which a read that opened it just before its files finds emptied: a read refused (`CacheStoreError`) while the
    cache was replaced starts again on the new one, so that it sees the previous cache or the new one, whole.
    """
    path = local_path(directory)
    attempt = 1
    while True:
        with DirectoryFiles(path) as files:
            try:
                return read(files)
            except CacheStoreError:
                if attempt == REREAD_ATTEMPTS or not files.replaced():
                    raise
        attempt += 1
        time.sleep(REREAD_PAUSE_SECONDS)


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The verified manifest of a saved cache (format and checksum checked, files not yet)."""
    return read_whole(directory, verified_manifest)


def saved_model_name(directory: str | os.PathLike[str]) -> str:
    """The name of the model that made the saved cache in `directory`, as its verified manifest records it;
    `CacheStoreError` for a manifest that is unreadable, damaged or names no model."""
    recorded = read_manifest(directory).get("model")
    name = recorded.get("name") if isinstance(recorded, dict) else None
    if not isinstance(name, str) or not name:
        raise CacheStoreError(f"{directory}/{MANIFEST} names no model; ingest the document again")
    return name


def verified_manifest(files: CacheFiles) -> dict[str, Any]:
    """The manifest of `files`, format and checksum checked (the other files not yet)."""
    path = files.where
    manifest_path = f"{path}/{MANIFEST}"
    try:
        raw = files.read(MANIFEST, MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise CacheStoreError(
            f"{path} is not a saved document cache (no {MANIFEST}): check the path, or ingest the document "
            "and save its cache (doc.save(dir), or `infokv-rag ingest FILE --out DIR`)"
        ) from None
    except OSError as exc:
        damaged = f"cannot read {manifest_path} ({exc}); delete the cache and ingest again"
        raise cache_read_error(exc, manifest_path, damaged) from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CacheStoreError(
            f"{manifest_path} is damaged (over {MAX_MANIFEST_BYTES} bytes, the most a manifest holds); delete the "
            "cache and ingest again"
        )
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise CacheStoreError(f"{manifest_path} is damaged ({exc}); delete the cache and ingest again") from exc
    if not isinstance(manifest, dict):
        raise CacheStoreError(f"{manifest_path} is damaged (not a JSON object); delete the cache and ingest again")
    # The version first: another format may checksum its manifest differently.
    version = manifest.get("format_version")
    if version not in READABLE_VERSIONS:
        *earlier, latest = READABLE_VERSIONS
        readable = f"{', '.join(str(v) for v in earlier)} and {latest}"
        raise CacheStoreError(
            f"{path} uses cache format {version!r}, but this version of infokv-rag reads formats {readable}; "
            "ingest the document again (or load it with the infokv-rag version that saved it)"
        )
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise CacheStoreError(
            f"{manifest_path} fails its checksum (edited or damaged); delete {path} and ingest the document again"
        )
    # Each name is read from the cache (`_verified_files` reads them all): one of another file, outside it too,
    # would have its content checked against the manifest's sha256 (telling whether a guess of it is right).
    names = manifest.get("files")
    if not isinstance(names, dict) or not {TENSORS, TEXT} <= set(names) <= CACHE_FILES - {MANIFEST}:
        raise CacheStoreError(
            f"{path} holds an incomplete or malformed manifest (its files are not {TENSORS}, {TEXT} and, with a "
            f"cold tier, {COLD}); ingest the document again"
        )
    return manifest


Buffer = TypeVar("Buffer", bound="bytes | bytearray | mmap.mmap")


def _read_verified(files: CacheFiles, name: str, record: dict[str, Any]) -> bytes:
    return _verified(files, name, record, lambda: files.read(name, record["bytes"]))


def _verified(files: CacheFiles, name: str, record: dict[str, Any], read: Callable[[], Buffer]) -> Buffer:
    """What `read` returns of file `name`, refused unless its size and sha256 are the manifest's `record`."""
    path = files.where
    if not isinstance(record, dict) or type(record.get("bytes")) is not int or record["bytes"] < 0:
        raise CacheStoreError(f"{path} holds a malformed manifest (the record of {name}); ingest the document again")
    try:
        data = read()
    except FileNotFoundError as exc:
        raise CacheStoreError(f"{path}/{name} is missing; delete {path} and ingest the document again") from exc
    except OSError as exc:
        damaged = f"cannot read {path}/{name} ({exc}); delete {path} and ingest the document again"
        raise cache_read_error(exc, f"{path}/{name}", damaged) from exc
    if len(data) != record["bytes"] or _sha256(data) != record["sha256"]:
        raise CacheStoreError(
            f"{path}/{name} fails its sha256 check (truncated or modified); delete {path} and ingest again"
        )
    return data


@dataclass(frozen=True)
class SavedDocument:
    """A verified saved cache, ready to become a `CompressedDocument` of the engine that loaded it."""

    cache: ResidentCache
    config: CompressionConfig
    document: Document
    stats: DocumentStats
    information_reference: torch.Tensor | None
    cold_tier: ColdTier | None


def load_document(engine: InfoKVEngine, directory: str | os.PathLike[str]) -> SavedDocument:
    """Loads and verifies a saved cache; refuses one made by another model or damaged in any way."""
    return read_whole(directory, lambda files: load_files(engine, files))


def load_files(engine: InfoKVEngine, files: CacheFiles) -> SavedDocument:
    """Loads and verifies the saved cache `files`; refuses one made by another model or damaged in any way."""
    with _malformed_manifest(files.where):
        return _load_verified(engine, files)


@contextlib.contextmanager
def _malformed_manifest(where: str) -> Iterator[None]:
    """Refuses (`CacheStoreError`) what a manifest that passes its checksum but lacks fields, or holds them in
    other shapes, makes fail: one written by a broken tool."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:  # int(Infinity)
        if isinstance(exc, InfoKVError):
            raise
        raise CacheStoreError(
            f"{where} holds an incomplete or malformed manifest ({exc!r}); ingest the document again"
        ) from exc


def _cache_tensors(cache: ResidentCache) -> dict[str, torch.Tensor]:
    """The tensors of a held cache by name, as the module docstring lays them out."""
    tensors: dict[str, torch.Tensor] = {}
    for index, summary in enumerate(cache.summaries or []):
        for name in SUMMARY_TENSORS:
            tensors[f"summary_{name}.{index}"] = getattr(summary, name)
    if isinstance(cache, CodedCache):
        for index, layer in enumerate(cache.layers):
            tensors |= {f"positions.{index}": layer.positions, f"scores.{index}": layer.scores}
            tensors |= {f"codes.{name}.{index}": getattr(layer.entries, name) for name in TENSOR_NAMES}
        for index, coded in enumerate(cache.extras or []):
            tensors |= {f"extra_positions.{index}": coded.positions, f"extra_counts.{index}": coded.counts}
            for head, entries in enumerate(coded.heads):
                tensors |= {f"extra_codes.{name}.{index}.{head}": getattr(entries, name) for name in TENSOR_NAMES}
        return tensors
    assert isinstance(cache, DocumentCache)
    for index, plain in enumerate(cache.layers):
        tensors |= {f"{name}.{index}": getattr(plain, name) for name in ("keys", "values", "positions", "scores")}
    for index, extra in enumerate(cache.extras or []):
        tensors |= {f"extra_{name}.{index}": getattr(extra, name) for name in EXTRA_TENSORS}
    return tensors


def _load_verified(engine: InfoKVEngine, files: CacheFiles) -> SavedDocument:
    path = files.where
    manifest = verified_manifest(files)
    model = manifest["model"]
    if model["fingerprint"] != engine.fingerprint:
        # The same name is other weights, files or config under it, or a model that was in memory (`from_model`:
        # its fingerprint hashes the weights as they were there, which loading its files does not reproduce).
        other = " (the same name: other weights, files or config, or a model saved from memory)"
        raise CacheStoreError(
            f"{path} was made by model {model['name']!r} (fingerprint {model['fingerprint'][:12]}), not by the "
            f"loaded model {engine.name!r} ({engine.fingerprint[:12]})"
            f"{other if model['name'] == engine.name else ''}; load it with that model or ingest again"
        )
    runner = engine.runner
    layers_made = len(manifest["tokens"].get("kept_per_layer", [None] * runner.num_layers))
    if layers_made != runner.num_layers:
        # The fingerprint leaves the layer count out (it would change every model's), and transformers reads the
        # same weights under a config.json of fewer layers.
        raise CacheStoreError(
            f"{path} was made by a model of {layers_made} layers, and the loaded model {engine.name!r} has "
            f"{runner.num_layers}: the same weights under another config.json are another model; load it with the "
            "model that made it or ingest again"
        )
    n = int(manifest["tokens"]["document"])
    # Before anything of n entries is made: a count beyond the model's context window would ask for any memory.
    if not 0 < n <= engine.context_window:
        raise CacheStoreError(
            f"{path} says its document is {n} tokens, outside the 1 to {engine.context_window} of this model's "
            "context window; ingest the document again"
        )
    try:
        tensor_bytes = _read_verified(files, TENSORS, manifest["files"][TENSORS])
        tensors, hot_bound_to = load(tensor_bytes), _binding_of(tensor_bytes)
    except Exception as exc:  # safetensors raises its own error type on a malformed header
        if isinstance(exc, InfoKVError):
            raise
        raise CacheStoreError(f"{path}/{TENSORS} cannot be parsed ({exc}); ingest the document again") from exc
    _check_finite(tensors, f"{path}/{TENSORS}")
    text_bytes = _read_verified(files, TEXT, manifest["files"][TEXT])
    text = text_bytes.decode("utf-8")
    document = Document.from_layout(text, manifest["document"])
    # Positions index the text's tokens: a cache of another text would cite, and answer from, the wrong one. The
    # template head before the text is counted as saved: one that prints the date may read longer on another day.
    head_now = engine.prompt.head_tokens
    read_as = len(engine.prompt.document_ids(text)) - head_now + int(manifest["tokens"].get("head", head_now))
    if read_as != n:
        raise CacheStoreError(
            f"{path} says its document is {n} tokens, but its text reads as {read_as} with this model's tokenizer; "
            "ingest the document again"
        )
    try:
        config = _config(manifest["config"], manifest["format_version"])
    except (ConfigError, TypeError) as exc:
        from . import __version__

        # A later release's method or setting reads as invalid here: say which release saved it.
        raise CacheStoreError(
            f"{path} holds a compression config this release ({__version__}) cannot use ({exc}); it was saved by "
            f"infokv-rag {manifest.get('library_version')!s}: load it with that release, or ingest the document again"
        ) from exc
    stats_fields = {k: v for k, v in manifest["stats"].items() if k not in ("kept_tokens", "compression_ratio")}
    information = tensors.get("information_reference")
    if information is not None and information.dim() != 1:
        raise CacheStoreError(
            f"{path} holds information values of shape {tuple(information.shape)}, not (n,); ingest the document again"
        )
    summaries = _summaries(tensors, config, runner, path) if "summary_keys.0" in tensors or config.summaries else None
    sinks = int(manifest["tokens"]["sink_tokens"])
    cache: ResidentCache
    if config.stored_bits is None:
        layers = [_layer(tensors, index, n, runner, path) for index in range(runner.num_layers)]
        extras = (
            _extras(tensors, [layer.positions for layer in layers], n, runner, path) if config.heads_differ else None
        )
        cache = DocumentCache(layers, n, sinks, summaries, extras)
    else:
        cache = _coded_cache(tensors, config.stored_bits, n, sinks, summaries, config.heads_differ, runner, path)
    unread = sorted(set(tensors) - set(_cache_tensors(cache)) - {"information_reference"})
    if unread:
        shown = ", ".join(unread[:3]) + (", ..." if len(unread) > 3 else "")
        raise CacheStoreError(
            f"{path}/{TENSORS} holds tensors that its config does not read ({shown}): the cache would answer without "
            "entries the document kept; ingest the document again"
        )
    _check_document_end(cache, config, path)
    # Checked once the checks above found nothing wrong in the tensors (they say what is): it tells the whole file
    # of another cache, or a manifest edited to read it otherwise. Hot tensors saved before it are read unbound.
    # A format older than the binding is read otherwise (format 2's config), so tensors that carry one with a
    # manifest that says an older format are refused too: the format is not one of the bound records.
    if (hot_bound_to is not None or manifest["format_version"] >= BOUND_FROM) and (
        manifest["format_version"] < BOUND_FROM or hot_bound_to != hot_binding(text_bytes, engine.fingerprint, manifest)
    ):
        raise CacheStoreError(
            f"{path}/{TENSORS} is not bound to this cache's text, model, config and token counts (another cache's "
            f"tensors or text copied in, or its manifest edited?); delete {path} and ingest the document again"
        )
    cold = None
    if config.recall and COLD not in manifest["files"]:
        raise CacheStoreError(f"{path} was made with recall {config.recall} but holds no cold tier; ingest again")
    if COLD in manifest["files"]:
        if manifest["format_version"] < BOUND_FROM:
            raise CacheStoreError(
                f"{path} holds a cold tier saved by an older version of infokv-rag (cache format "
                f"{manifest['format_version']}), which cannot be checked against the cache it was saved with; "
                "ingest the document again"
            )
        cold_tensors, bound_to, stamp = _read_cold_tensors(files, manifest["files"][COLD])
        _check_finite(cold_tensors, f"{path}/{COLD}")
        # Its shapes fit any cache of as many entries per head: only the binding, to the hot tensors' bytes (bound
        # in turn to the text, model and config), tells another one's, even one that keeps the same positions. Their
        # sha256 is the manifest's, verified as they were read.
        if bound_to != manifest["files"][TENSORS]["sha256"]:
            raise CacheStoreError(
                f"{path}/{COLD} is not the cold tier of this cache (its binding names other hot tensors: copied in "
                f"from another cache?); delete {path} and ingest the document again"
            )
        cold = ColdTier.from_tensors(cold_tensors, cache, int(manifest["cold_tier"]["bits"]), path)
        cold.source = stamp
    return SavedDocument(
        cache,
        config,
        document,
        # Bytes as held here: the entries are read into this engine's dtype, which may not be the saver's.
        dataclasses.replace(
            DocumentStats(**stats_fields),
            cache_bytes=cache.nbytes,
            full_cache_bytes=n * engine.bytes_per_token,
            cold_bytes=cold.nbytes if cold is not None else 0,
        ),
        information.to(runner.device) if information is not None else None,
        cold,
    )


def _check_document_end(cache: ResidentCache, config: CompressionConfig, path: str) -> None:
    """Refuses a cache whose entries do not reach its document's last token: every config that keeps an
    observation window (`window` > 0: the last tokens read, always kept) or keeps everything holds position n-1.
    A token count raised in a re-signed manifest (with the head before the text, so that the text still reads as
    that count) would otherwise place the question past the document."""
    if config.window == 0 and config.method_spec.compresses:
        return
    held = [positions for positions in cache.layer_positions() if positions.numel()]
    held += [positions for positions, _ in cache.extra_positions() or [] if positions.numel()]
    last = max((int(positions.max()) for positions in held), default=-1)
    if last != cache.document_tokens - 1:
        raise CacheStoreError(
            f"{path} says its document is {cache.document_tokens} tokens, but its entries end at position {last}: "
            "they were made for another document length; ingest the document again"
        )


MAY_BE_INFINITE = ("scores.", "summary_log_counts.")
"""Saved tensors where an infinity means something: eviction priorities (+inf: kept first) and the summaries' log
counts (-inf: a padding slot). NaN means nothing anywhere."""


def _check_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """Refuses NaN anywhere, and infinities in keys, values and code ranges: attention over them answers nothing
    the document says, and a checksum does not tell (a broken tool, or an ingestion that overflowed, writes them)."""
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        wrong = tensor.isnan() if name.startswith(MAY_BE_INFINITE) else ~tensor.isfinite()
        if bool(wrong.any()):
            raise CacheStoreError(f"{where} holds NaN or infinite values in {name}; ingest the document again")


def _layer_positions(
    tensors: dict[str, torch.Tensor], index: int, n: int, runner: ModelRunner, path: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`'s positions and scores (kv_heads, length), checked against the model and the document."""
    try:
        positions, scores = tensors[f"positions.{index}"], tensors[f"scores.{index}"]
    except KeyError as exc:
        raise CacheStoreError(f"{path} lacks tensors of layer {index}; ingest the document again") from exc
    if positions.dtype != torch.long:
        raise CacheStoreError(
            f"{path}/{TENSORS} holds positions.{index} as {str(positions.dtype).removeprefix('torch.')}, not as the "
            "int64 token positions a cache saves; ingest the document again"
        )
    if (
        positions.dim() != 2
        or positions.shape[0] != runner.kv_heads
        or scores.shape != positions.shape
        or (positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < n)
        or not bool((positions[:, 1:] > positions[:, :-1]).all())  # kept in the document's order, each once
    ):
        raise CacheStoreError(
            f"{path} layer {index} holds positions that do not fit the model and the document {n} (out of range, "
            "repeated or out of order); ingest the document again"
        )
    return positions.to(runner.device), scores.to(runner.device)


def _layer(tensors: dict[str, torch.Tensor], index: int, n: int, runner: ModelRunner, path: str) -> LayerKV:
    """Layer `index` at the model's dtype, checked against the model and the document."""
    positions, scores = _layer_positions(tensors, index, n, runner, path)
    keys, values = tensors.get(f"keys.{index}"), tensors.get(f"values.{index}")
    if keys is None or values is None:
        raise CacheStoreError(f"{path} lacks tensors of layer {index}; ingest the document again")
    expected = (runner.kv_heads, positions.shape[1], runner.head_dim)
    if tuple(keys.shape) != expected or values.shape != keys.shape:
        raise CacheStoreError(f"{path} layer {index} has shape {tuple(keys.shape)}, expected {expected}")
    return LayerKV(
        keys.to(device=runner.device, dtype=runner.dtype),
        values.to(device=runner.device, dtype=runner.dtype),
        positions,
        scores,
    )


def _coded_cache(
    tensors: dict[str, torch.Tensor],
    bits: int,
    n: int,
    sinks: int,
    summaries: list[EvictedSummary] | None,
    heads_differ: bool,
    runner: ModelRunner,
    path: str,
) -> CodedCache:
    """A cache held in codes of `bits`, every tensor checked against the model and the document."""
    layers = []
    for index in range(runner.num_layers):
        positions, scores = _layer_positions(tensors, index, n, runner, path)
        shape = (runner.kv_heads, positions.shape[1], runner.head_dim)
        entries = QuantisedEntries.from_saved(tensors, f"codes.{{name}}.{index}", shape, bits, f"{path} layer {index}")
        layers.append(CodedLayer(entries.to(runner.device), positions, scores))
    extras = None
    if heads_differ:
        extras = []
        for index, layer in enumerate(layers):
            positions, counts = _extra_positions(tensors, index, layer.positions, n, runner, path)
            heads = [
                QuantisedEntries.from_saved(
                    tensors,
                    f"extra_codes.{{name}}.{index}.{head}",
                    (1, int(count), runner.head_dim),
                    bits,
                    f"{path} layer {index}'s extras of head {head}",
                ).to(runner.device)
                for head, count in enumerate(counts)
            ]
            extras.append(CodedExtras(heads, positions, counts))
    return CodedCache(layers, n, sinks, bits, runner.dtype, summaries, extras)


def _summaries(
    tensors: dict[str, torch.Tensor], config: CompressionConfig, runner: ModelRunner, path: str
) -> list[EvictedSummary]:
    """Each layer's summaries, checked against the model and the config."""
    summaries = []
    for index in range(runner.num_layers):
        try:
            summary = EvictedSummary(*(tensors[f"summary_{name}.{index}"] for name in SUMMARY_TENSORS))
        except KeyError as exc:
            raise CacheStoreError(f"{path} lacks the summaries of layer {index}; ingest the document again") from exc
        expected = (runner.kv_heads, summary.length, runner.head_dim)
        if (
            not 0 <= summary.length <= config.summaries
            or tuple(summary.keys.shape) != expected
            or summary.values.shape != summary.keys.shape
            or tuple(summary.log_counts.shape) != expected[:2]
            or bool((summary.log_counts.isnan() | (summary.log_counts == torch.inf)).any())
        ):
            raise CacheStoreError(f"{path} holds malformed summaries in layer {index}; ingest the document again")
        summaries.append(
            EvictedSummary(
                summary.keys.to(device=runner.device, dtype=runner.dtype),
                summary.values.to(device=runner.device, dtype=runner.dtype),
                summary.log_counts.to(device=runner.device, dtype=torch.float32),
            )
        )
    return summaries


def _read_cold_tensors(
    files: CacheFiles, record: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], str | None, FileStamp | None]:
    """The cold tier's tensors, verified: views of a memory map (of the file in a local directory, where nothing is
    read into memory but what the checksum reads through; of a private temporary copy for another store), its
    binding (None when its metadata holds none) and the mapped file's stamp."""
    stamps: list[FileStamp] = []

    def read() -> mmap.mmap | bytearray | bytes:
        if not isinstance(files, DirectoryFiles):
            return files.read(COLD, record["bytes"])
        buffer, stamp = files.map(COLD)
        stamps.append(stamp)
        return buffer

    buffer = _verified(files, COLD, record, read)
    if not stamps:  # copied after its check: a temporary space that refuses it is no damage of the cache
        buffer, stamp = _spooled(f"{files.where}/{COLD}", buffer)
        stamps.append(stamp)
    for stamp in stamps:
        stamp.verified_sha256 = record["sha256"]
    try:
        tensors, bound_to = safetensors_views(buffer), _binding_of(buffer)
    except (ValueError, KeyError, struct.error) as exc:
        raise CacheStoreError(
            f"{files.where}/{COLD} cannot be read ({exc}); delete {files.where} and ingest again"
        ) from exc
    return tensors, bound_to, (stamps[0] if stamps else None)


def _spooled(where: str, data: bytes | bytearray | mmap.mmap) -> tuple[mmap.mmap | bytearray, FileStamp]:
    """`data` written to an unnamed temporary file (in TMPDIR) and memory-mapped copy-on-write: a cold tier read from
    an object store is most of what its document holds, and held as a file's pages it is not the process's memory
    for as long as the document stays loaded (the kernel drops the pages and reads them again as it needs). An
    OSError names the temporary space, which is to blame, not the cache."""
    try:
        with tempfile.TemporaryFile(prefix="infokv-cold-") as handle:
            handle.write(data)
            handle.flush()
            stamp = FileStamp(Path(where), handle)
            if not data:
                return bytearray(), stamp
            return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY), stamp
    except OSError as exc:
        where_to = f"{tempfile.gettempdir()}, the temporary space (TMPDIR) for a copy of {where}"
        raise OSError(exc.errno, exc.strerror or str(exc), where_to) from exc


def _binding_of(buffer: bytes | bytearray | mmap.mmap) -> str | None:
    """The binding in the metadata of the safetensors file in `buffer`; None when it holds none. Raises as
    `safetensors_header` does on a malformed file."""
    metadata = safetensors_header(buffer)[0].get("__metadata__")
    return metadata.get(BINDING) if isinstance(metadata, dict) else None


def _extra_positions(
    tensors: dict[str, torch.Tensor], index: int, layer_positions: torch.Tensor, n: int, runner: ModelRunner, path: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `index`'s per-head extras' positions (entries,) and counts (kv_heads,), checked against the model,
    the document and the layer's own positions (kv_heads, length): each head holds each position once, in the
    layer or among its extras (one held twice would be attended twice, and counted out of the cold tier once)."""
    try:
        positions, counts = tensors[f"extra_positions.{index}"], tensors[f"extra_counts.{index}"]
    except KeyError as exc:
        raise CacheStoreError(f"{path} lacks the per-head extras of layer {index}; ingest again") from exc
    entries = positions.shape[0] if positions.dim() == 1 else -1
    if (
        entries < 0
        or tuple(counts.shape) != (runner.kv_heads,)
        or positions.dtype != torch.long
        or counts.dtype != torch.long
        or bool((counts < 0).any())
        or int(counts.sum()) != entries
        or (entries and not 0 <= int(positions.min()) <= int(positions.max()) < n)
    ):
        raise CacheStoreError(f"{path} holds malformed per-head extras in layer {index}; ingest the document again")
    positions = positions.to(runner.device)
    # Per head, how often it holds each position: the layer's own once each (`_layer_positions`), then its extras.
    held = torch.zeros(runner.kv_heads, n, dtype=torch.int32, device=runner.device).scatter_(1, layer_positions, 1)
    heads = torch.arange(runner.kv_heads, device=runner.device).repeat_interleave(counts.to(runner.device))
    held.index_put_((heads, positions), torch.ones_like(positions, dtype=torch.int32), accumulate=True)
    twice = (held > 1).any(dim=1).nonzero()
    if len(twice):
        raise CacheStoreError(
            f"{path}: layer {index} holds a position of head {int(twice[0])} twice; ingest the document again"
        )
    return positions, counts


def _extras(
    tensors: dict[str, torch.Tensor], layer_positions: list[torch.Tensor], n: int, runner: ModelRunner, path: str
) -> list[HeadExtras]:
    """Each layer's per-head extras at the model's dtype, checked against the model and the layers' own positions
    (`_extra_positions`)."""
    extras = []
    for index, own in enumerate(layer_positions):
        keys, values = tensors.get(f"extra_keys.{index}"), tensors.get(f"extra_values.{index}")
        if keys is None or values is None:
            raise CacheStoreError(f"{path} lacks the per-head extras of layer {index}; ingest again")
        positions, counts = _extra_positions(tensors, index, own, n, runner, path)
        if tuple(keys.shape) != (len(positions), runner.head_dim) or values.shape != keys.shape:
            raise CacheStoreError(f"{path} holds malformed per-head extras in layer {index}; ingest the document again")
        keys, values = (t.to(device=runner.device, dtype=runner.dtype) for t in (keys, values))
        extras.append(HeadExtras(keys, values, positions, counts))
    return extras


def _config(data: dict[str, Any], format_version: int) -> CompressionConfig:
    """The config of a manifest; format 2's flat fields are split into shared ones and the method's own."""
    if format_version == 2:
        own = scorers.method(data["method"]).setting_names
        shared = {f.name for f in dataclasses.fields(CompressionConfig)} - {"settings"}
        data = {
            **{k: v for k, v in data.items() if k in shared},
            "settings": {k: v for k, v in data.items() if k in own},
        }
    return CompressionConfig.from_dict(data)


class StoreWriteWarning(UserWarning):
    """A `CacheStore` could not save a document it read (a full disk, a directory made read-only meanwhile)."""


@dataclass(frozen=True)
class StoredEntry:
    """One cache in a `CacheStore`: its directory, the bytes of its files, when it was last stored or reused
    (seconds since the epoch), and what its manifest names (None where it cannot be read: a damaged entry, which
    the next `ingest` of its document replaces)."""

    path: Path
    bytes: int
    last_used: float
    source: str | None
    model: str | None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "path": str(self.path)}


class CacheStore:
    """Saved caches keyed by (document sha256, model fingerprint, compression config, the method's revision).

    Ingesting the same file again with the same model and config loads the stored cache instead of
    prefilling; a stored entry that fails verification (or its load in any other way), or that holds other text
    than the file reads as now (saved by a release that read PDFs otherwise), is replaced by a fresh ingestion.
    Nothing is removed by itself: `prune` removes the entries least recently used.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

    def key(self, document_sha256: str, fingerprint: str, config: CompressionConfig) -> str:
        # Caches that differ only in their recall budget hold the same bytes: asking with another budget
        # reuses the stored cache instead of reading the document again.
        material: list[Any] = [document_sha256, fingerprint, config.cache_identity()]
        revision = scorers.method(config.method).revision
        if revision > 1:  # revision 1 keeps the keys of the caches stored before revisions existed
            material.append({"method_revision": revision})
        return _sha256(json.dumps(material, sort_keys=True).encode())[:32]

    def path_for(self, engine: InfoKVEngine, document: Document, config: CompressionConfig | None = None) -> Path:
        """Where `ingest` stores (or finds) `document`'s cache made by `engine` with `config`, resolved as ingestion
        resolves it (`InfoKVEngine.resolve_config`: what is left to the model is part of the key)."""
        if not isinstance(document, Document):  # a path would fail on `.sha256`
            raise TypeError(
                f"the cache store takes a Document (infokv_rag.documents.load_document(path)), not "
                f"{type(document).__name__}"
            )
        return self.root / self.key(document.sha256, engine.fingerprint, engine.resolve_config(config))

    def holds(self, engine: InfoKVEngine, document: Document, config: CompressionConfig | None = None) -> bool:
        """Whether a cache is stored at `path_for` (a whole save's manifest is there; `ingest` verifies it on use)."""
        return (self.path_for(engine, document, config) / MANIFEST).is_file()

    def ingest(
        self,
        engine: InfoKVEngine,
        document: Document,
        config: CompressionConfig | None = None,
        progress: ProgressCallback | None = None,
    ) -> tuple[CompressedDocument, bool]:
        """Returns (document, reused): the stored cache when valid, else a new ingestion saved here. A store that
        cannot take it (a full disk) costs the next run a prefill, not this one its answers: the document read is
        returned, with a `StoreWriteWarning`."""
        config = engine.resolve_config(config)
        path = self.path_for(engine, document, config)
        if (path / MANIFEST).is_file():
            try:
                stored = engine.load(path)
            except Exception:  # damaged or stale in any way (not only as the checks say: `InfoKVError`)
                pass  # fall through and rebuild it
            else:
                # A whole, verified cache may still be another entry's, moved here by hand: it must be this
                # document's, made with this config, or it is rebuilt too. The same file read into other text
                # (by a release that read PDFs otherwise) is rebuilt as well, so that an answer reads what
                # loading the file reads today.
                if (
                    stored.document.sha256 == document.sha256
                    and stored.document.pages == document.pages
                    and stored.config.cache_identity() == config.cache_identity()
                ):
                    stored.config = config  # the stored cache answers with this config's recall by default
                    # A save of this entry killed before it was stored left its directory, which no later save
                    # of a key that is stored sweeps: its reuse does.
                    _sweep_leftovers(path)
                    with contextlib.suppress(OSError):  # a store on a read-only medium is still read
                        os.utime(path)  # its last use, which `prune` removes the least recent of first
                    return stored, True
        compressed = engine.ingest_document(document, config, progress=progress)
        try:
            save_document(compressed, path, owned=True)
        except (CacheStoreError, OSError) as error:
            # What the entry held failed to load, or was another's: unless a user's files are in it, it goes, so
            # that the store holds nothing for this key (`holds`), not a cache no load takes.
            with contextlib.suppress(OSError):
                if path.is_dir() and _holds_only_cache_files(str(path)):
                    shutil.rmtree(path)
            warnings.warn(
                f"the cache was not stored ({error}); this run answers from the document it read, and the next one "
                "reads it again",
                StoreWriteWarning,
                stacklevel=2,
            )
            return compressed, False
        stored = loaded_back(compressed, functools.partial(engine.load, path))
        stored.config = config
        return stored, False

    def entries(self) -> list[StoredEntry]:
        """The caches stored here, least recently used first. Only directories named as the store names its
        entries and holding nothing but a cache's files are entries: anything else under the root is not listed
        (nor ever removed by `prune`), nor is a save still being written."""
        try:
            with os.scandir(self.root) as scanned:
                named = [entry for entry in scanned if _ENTRY_NAME.fullmatch(entry.name)]
        except FileNotFoundError:
            return []
        found = []
        for entry in named:
            try:
                if not entry.is_dir(follow_symlinks=False) or not _holds_only_cache_files(entry.path):
                    continue
                path = Path(entry.path)
                size = sum(file.stat().st_size for file in path.iterdir())
                found.append(StoredEntry(path, size, entry.stat(follow_symlinks=False).st_mtime, *_named_in(path)))
            except OSError:
                continue  # removed meanwhile (another process's prune), or unreadable: not an entry to count
        return sorted(found, key=lambda stored: (stored.last_used, stored.path.name))

    def prune(
        self, *, max_bytes: int | None = None, unused_for: float | None = None, dry_run: bool = False
    ) -> list[StoredEntry]:
        """Removes the entries not used (stored or reused by `ingest`) for `unused_for` seconds, then the least
        recently used ones until the rest hold at most `max_bytes`; returns those removed (with `dry_run`, those
        it would remove, removing nothing). Each goes in one step, renamed aside before its files are deleted, so
        that a process loading it meanwhile reads it whole or finds nothing and reads its document again. Also
        sweeps what saves and removals killed an hour ago or more left (a younger one may be a save running now).
        At least one of the two limits is needed."""
        if max_bytes is None and unused_for is None:
            raise ConfigError("prune needs max_bytes or unused_for (or both): nothing says which entries to remove")
        for name, limit in (("max_bytes", max_bytes), ("unused_for", unused_for)):
            if limit is not None and (
                isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit < math.inf
            ):
                raise ConfigError(f"{name} must be a number at least 0, got {limit!r}")
        entries = self.entries()
        cutoff = -math.inf if unused_for is None else time.time() - unused_for
        removed = [entry for entry in entries if entry.last_used < cutoff]
        held = sum(entry.bytes for entry in entries) - sum(entry.bytes for entry in removed)
        for entry in entries[len(removed) :]:
            if max_bytes is None or held <= max_bytes:
                break
            removed.append(entry)
            held -= entry.bytes
        if not dry_run:
            for entry in removed:
                _remove_entry(entry.path)
            self._sweep_all_leftovers()
        return removed

    def _sweep_all_leftovers(self) -> None:
        """Removes what saves and removals of any entry, killed an hour ago or more, left (`_sweep_leftovers`)."""
        try:
            with os.scandir(self.root) as scanned:
                keys = {match[1] for entry in scanned if (match := _LEFTOVER_NAME.match(entry.name))}
        except OSError:
            return
        for key in sorted(keys):
            _sweep_leftovers(self.root / key)


_ENTRY_NAME = re.compile("[0-9a-f]{32}")
"""The name `CacheStore.key` gives an entry's directory."""
_LEFTOVER_NAME = re.compile(r"\.([0-9a-f]{32})\.(?:saving|old)-")
"""The start of the name of a directory that a save or removal of an entry writes beside it (`_sweep_leftovers`)."""


def _named_in(entry: Path) -> tuple[str | None, str | None]:
    """The document source and model name a stored entry's manifest records; (None, None) where it is unreadable."""
    try:
        manifest = read_manifest(entry)
        source, model = manifest["document"].get("source"), manifest["model"].get("name")
    except (CacheStoreError, OSError, AttributeError, KeyError, TypeError):
        return None, None
    return (source if isinstance(source, str) else None), (model if isinstance(model, str) else None)


def _remove_entry(entry: Path) -> None:
    """Removes a stored entry: renamed to a retired directory (a leftover that `_sweep_leftovers` knows, should the
    removal be cut short), then deleted."""
    retired = make_temporary_directory(entry.parent, retired_prefix(entry))
    try:
        os.replace(entry, retired)
    except FileNotFoundError:
        retired.rmdir()  # removed meanwhile by another prune
        return
    shutil.rmtree(retired, ignore_errors=True)


def loaded_back(document: CompressedDocument, load: Callable[[], CompressedDocument]) -> CompressedDocument:
    """A document just read and saved, as it stays in memory: with a cold tier (most of what it holds), the saved
    copy that `load` reads back, whose cold tier is mapped from a file rather than held in memory; the document read
    where it has none, or that load fails (logged: the next load of the saved cache finds out more)."""
    if document.cold_tier is None:
        return document
    try:
        return load()
    except (CacheStoreError, OSError) as exc:
        named = document.document.source or f"sha256 {document.document.sha256[:12]}"
        log.warning("the saved cache of %s did not load back, keeping the one read: %s", named, exc)
        return document


def verify_files(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Checks the manifest and the sha256 of every file without a model; returns the manifest."""
    return read_whole(directory, _verified_files)


def _verified_files(files: CacheFiles) -> dict[str, Any]:
    manifest = verified_manifest(files)
    for name, record in manifest["files"].items():
        _read_verified(files, name, record)
    return manifest


def describe(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a saved cache for `infokv-rag info`: manifest and file checksums verified."""
    with _malformed_manifest(str(directory)):
        manifest = verify_files(directory)
        return {
            "path": str(Path(directory).expanduser().resolve()),
            "model": manifest["model"],
            "config": manifest["config"],
            "document": {**manifest["document"], "pages": len(manifest["document"]["pages"])},
            "tokens": manifest["tokens"],
            "stats": manifest["stats"],
            "cold_tier": _describe_cold_tier(manifest),
            "library_version": manifest["library_version"],
            "format_version": manifest["format_version"],
        }


def _describe_cold_tier(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """Its code width, bytes (as `cache_bytes` counts the hot cache's) and file bytes; None without one."""
    if COLD not in manifest["files"]:
        return None
    return {
        "bits": manifest["cold_tier"]["bits"],
        "bytes": manifest["stats"]["cold_bytes"],
        "file_bytes": manifest["files"][COLD]["bytes"],
    }
