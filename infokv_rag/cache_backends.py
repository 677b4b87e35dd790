"""Where saved caches and their records live: a local directory, or any fsspec URL shared by many processes.

    backend = open_backend("/var/lib/infokv")              # LocalBackend: today's directories and renames
    backend = open_backend("s3://bucket/prefix")            # FsspecBackend (extra [scale]); also file:///shared/dir
    backend.publish("documents/doc_x", compressed)          # atomic; verified on load
    backend.load(engine, "documents/doc_x")                 # CacheStoreError when absent, torn or foreign
    backend.put("documents/doc_x", "meta.json", b"...")     # one small record, replaced in one step

A key names a directory-like prefix ("documents/<id>"); under it lie small records and one published cache.

An object store cannot rename a directory into place, so `FsspecBackend` publishes a cache as a version:
  <key>/cache/<version>/tensors.safetensors, document.txt, then manifest.json (the manifest last)
  <key>/cache/CURRENT   {"version", "manifest_sha256"}, replaced in one step once the version is complete
A load follows CURRENT to a complete version and verifies it as a local load does (manifest checksum, every
file's sha256, the model fingerprint). A publisher killed before CURRENT leaves a version nothing points to,
never read. Concurrent publishers of one key each write their own version; whichever CURRENT lands last
names a complete one. A publish marks the version it replaces as retired (`<version>/RETIRED`, the time) just
before it moves CURRENT, and versions other than the current one are removed by a later publish only
`STALE_SECONDS` after they were retired (one never marked, after its creation), so a reader that followed an
older CURRENT still finds its files however old that version was. The version CURRENT names is never removed.

Credentials and endpoints come from the usual environment of the filesystem (for s3fs: AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, AWS_REGION, or ~/.aws); this module imports fsspec only when an
fsspec URL is opened.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import posixpath
import secrets
import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import store
from .errors import CacheStoreError, ConfigError, cache_read_error
from .files import write_atomic

if TYPE_CHECKING:
    from .document import CompressedDocument
    from .engine import InfoKVEngine

log = logging.getLogger(__name__)

CACHE = "cache"
REMOVE_ATTEMPTS = 5
"""Removals that meet another process's writes or removals look again this many times in all."""
CURRENT = "CURRENT"
RETIRED = "RETIRED"


class CacheBackend(ABC):
    """Records and published caches under keys; safe to share between processes (see the module docstring)."""

    url: str

    @abstractmethod
    def publish(self, key: str, document: CompressedDocument) -> None:
        """Makes `document` the cache of `key` atomically: a load sees the previous cache or this one, whole."""

    @abstractmethod
    def load(self, engine: InfoKVEngine, key: str) -> CompressedDocument:
        """The verified cache of `key`; `CacheStoreError` when there is none, or it is damaged or foreign."""

    @abstractmethod
    def put(self, key: str, name: str, data: bytes) -> None:
        """Writes the record `name` of `key`, replacing the old one in one step (OSError when refused)."""

    @abstractmethod
    def get(self, key: str, name: str) -> bytes:
        """The record `name` of `key`; FileNotFoundError when there is none."""

    @abstractmethod
    def children(self, prefix: str) -> list[str]:
        """The names of the keys directly under `prefix` (sorted; empty when there are none)."""

    @abstractmethod
    def remove(self, key: str, last: str) -> None:
        """Removes everything under `key`, its record `last` at the end (so a partial removal still has it)."""


class LocalBackend(CacheBackend):
    """A local directory: caches are directories renamed into place (`infokv_rag.store.save_document`), each load
    reading every file from the one directory it opened (`infokv_rag.store.read_whole`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()
        self.url = str(self.root)

    def _directory(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def publish(self, key: str, document: CompressedDocument) -> None:
        store.save_document(document, self._directory(key) / CACHE, owned=True)

    def load(self, engine: InfoKVEngine, key: str) -> CompressedDocument:
        return engine.load(self._directory(key) / CACHE)

    def put(self, key: str, name: str, data: bytes) -> None:
        directory = self._directory(key)
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / name, data)

    def get(self, key: str, name: str) -> bytes:
        return (self._directory(key) / name).read_bytes()

    def children(self, prefix: str) -> list[str]:
        directory = self._directory(prefix)
        if not directory.is_dir():
            return []
        return sorted(entry.name for entry in directory.iterdir() if entry.is_dir() and not entry.name.startswith("."))

    def remove(self, key: str, last: str) -> None:
        directory = self._directory(key)
        for attempt in range(REMOVE_ATTEMPTS):
            try:
                for entry in directory.iterdir():
                    if entry.name == last:
                        continue
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, onerror=_unless_gone)
                    else:
                        entry.unlink(missing_ok=True)
                (directory / last).unlink(missing_ok=True)
                directory.rmdir()
                return
            except FileNotFoundError:
                return  # another process removed the rest
            except OSError as exc:
                # A writer that had not yet seen a delete put a file back (it removes it once it sees the
                # tombstone): look again.
                if exc.errno != errno.ENOTEMPTY or attempt == REMOVE_ATTEMPTS - 1:
                    raise


class _TransportErrorsAsOSError:
    """An fsspec filesystem whose calls raise `ConnectionError` (an OSError) for its transport's own errors: s3fs
    re-raises botocore's `EndpointConnectionError` (or an aiohttp error) once its retries are spent, which no
    `except OSError` catches (an unreachable store answered 500 instead of 503 to retry)."""

    TRANSPORTS = frozenset({"botocore", "aiobotocore", "aiohttp", "urllib3", "requests"})

    def __init__(self, fs: Any) -> None:
        self._fs = fs

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._fs, name)
        if not callable(attribute):
            return attribute

        @functools.wraps(attribute)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attribute(*args, **kwargs)
            except OSError:
                raise
            except Exception as exc:
                if type(exc).__module__.partition(".")[0] not in self.TRANSPORTS:
                    raise
                raise ConnectionError(errno.EIO, f"{type(exc).__name__}: {exc}") from exc

        return call


@dataclass(frozen=True)
class _StoredFiles:
    """One published version of a cache in an fsspec filesystem (`store.CacheFiles`)."""

    fs: Any
    path: str
    url: str

    @property
    def where(self) -> str:
        return self.url

    def read(self, name: str, most: int) -> bytes:
        return bytes(self.fs.cat_file(posixpath.join(self.path, name), start=0, end=most + 1))


def _version_name() -> str:
    """Sorts by creation time (nanoseconds first), and is unique among concurrent publishers."""
    return f"{time.time_ns():020d}-{secrets.token_hex(6)}"


def _version_time(name: str) -> float | None:
    stamp = name.split("-", 1)[0]
    return int(stamp) / 1e9 if stamp.isdigit() else None


class FsspecBackend(CacheBackend):
    """Any fsspec filesystem (s3:// through s3fs, file://, gcs://, ...); see the module docstring."""

    def __init__(self, url: str, **storage_options: Any) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as exc:
            raise ConfigError(
                f"the store {url} needs fsspec (and s3fs for s3://): pip install 'infokv-rag[scale]'"
            ) from exc
        if "::" in url:
            # fsspec chains a URL's layers: a caching layer (simplecache::, filecache::) keeps local copies that
            # other processes' writes never reach, so it would go on reading a replaced CURRENT, or a record
            # deleted elsewhere; and the layers under it keep their own listings caches.
            raise ConfigError(
                f"the store {url} is a chained URL: give the store's own URL (s3://bucket/prefix). A caching layer "
                "would keep serving objects that other processes replace or delete."
            )
        if storage_options.get("use_listings_cache"):
            raise ConfigError(
                f"the store {url} cannot keep a listings cache: other processes and threads write it, and a "
                "stale listing hides what they wrote; leave use_listings_cache out"
            )
        try:
            # A fresh filesystem object: fsspec's shared instances would keep the endpoint and credentials
            # of the environment they were first made in. No listings cache: other processes write here, and
            # this object's threads share it, so a listing begun before one thread wrote an object and stored
            # after would hide that object from the thread's own next step (a move then finds no source).
            options = {**storage_options, "use_listings_cache": False}
            fs, root = url_to_fs(url, skip_instance_cache=True, **options)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open the store {url}: {exc}") from exc
        self.fs = _TransportErrorsAsOSError(fs)
        self.url = url.rstrip("/")
        self.root = root.rstrip("/")

    def _path(self, key: str, *names: str) -> str:
        return posixpath.join(self.root, key, *names)

    def publish(self, key: str, document: CompressedDocument) -> None:
        files = store.encode_document(document)
        version = _version_name()
        directory = self._path(key, CACHE, version)
        try:
            self.fs.makedirs(directory, exist_ok=True)
            for name, data in files.items():  # the manifest last
                self.fs.pipe_file(posixpath.join(directory, name), data)
            pointer = {"version": version, "manifest_sha256": hashlib.sha256(files[store.MANIFEST]).hexdigest()}
            replaced = self._current_version(key)
            if replaced is not None and replaced != version:
                self._retire(key, replaced)
            self._replace(self._path(key, CACHE, CURRENT), json.dumps(pointer).encode())
        except OSError as exc:
            raise CacheStoreError(f"cannot publish the cache to {self.url}/{key}: {exc}") from exc
        try:
            self._sweep(key, keep=version)
        except OSError as exc:  # the cache is published: what is left to remove, a later publish sweeps
            log.warning("published %s/%s, but could not sweep its replaced versions: %s", self.url, key, exc)

    def _current_version(self, key: str) -> str | None:
        """The version CURRENT names now; None when there is none or it cannot be read (nothing to retire)."""
        try:
            return str(json.loads(self.get(posixpath.join(key, CACHE), CURRENT))["version"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _retire(self, key: str, name: str) -> None:
        """Marks version `name` retired now, before CURRENT moves off it: its readers are the last from then on,
        and its age for the sweep counts from here. Marked after the move, another publisher's sweep in between
        would see it unmarked, date it by its creation and remove it under a reader that had just followed
        CURRENT to it."""
        try:
            self.fs.pipe_file(self._path(key, CACHE, name, RETIRED), str(time.time()).encode())
        except FileNotFoundError:
            pass  # already removed (CURRENT moved on meanwhile, and a sweep took it): nothing to mark

    def _retired_at(self, key: str, name: str) -> float | None:
        """When version `name` stopped being current (its RETIRED mark), else when it was made (its name); None
        when its mark cannot be read now (it may have been retired a moment ago: the sweep leaves it)."""
        try:
            return float(self.get(posixpath.join(key, CACHE, name), RETIRED))
        except (FileNotFoundError, ValueError):
            return _version_time(name)
        except OSError:
            return None

    def _replace(self, path: str, data: bytes) -> None:
        """Writes `path` in one step: a whole temporary object, then moved (a rename, or a copy on S3)."""
        temporary = f"{path}.{secrets.token_hex(6)}.tmp"
        self.fs.pipe_file(temporary, data)
        try:
            self.fs.mv(temporary, path)
        except BaseException:
            self.fs.rm(temporary)
            raise

    def _sweep(self, key: str, keep: str) -> None:
        """Removes versions other than `keep` that are old enough that no load can still be reading them."""
        cutoff = time.time() - store.STALE_SECONDS
        # Read afresh: another publisher may have moved CURRENT since, and a version is marked retired just
        # before CURRENT moves off it, so a publish that failed in between leaves the current version marked.
        current = self._current_version(key)
        if current is None:
            return  # which version is current is not known: remove nothing (a later publish sweeps)
        for name in self.children(posixpath.join(key, CACHE)):
            if name in (keep, current):
                continue
            retired = self._retired_at(key, name)
            if retired is not None and retired < cutoff:
                try:
                    self.fs.rm(self._path(key, CACHE, name), recursive=True)
                except OSError:
                    pass  # another publisher removed it first; a later publish retries otherwise

    def load(self, engine: InfoKVEngine, key: str) -> CompressedDocument:
        where = f"{self.url}/{key}/{CACHE}"
        try:
            pointer = json.loads(self.get(posixpath.join(key, CACHE), CURRENT))
            version, manifest_sha256 = str(pointer["version"]), str(pointer["manifest_sha256"])
        except FileNotFoundError:
            raise CacheStoreError(f"{where} holds no published cache; ingest the document again") from None
        except OSError as exc:
            damaged = f"cannot read {where}/{CURRENT} ({exc}); check the store"
            raise cache_read_error(exc, f"{where}/{CURRENT}", damaged) from exc
        except (ValueError, KeyError, TypeError) as exc:
            raise CacheStoreError(f"{where}/{CURRENT} is damaged ({exc!r}); ingest the document again") from exc
        files = _StoredFiles(self.fs, self._path(key, CACHE, version), f"{where}/{version}")
        try:
            manifest = files.read(store.MANIFEST, store.MAX_MANIFEST_BYTES)
        except OSError as exc:
            damaged = f"{files.where} has no readable manifest ({exc}); ingest again"
            raise cache_read_error(exc, f"{files.where}/{store.MANIFEST}", damaged) from exc
        if hashlib.sha256(manifest).hexdigest() != manifest_sha256:
            raise CacheStoreError(f"{files.where}/{store.MANIFEST} is not the one published; ingest again")
        return engine.load_files(files)

    def put(self, key: str, name: str, data: bytes) -> None:
        self.fs.makedirs(self._path(key), exist_ok=True)
        self._replace(self._path(key, name), data)

    def get(self, key: str, name: str) -> bytes:
        return bytes(self.fs.cat_file(self._path(key, name)))

    def children(self, prefix: str) -> list[str]:
        path = self._path(prefix)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return sorted(
            posixpath.basename(entry["name"].rstrip("/")) for entry in entries if entry.get("type") == "directory"
        )

    def remove(self, key: str, last: str) -> None:
        path = self._path(key)
        final = self._path(key, last)
        for attempt in range(REMOVE_ATTEMPTS):
            try:
                found = self.fs.find(path)
                others = [name for name in found if name.rstrip("/") != final]
                if others:
                    self.fs.rm(others)
                if final in found:
                    self.fs.rm(final)
                if self.fs.exists(path):
                    self.fs.rm(path, recursive=True)  # empty directories a local filesystem keeps
                return
            except OSError as exc:
                # Another process removed some of it meanwhile (and may be removing the rest), or put a file
                # back (as LocalBackend.remove): look again a moment later.
                if not isinstance(exc, FileNotFoundError) and exc.errno != errno.ENOTEMPTY:
                    raise
                time.sleep(0.05 * (attempt + 1))
        if self.fs.exists(path):
            raise OSError(errno.ENOTEMPTY, "files kept appearing while they were removed", path)


def _unless_gone(_function: object, _path: str, info: tuple[type[BaseException], BaseException, object]) -> None:
    """`shutil.rmtree`'s error handler: an entry that another process removed first is removed."""
    if not isinstance(info[1], FileNotFoundError):
        raise info[1]


def open_backend(url: str | os.PathLike[str]) -> CacheBackend:
    """`LocalBackend` for a path, `FsspecBackend` for a URL with a scheme (s3://, file://, ...)."""
    text = str(url)
    if "://" in text:
        return FsspecBackend(text)
    return LocalBackend(text)
