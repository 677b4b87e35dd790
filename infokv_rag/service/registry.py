"""Documents and their caches, persisted under the data directory.

Layout (one directory per document; nothing else is ever derived from client input):
  <data_dir>/.lock                      held (flock) by the one server process that owns the directory
  <data_dir>/documents/<id>/meta.json   owner, status, file name, config, counts (written atomically)
  <data_dir>/documents/<id>/document.json  the extracted text and page map (to rebuild a lost or stale cache;
                                        checked against its sha256 in meta.json)
  <data_dir>/documents/<id>/cache/      the verified compressed cache (`infokv_rag.store`)
  <data_dir>/documents/.deleting-<id>/  a document being deleted (renamed in one step; meta.json goes last)
  <data_dir>/uploads/                   staging area of uploads being received

Ids come from `secrets.token_urlsafe` and are checked against `ID_PATTERN` before any filesystem use,
so a client can neither guess another tenant's ids nor smuggle a path in. After a restart, ready documents
are answered from their saved caches (loaded lazily, verified, no prefill); documents whose ingestion was
interrupted are read again from their saved source (`ModelWorker.read_again`: failed with `invalid_option` when
their stored options are not usable here); deletions that were interrupted are finished.

Storage failures are never hidden: a write that fails raises `StorageError` (HTTP 507), and a delete
reports success only once the files are gone.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import scorers
from ..config import check_recall
from ..documents import Document, Page
from ..errors import CacheStoreError, ConfigError, DocumentError
from ..files import fsync_dir, replace_directory, write_atomic
from ..loaded import LoadOnceCache
from ..store import loaded_back, save_document
from .errors import StorageError

if TYPE_CHECKING:
    from ..document import CompressedDocument
    from ..engine import InfoKVEngine

log = logging.getLogger(__name__)

ID_PREFIX = "doc_"
ID_PATTERN = re.compile(r"^doc_[A-Za-z0-9_-]{22}$")
META = "meta.json"
DOCUMENT = "document.json"
CACHE = "cache"
DELETING = ".deleting-"
LOCK = ".lock"
DELETE_INCOMPLETE = "delete_incomplete"

Status = Literal["queued", "processing", "ready", "failed"]


def new_document_id() -> str:
    return ID_PREFIX + secrets.token_urlsafe(16)  # 128 random bits, 22 url-safe characters


def valid_document_id(value: str) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


CACHE_FACTS = (
    "tokens",
    "kept_tokens",
    "cache_bytes",
    "cold_bytes",
    "full_cache_bytes",
    "compression_ratio",
    "method_revision",
)
"""The persisted fields of a `DocumentRecord` that describe its cache: a shared cache brings its donor's."""


@dataclass
class DocumentRecord:
    """What the service knows about one document; `meta.json` holds the persistent fields."""

    id: str
    filename: str
    status: Status
    owner: str | None
    """The tenant that uploaded it; None for documents persisted before tenants (visible to admins only)."""
    method: str
    keep: float | int
    created_at: float
    updated_at: float
    recall: float | int = 0
    """Each question's default recall from the cold tier; 0: the document has no cold tier."""
    cold_bits: int | None = None
    """Width of the cold tier's codes; None without a cold tier."""
    stored_bits: int | None = None
    """Width of the codes the kept entries are held in; None: at the model's dtype."""
    method_revision: int | None = None
    """The revision of `method` (`Method.revision`) its cache was made by; None until a cache is made, and in
    records saved before it was kept. With `share_caches` only a cache of the current revision is shared: a
    release that changes what a method keeps must not hand a new upload a cache made before the change."""
    size_bytes: int = 0
    pages: int = 0
    skipped_pages: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """What the loader warned about when the upload was read (pages skipped, stray bytes read as Windows-1252);
    absent from records saved before it was kept: none."""
    tokens: int = 0
    kept_tokens: int | None = None
    cache_bytes: int | None = None
    cold_bytes: int | None = None
    full_cache_bytes: int | None = None
    compression_ratio: float | None = None
    prefill_seconds: float | None = None
    reason: str | None = None
    reason_code: str | None = None
    sha256: str | None = None
    """Of the uploaded file: with `share_caches`, identical uploads reuse one prefill."""
    saved_text_sha256: str | None = None
    """Of document.json (the extracted text and page map) as written at upload, checked whenever it is read again
    (`saved_document`); None in records saved before it was kept, whose text is read unchecked."""
    # In memory only
    progress_done: int = 0
    progress_total: int = 0
    cache_origin: str | None = None
    """'prefill' (read in this process) or 'disk' (loaded from the saved cache): where this process last got the
    cache from; None before it first held it, and after it dropped it as gone or unusable (`forget_loaded`)."""
    deleted: bool = False
    """Its directory is gone or retired for deletion: nothing may write for it any more."""
    io_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    PERSISTED = (
        "id",
        "owner",
        "sha256",
        "saved_text_sha256",
        "filename",
        "status",
        "method",
        "keep",
        "recall",
        "cold_bits",
        "stored_bits",
        "created_at",
        "updated_at",
        "size_bytes",
        "pages",
        "skipped_pages",
        "warnings",
        *CACHE_FACTS,
        "prefill_seconds",
        "reason",
        "reason_code",
    )

    def to_meta(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.PERSISTED}

    @classmethod
    def from_meta(cls, data: dict[str, Any]) -> DocumentRecord:
        # meta.json of a version without tenants has no "owner": such documents belong to no tenant.
        values = {name: data[name] for name in cls.PERSISTED if name in data}
        values.setdefault("owner", None)
        try:
            record = cls(**values)
        except TypeError as exc:
            raise ValueError(f"the record lacks fields ({exc})") from None
        # Every field, not only those a listing needs first: a record with one field of the wrong type would
        # otherwise be listed, and fail every listing that shows it (the response's schema refuses it).
        for name, hint in _persisted_types().items():
            if not _conforms(getattr(record, name), hint):
                raise ValueError(f"the record's {name} is malformed ({str(getattr(record, name))[:40]!r})")
        if not record.method or record.keep <= 0:
            raise ValueError("the record's method or keep is malformed")
        try:
            check_recall(record.recall)
        except ConfigError as exc:
            raise ValueError(f"the record's recall is malformed ({exc})") from None
        if record.status == "ready":  # progress is kept in memory only; a ready document was read to its end
            record.progress_done = record.progress_total = record.tokens
        return record


@functools.cache
def _persisted_types() -> dict[str, Any]:
    """The type of each persisted field of `DocumentRecord` (its annotations, resolved once)."""
    hints = typing.get_type_hints(DocumentRecord)
    return {name: hints[name] for name in DocumentRecord.PERSISTED}


def _conforms(value: object, hint: Any) -> bool:
    """Whether `value`, read from JSON, has the type `hint` (a bool is no number; a number is finite)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(value == option and type(value) is type(option) for option in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, option) for option in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_conforms(entry, item) for entry in value)
    if hint is float:  # JSON writes a whole float without its point
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def document_file(record: DocumentRecord, document: Document) -> bytes:
    """document.json of a new upload (its text and page map); records its sha256 in `record`."""
    data = json.dumps({"text": document.text, **document.layout()}).encode("utf-8")
    record.saved_text_sha256 = hashlib.sha256(data).hexdigest()
    return data


def saved_document(record: DocumentRecord, data: bytes) -> Document:
    """The document that `data`, `record`'s document.json, holds; `DocumentError` (the document then fails with
    `unreadable_document`) when it is not what was saved at upload: read again from damaged text, it would be
    answered from as if it were the document."""
    if record.saved_text_sha256 is not None and hashlib.sha256(data).hexdigest() != record.saved_text_sha256:
        raise _damaged_text("its sha256 is not the one recorded at upload")
    try:
        layout = json.loads(data)
        return Document.from_layout(layout.pop("text"), layout)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # text saved before checksums, damaged
        raise _damaged_text(f"it does not read as it was saved: {type(exc).__name__}") from exc


def _damaged_text(why: str) -> DocumentError:
    return DocumentError(
        f"this document's saved text is damaged in the server's storage ({why}), so it cannot be read again; "
        "upload it again"
    )


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _remove_tree(directory: Path) -> None:
    """Removes `directory`, its meta.json last, so that a partial removal still says whose files remain.

    Raises the first OSError after removing everything it can; a missing directory is already removed.
    """
    if not directory.exists():
        return
    failures: list[OSError] = []

    def collect(_function: object, _path: str, info: tuple[type[BaseException], BaseException, object]) -> None:
        exc = info[1]
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            failures.append(exc)

    for entry in directory.iterdir():
        if entry.name == META:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, onerror=collect)  # onexc needs Python 3.12
        else:
            try:
                entry.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                failures.append(exc)
    if failures:
        raise failures[0]
    (directory / META).unlink(missing_ok=True)
    directory.rmdir()
    fsync_dir(directory.parent)


def _remove_temporaries(directory: Path) -> None:
    """Temporary files and cache staging directories that a killed process left in a document directory."""
    for leftover in directory.glob(".*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)


class Registry:
    """Thread-safe index of documents, their files, and an LRU of caches held in memory."""

    load_origin = "disk"
    """`cache_origin` of a document whose cache was loaded rather than read in this process."""
    retries_by_lease = False
    """Whether a document left queued or processing is read again once its reader's lease runs out (a shared store's
    takeovers): a reading that the storage interrupted is then left to it rather than failed."""

    def __init__(self, data_dir: Path, loaded_documents: int = 8) -> None:
        self.data_dir = Path(data_dir)
        self.documents_dir = self.data_dir / "documents"
        self.uploads_dir = self.data_dir / "uploads"
        self._lock = threading.Lock()
        self._records: dict[str, DocumentRecord] = {}
        self._loaded: LoadOnceCache[str, CompressedDocument] = LoadOnceCache(loaded_documents)
        self._lock_file: int | None = None
        self.counters = {"cache_loads": 0, "cache_shares": 0}

    # Start-up ------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Refuses (ConfigError naming the path and the reason) a data directory this process cannot own.

        Creates the layout, proves that files can be written, synced, renamed and removed in it, and takes
        its lock, so that two servers never share one directory.
        """
        step, path = "create", self.data_dir
        try:
            for path in (self.data_dir, self.documents_dir, self.uploads_dir):
                step = "create"
                path.mkdir(parents=True, exist_ok=True)
                step = "write a file in"
                probe = path / f".write-probe-{os.getpid()}"
                write_atomic(probe, b"probe")
                step = "remove a file from"
                probe.unlink()
            path, step = self.data_dir / LOCK, "lock"
            handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(handle)
                raise
        except OSError as exc:
            if step == "lock" and exc.errno in (errno.EAGAIN, errno.EACCES):
                reason, remedy = "another server process is using it", "stop that server"
            else:
                reason, remedy = exc.strerror or str(exc), "fix its permissions or free space"
            raise ConfigError(
                f"the data directory {self.data_dir} is not usable: cannot {step} {path} ({reason}); "
                f"{remedy}, or choose another with --data-dir / INFOKV_DATA_DIR"
            ) from None
        self._lock_file = handle

    def close(self) -> None:
        if self._lock_file is not None:
            os.close(self._lock_file)  # closing the descriptor releases the flock
            self._lock_file = None

    # Files ---------------------------------------------------------------------------------------

    def directory(self, doc_id: str) -> Path:
        if not valid_document_id(doc_id):  # the only place a path is built from an id
            raise ValueError(f"invalid document id {doc_id!r}")
        return self.documents_dir / doc_id

    def document_path(self, doc_id: str) -> Path:
        return self.directory(doc_id) / DOCUMENT

    def cache_path(self, doc_id: str) -> Path:
        return self.directory(doc_id) / CACHE

    def staging_dir(self) -> Path:
        """A fresh private directory for one upload being received."""
        self.uploads_dir.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="upload-", dir=self.uploads_dir))

    def _write_meta(self, record: DocumentRecord) -> None:
        write_atomic(self.directory(record.id) / META, json.dumps(record.to_meta(), indent=1).encode("utf-8"))

    def _save_status(self, record: DocumentRecord, consequence: str | None = None) -> None:
        """Stamps the record as changed now and writes its meta file; `StorageError` when the disk refuses, saying
        `consequence` (by default: nothing was kept)."""
        record.updated_at = time.time()
        try:
            self._write_meta(record)
        except OSError as exc:
            raise StorageError("save the document's status", exc, consequence) from exc

    # Records -------------------------------------------------------------------------------------

    def open(self) -> list[DocumentRecord]:
        """Reads the data directory; returns the documents whose ingestion must (re)start.

        Whatever a killed process left half-done is settled first: half-received uploads, uploads whose meta
        file was never written and temporary files are removed, interrupted deletions are finished (or shown as
        `delete_incomplete`).
        """
        self.documents_dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.uploads_dir.glob("upload-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # half-received uploads of a previous run
        pending: list[DocumentRecord] = []
        for directory in sorted(self.documents_dir.iterdir()):
            if directory.name.startswith(DELETING):
                self._finish_interrupted_delete(directory)
                continue
            if not directory.is_dir() or not valid_document_id(directory.name):
                continue
            if not (directory / META).exists():
                # `create` writes the meta file last: this upload was never listed, nor answered to its uploader.
                shutil.rmtree(directory, ignore_errors=True)
                continue
            record = self._read_meta(directory, directory.name)
            if record is None:
                continue
            _remove_temporaries(directory)
            self._records[record.id] = record
            if record.status in ("queued", "processing"):
                if (directory / DOCUMENT).is_file():
                    record.status = "queued"
                    pending.append(record)
                else:
                    self.fail(record, "interrupted", "reading was interrupted and the upload is gone; upload it again")
        pending.sort(key=lambda r: r.created_at)
        return pending

    @staticmethod
    def _read_meta(directory: Path, doc_id: str) -> DocumentRecord | None:
        try:
            data = json.loads((directory / META).read_text(encoding="utf-8"))
            record = DocumentRecord.from_meta(data)
            if record.id != doc_id:
                raise ValueError("id does not match its directory")
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("skipping %s: unreadable %s (%s)", directory, META, exc)
            return None
        return record

    def _finish_interrupted_delete(self, trash: Path) -> None:
        doc_id = trash.name.removeprefix(DELETING)
        if not valid_document_id(doc_id):
            return
        try:
            _remove_tree(trash)
            return
        except OSError as exc:
            failure = exc
        record = self._read_meta(trash, doc_id)
        if record is not None:  # still there, and the meta file says whose: keep it visible
            record.deleted = True
            self._mark_delete_incomplete(record, failure)
            self._records[record.id] = record

    def create(self, record: DocumentRecord, document: Document) -> None:
        """Persists a new upload (its text, then its meta file) durably; StorageError leaves nothing behind."""
        directory = self.directory(record.id)
        try:
            directory.mkdir(parents=True)
            fsync_dir(self.documents_dir)
            write_atomic(directory / DOCUMENT, document_file(record, document))
            self._write_meta(record)
        except OSError as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise StorageError("save the upload", exc) from exc
        with self._lock:
            self._records[record.id] = record

    def read_document(self, record: DocumentRecord) -> Document:
        """The extracted document saved at upload (to read it again after a restart or a lost cache), checked
        (`saved_document`)."""
        return saved_document(record, self.document_path(record.id).read_bytes())

    def get(self, doc_id: str) -> DocumentRecord | None:
        if not valid_document_id(doc_id):
            return None
        with self._lock:
            return self._records.get(doc_id)

    def list(self) -> list[DocumentRecord]:
        with self._lock:
            records = list(self._records.values())
        return sorted(records, key=lambda r: r.created_at)

    def documents_of(self, tenant: str) -> int:
        """How many documents `tenant` keeps (every status), as `list` reads them."""
        return sum(record.owner == tenant for record in self.list())

    def counts(self) -> dict[str, int]:
        counts = {"queued": 0, "processing": 0, "ready": 0, "failed": 0}
        for record in self.list():
            counts[record.status] += 1
        return counts

    def update(self, record: DocumentRecord, *, if_status: str | None = None, **changes: Any) -> bool:
        """Changes and persists a record; False when it was deleted meanwhile (also when a delete elsewhere is
        only found out by writing it), or when its status is not `if_status` (a check and change in one step).
        StorageError when the meta file cannot be written: the record is then left as it was, so that what this
        process serves is what a restart would find."""
        with record.io_lock:
            if record.deleted or (if_status is not None and record.status != if_status):
                return False
            before = {name: getattr(record, name) for name in (*changes, "updated_at")}
            for name, value in changes.items():
                setattr(record, name, value)
            try:
                self._save_status(record)
            except StorageError:
                for name, value in before.items():
                    setattr(record, name, value)
                raise
            return not record.deleted

    def still_to_read(self, record: DocumentRecord) -> bool:
        """Whether a document queued to be read still is (not deleted, nor read or failed meanwhile)."""
        return not record.deleted and record.status in ("queued", "processing")

    def confirm_listed(self, record: DocumentRecord) -> bool:
        """False once `record` is deleted (a delete here marks the record at once; `StoreRegistry` also looks for
        deletes by other processes, and raises a `StorageError` when its store cannot tell)."""
        return not record.deleted

    def fail(self, record: DocumentRecord, code: str, reason: str) -> None:
        """Marks the record failed. Where the disk refuses, the failure still stands in memory (nothing here will
        read it again); after a restart the meta file still says queued or processing, and it is read again."""
        try:
            self.update(record, status="failed", reason=reason, reason_code=code)
        except StorageError:
            log.exception("could not persist the failure of %s", record.id)
            with record.io_lock:
                if not record.deleted:
                    record.status, record.reason, record.reason_code = "failed", reason, code
        self.forget_loaded(record.id)

    def finish(self, record: DocumentRecord, document: CompressedDocument) -> bool:
        """Saves a freshly read document's cache and marks it ready; False when it was deleted meanwhile.

        Raises `CacheStoreError` or `StorageError` when the cache or the meta file cannot be written.
        """
        with record.io_lock:
            if record.deleted:
                return False
            self._save_cache(record.id, document)
            stats = document.stats
            # Where its cache came from, with the status that shows it: a poll must not read ready and no origin.
            record.cache_origin = "prefill"
            record.status = "ready"
            record.method_revision = scorers.method(record.method).revision
            record.reason = record.reason_code = None
            record.tokens = stats.document_tokens
            record.kept_tokens = stats.kept_tokens
            record.cache_bytes = stats.cache_bytes
            record.cold_bytes = stats.cold_bytes
            record.full_cache_bytes = stats.full_cache_bytes
            record.compression_ratio = round(stats.compression_ratio, 6)
            record.prefill_seconds = round(stats.prefill_seconds + stats.scoring_seconds + stats.compression_seconds, 3)
            record.progress_done = record.progress_total = stats.document_tokens
            self._save_status(
                record,
                "its cache was saved but cannot be marked ready, so the document is failed; delete it and upload it "
                "again later, or tell the operator",
            )
            if record.deleted:  # found out by writing the record: the write took the cache away again
                return False
        self.remember_loaded(
            record, loaded_back(document, functools.partial(self._load_cache, document.engine, record.id)), "prefill"
        )
        return True

    def _save_cache(self, doc_id: str, document: CompressedDocument) -> None:
        save_document(document, self.cache_path(doc_id), owned=True)  # a damaged cache of ours is replaced

    def _load_cache(self, engine: InfoKVEngine, doc_id: str) -> CompressedDocument:
        return engine.load(self.cache_path(doc_id))

    def share(self, record: DocumentRecord, engine: InfoKVEngine) -> bool:
        """Gives `record` a copy of an identical ready document's cache (`share_caches`); False when no such
        document's cache can be used, and `record` is then read as any other upload.

        The copy is verified as a load verifies a saved cache, and must hold `record`'s document, before it replaces
        whatever `record` has (a document read again after its cache was lost may have a twin): a donor whose
        cache is lost or damaged shares nothing (it is read again itself when next asked). The files are hard
        links where the filesystem allows (a cache is never modified in place: a new save replaces the
        directory), so sharing costs no space. `StorageError` when a verified copy cannot be put in place.
        """
        if record.sha256 is None:
            return False
        revision = scorers.method(record.method).revision
        candidates = [
            other
            for other in self.list()
            if other is not record
            and other.status == "ready"
            and other.sha256 == record.sha256
            and other.method == record.method
            and _budget(other.keep) == _budget(record.keep)
            and _budget(other.recall) == _budget(record.recall)
            and other.cold_bits == record.cold_bits
            and other.stored_bits == record.stored_bits
            and other.method_revision == revision
        ]
        # The same file read into other text (by an older release) is not an identical document.
        pages = self._saved_pages(record) if candidates else None
        donors = (other for other in candidates if pages is not None and self._saved_pages(other) == pages)
        return any(self._share_from(donor, record, engine) for donor in donors)

    def _share_from(self, donor: DocumentRecord, record: DocumentRecord, engine: InfoKVEngine) -> bool:
        with donor.io_lock, record.io_lock:
            if donor.deleted or record.deleted:
                return False
            try:
                staging = Path(tempfile.mkdtemp(prefix=".cache.sharing-", dir=self.directory(record.id)))
            except OSError as exc:
                raise StorageError("copy a shared cache", exc) from exc
            try:
                try:
                    shutil.copytree(self.cache_path(donor.id), staging / CACHE, copy_function=_link_or_copy)
                    _check_belongs(record, engine.load(staging / CACHE))
                except Exception as exc:  # noqa: BLE001 - sharing only saves a prefill; reading it decides
                    # Whatever fails the copy's check (its files, its verification, moving its tensors onto a full
                    # GPU) leaves the document to be read, which settles it ready or failed.
                    log.warning("%s cannot share the cache of %s, reading it instead: %r", record.id, donor.id, exc)
                    return False
                try:
                    replace_directory(staging / CACHE, self.cache_path(record.id))
                except OSError as exc:
                    raise StorageError("copy a shared cache", exc) from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            for name in CACHE_FACTS:
                setattr(record, name, getattr(donor, name))
            # Counted before the record reads ready, so that whoever sees it ready sees the count too.
            with self._lock:
                self.counters["cache_shares"] += 1
            record.status, record.prefill_seconds = "ready", 0.0
            record.progress_done = record.progress_total = record.tokens
            self._save_status(record)
        return True

    def _saved_pages(self, record: DocumentRecord) -> tuple[Page, ...] | None:
        """The pages of the document saved at upload; None where it cannot be read back (it shares nothing)."""
        try:
            return self.read_document(record).pages
        except (OSError, DocumentError):
            return None

    def delete(self, record: DocumentRecord) -> None:
        """Removes the document's files; returns only once they are gone, durably (synced to disk).

        The directory is first renamed aside (one atomic step), then emptied with meta.json last. When the
        rename fails, nothing changed and the document stays as it was. When removing fails later, the
        document stays listed as failed with reason_code `delete_incomplete` (DELETE again to retry; a
        restart retries too). Either way a `StorageError` says what failed.
        """
        trash = self.documents_dir / f"{DELETING}{record.id}"
        with record.io_lock:  # waits for a cache being saved right now
            if not record.deleted:
                try:
                    os.rename(self.directory(record.id), trash)
                except FileNotFoundError:
                    pass  # nothing on disk (e.g. removed by hand): only the record is left to drop
                except OSError as exc:
                    raise StorageError("delete the document", exc, "the document is unchanged") from exc
                record.deleted = True
            self.forget_loaded(record.id)
            try:
                # The rename is made durable first: a crash while the files are removed then leaves .deleting-<id>,
                # which the restart finishes, never the document back in place with some of its files gone.
                fsync_dir(self.documents_dir)
                _remove_tree(trash)
            except OSError as exc:
                raise self._incomplete_delete(record, exc) from exc
        with self._lock:
            self._records.pop(record.id, None)

    @classmethod
    def _incomplete_delete(cls, record: DocumentRecord, exc: OSError) -> StorageError:
        """Marks `record` as `delete_incomplete`; the error that says so to the client."""
        cls._mark_delete_incomplete(record, exc)
        return StorageError(
            "remove all of the document's files", exc, "it is listed as failed (delete_incomplete); send DELETE again"
        )

    @staticmethod
    def _mark_delete_incomplete(record: DocumentRecord, exc: OSError) -> None:
        # In memory only: the document's files now lie under .deleting-<id>, which says the same on restart.
        record.status = "failed"
        record.reason_code = DELETE_INCOMPLETE
        record.reason = (
            f"deleting this document did not finish ({exc.strerror or exc}); some of its files "
            "remain: send DELETE again"
        )
        record.cache_origin = None

    # Caches in memory ----------------------------------------------------------------------------

    def remember_loaded(self, record: DocumentRecord, document: CompressedDocument, origin: str) -> None:
        with self._lock:
            if record.deleted:
                return
            record.cache_origin = origin
        self._loaded.put(record.id, document)
        if record.deleted:  # deleted meanwhile: not kept in memory
            self.forget_loaded(record.id)

    def forget_loaded(self, doc_id: str) -> None:
        """Drops the document's cache from memory and its `cache_origin`: the cache is gone or not to be used. (A
        cache the LRU drops for room keeps its origin: its change would tell a tenant that others load theirs.)"""
        self._loaded.pop(doc_id)
        with self._lock:
            record = self._records.get(doc_id)
            if record is not None:
                record.cache_origin = None

    def loaded(self, doc_id: str) -> CompressedDocument | None:
        return self._loaded.get(doc_id)

    def load(self, engine: InfoKVEngine, record: DocumentRecord) -> CompressedDocument:
        """The document's compressed cache: from memory, else loaded and verified from disk (no prefill).

        Raises `CacheStoreError` when the saved cache is missing, damaged, made by another model, or not this
        document's (`_check_belongs`).
        """

        def from_disk() -> CompressedDocument:
            document = self._load_cache(engine, record.id)
            _check_belongs(record, document)
            with self._lock:
                self.counters["cache_loads"] += 1
                if record.cache_origin is None:  # a cache the LRU dropped for room keeps its origin when loaded back
                    record.cache_origin = self.load_origin
            return document

        document = self._loaded.get_or_load(record.id, from_disk)
        if record.deleted:  # deleted while it loaded: answers what was asked, but is not kept in memory
            self.forget_loaded(record.id)
        return document


def _budget(value: float | int) -> tuple[str, float | int]:
    """A keep or recall budget as a value to compare: `1` (one token) and `1.0` (a ratio: every token) are equal
    numbers, but other budgets."""
    return type(value).__name__, value


def _check_belongs(record: DocumentRecord, document: CompressedDocument) -> None:
    """Refuses (`CacheStoreError`) a whole, verified cache that is not this record's: another upload's, or one
    made with other options (moved into place by hand, or shared by a release that took a count for a ratio). The
    document is then read again. The recall budget is compared too, though the cache's bytes do not depend on it:
    the cache's config gives each question's default recall."""
    config = document.config
    made_with = (
        config.method,
        _budget(config.keep),
        config.stored_bits,
        _budget(config.recall) if config.recall else None,
        config.cold_bits if config.recall else None,
    )
    # A recall of 0 or 0.0 keeps no cold tier; its saved config leaves the field out, and reads it back as 0.
    asked = (
        record.method,
        _budget(record.keep),
        record.stored_bits,
        _budget(record.recall) if record.recall else None,
        record.cold_bits,
    )
    if (record.sha256 is not None and document.document.sha256 != record.sha256) or made_with != asked:
        raise CacheStoreError(f"the saved cache of {record.id} holds another document or was made with other options")
