"""Documents and their caches, persisted under the data directory.

Layout (one directory per document; nothing else is ever derived from client input):
  <data_dir>/documents/<id>/meta.json   status, file name, config, counts (written atomically)
  <data_dir>/documents/<id>/document.json  the extracted text and page map (to rebuild a lost or stale cache)
  <data_dir>/documents/<id>/cache/      the verified compressed cache (`infokv_rag.store`)
  <data_dir>/uploads/                   staging area of uploads being received

Ids come from `secrets.token_urlsafe` and are checked against `ID_PATTERN` before any filesystem use,
so a client can neither guess another team's ids nor smuggle a path in. After a restart, ready documents
are answered from their saved caches (loaded lazily, verified, no prefill); documents whose ingestion was
interrupted are read again from their saved source.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..documents import Document
from ..files import write_atomic
from ..loaded import LoadOnceCache

if TYPE_CHECKING:
    from ..document import CompressedDocument
    from ..engine import InfoKVEngine

log = logging.getLogger(__name__)

ID_PREFIX = "doc_"
ID_PATTERN = re.compile(r"^doc_[A-Za-z0-9_-]{22}$")
META = "meta.json"
DOCUMENT = "document.json"
CACHE = "cache"

Status = Literal["queued", "processing", "ready", "failed"]


def new_document_id() -> str:
    return ID_PREFIX + secrets.token_urlsafe(16)  # 128 random bits, 22 url-safe characters


def valid_document_id(value: str) -> bool:
    return isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None


@dataclass
class DocumentRecord:
    """What the service knows about one document; `meta.json` holds the persistent fields."""

    id: str
    filename: str
    status: Status
    method: str
    keep: float | int
    created_at: float
    updated_at: float
    size_bytes: int = 0
    pages: int = 0
    skipped_pages: list[int] = field(default_factory=list)
    tokens: int = 0
    kept_tokens: int | None = None
    cache_bytes: int | None = None
    full_cache_bytes: int | None = None
    compression_ratio: float | None = None
    prefill_seconds: float | None = None
    reason: str | None = None
    reason_code: str | None = None
    # In memory only
    progress_done: int = 0
    progress_total: int = 0
    cache_origin: str | None = None
    """'prefill' (read in this process) or 'disk' (loaded from the saved cache); None while not loaded."""
    deleted: bool = False
    io_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    PERSISTED = (
        "id",
        "filename",
        "status",
        "method",
        "keep",
        "created_at",
        "updated_at",
        "size_bytes",
        "pages",
        "skipped_pages",
        "tokens",
        "kept_tokens",
        "cache_bytes",
        "full_cache_bytes",
        "compression_ratio",
        "prefill_seconds",
        "reason",
        "reason_code",
    )

    def to_meta(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.PERSISTED}

    @classmethod
    def from_meta(cls, data: dict[str, Any]) -> DocumentRecord:
        return cls(**{name: data[name] for name in cls.PERSISTED if name in data})


class Registry:
    """Thread-safe index of documents, their files, and an LRU of caches held in memory."""

    def __init__(self, data_dir: Path, loaded_documents: int = 8) -> None:
        self.data_dir = Path(data_dir)
        self.documents_dir = self.data_dir / "documents"
        self.uploads_dir = self.data_dir / "uploads"
        self._lock = threading.Lock()
        self._records: dict[str, DocumentRecord] = {}
        self._loaded: LoadOnceCache[str, CompressedDocument] = LoadOnceCache(loaded_documents, self._forget_origin)
        self.counters = {"cache_loads": 0}

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

    # Records -------------------------------------------------------------------------------------

    def open(self) -> list[DocumentRecord]:
        """Reads the data directory; returns the documents whose ingestion must (re)start."""
        self.documents_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.uploads_dir, ignore_errors=True)  # half-received uploads of a previous run
        pending: list[DocumentRecord] = []
        for directory in sorted(self.documents_dir.iterdir()):
            if not directory.is_dir() or not valid_document_id(directory.name):
                continue
            try:
                data = json.loads((directory / META).read_text(encoding="utf-8"))
                record = DocumentRecord.from_meta(data)
                if record.id != directory.name:
                    raise ValueError("id does not match its directory")
            except (OSError, ValueError, TypeError, KeyError) as exc:
                log.warning("skipping %s: unreadable %s (%s)", directory, META, exc)
                continue
            self._records[record.id] = record
            if record.status in ("queued", "processing"):
                if (directory / DOCUMENT).is_file():
                    record.status = "queued"
                    pending.append(record)
                else:
                    self.fail(record, "interrupted", "reading was interrupted and the upload is gone; upload it again")
        pending.sort(key=lambda r: r.created_at)
        return pending

    def create(self, record: DocumentRecord, document: Document) -> None:
        directory = self.directory(record.id)
        directory.mkdir(parents=True)
        body = {"text": document.text, **document.layout()}
        write_atomic(directory / DOCUMENT, json.dumps(body).encode("utf-8"))
        self._write_meta(record)
        with self._lock:
            self._records[record.id] = record

    def read_document(self, record: DocumentRecord) -> Document:
        """The extracted document saved at upload (to read it again after a restart or a lost cache)."""
        data = json.loads(self.document_path(record.id).read_text(encoding="utf-8"))
        return Document.from_layout(data.pop("text"), data)

    def get(self, doc_id: str) -> DocumentRecord | None:
        if not valid_document_id(doc_id):
            return None
        with self._lock:
            return self._records.get(doc_id)

    def list(self) -> list[DocumentRecord]:
        with self._lock:
            records = list(self._records.values())
        return sorted(records, key=lambda r: r.created_at)

    def counts(self) -> dict[str, int]:
        counts = {"queued": 0, "processing": 0, "ready": 0, "failed": 0}
        for record in self.list():
            counts[record.status] += 1
        return counts

    def update(self, record: DocumentRecord, **changes: Any) -> bool:
        """Changes and persists a record; False when it was deleted meanwhile."""
        with record.io_lock:
            if record.deleted:
                return False
            for name, value in changes.items():
                setattr(record, name, value)
            record.updated_at = time.time()
            self._write_meta(record)
            return True

    def fail(self, record: DocumentRecord, code: str, reason: str) -> None:
        self.update(record, status="failed", reason=reason, reason_code=code)
        self.forget_loaded(record.id)

    def finish(self, record: DocumentRecord, document: CompressedDocument) -> bool:
        """Saves a freshly read document's cache and marks it ready; False when it was deleted meanwhile."""
        with record.io_lock:
            if record.deleted:
                return False
            document.save(self.cache_path(record.id))
            stats = document.stats
            record.status = "ready"
            record.reason = record.reason_code = None
            record.tokens = stats.document_tokens
            record.kept_tokens = stats.kept_tokens
            record.cache_bytes = stats.cache_bytes
            record.full_cache_bytes = stats.full_cache_bytes
            record.compression_ratio = round(stats.compression_ratio, 6)
            record.prefill_seconds = round(stats.prefill_seconds + stats.scoring_seconds + stats.compression_seconds, 3)
            record.progress_done = record.progress_total = stats.document_tokens
            record.updated_at = time.time()
            self._write_meta(record)
        self.remember_loaded(record, document, "prefill")
        return True

    def delete(self, doc_id: str) -> DocumentRecord | None:
        with self._lock:
            record = self._records.pop(doc_id, None) if valid_document_id(doc_id) else None
        self._loaded.pop(doc_id)
        if record is None:
            return None
        with record.io_lock:  # waits for a cache being saved right now
            record.deleted = True
            shutil.rmtree(self.directory(doc_id), ignore_errors=True)
        return record

    # Caches in memory ----------------------------------------------------------------------------

    def remember_loaded(self, record: DocumentRecord, document: CompressedDocument, origin: str) -> None:
        with self._lock:
            if record.deleted:
                return
            record.cache_origin = origin
        self._loaded.put(record.id, document)

    def _forget_origin(self, doc_id: str) -> None:
        with self._lock:
            record = self._records.get(doc_id)
            if record is not None:
                record.cache_origin = None

    def forget_loaded(self, doc_id: str) -> None:
        self._loaded.pop(doc_id)
        self._forget_origin(doc_id)

    def loaded(self, doc_id: str) -> CompressedDocument | None:
        return self._loaded.get(doc_id)

    def load(self, engine: InfoKVEngine, record: DocumentRecord) -> CompressedDocument:
        """The document's compressed cache: from memory, else loaded and verified from disk (no prefill).

        Raises `CacheStoreError` when the saved cache is missing, damaged or made by another model.
        """

        def from_disk() -> CompressedDocument:
            document = engine.load(self.cache_path(record.id))
            with self._lock:
                self.counters["cache_loads"] += 1
                record.cache_origin = "disk"
            return document

        return self._loaded.get_or_load(record.id, from_disk)
