"""Documents kept in a shared cache store (`--store s3://bucket/prefix`, `file:///shared/dir`, a shared path),
so that any number of service processes (Ray Serve replicas) serve the same documents.

Layout in the store (`infokv_rag.cache_backends`):
  documents/<id>/meta.json      owner (tenant), status, counts, and the ingestion lease (who reads it, until when)
  documents/<id>/document.json  the extracted text and page map (to read the document again anywhere)
  documents/<id>/cache/         the published compressed cache (versions + CURRENT; verified on load)
  pending/<id>/lease            present while the document is queued or being read (what takeovers scan); holds
                                the deadline of the lease it was last written with
  deleted/<id>/tombstone        written before a delete removes the document, and kept (an empty object per
                                deleted document; ids are never reused)
Only the staging of uploads being received stays on the local disk: each process's own `staging-<hex>` directory
under the data directory, locked while it lives and removed when it stops; one a killed process left is removed by
the next process that starts there.

Every request reads the document's record from the store, so a document that another process read, failed
or deleted is seen as such here; when the store cannot be read, a question or a read of one document is refused
(`StoreUnreadable`), never answered from this process's memory, which would not know of a delete. A process
that writes a record holds its ingestion lease for `lease_seconds`; `LeaseKeeper` renews the leases of the
documents this process is reading, and takes over a queued or processing document whose lease has run out (its
reader died): the document is read again from its saved text, never lost (or failed with `invalid_option` when
its stored options are not usable here, rather than claimed again every tick). Two processes that take over the
same document at once both read it; their publishes are atomic, so the cache is whole either way.

A delete can meet a process that is still reading the document (or renewing its lease): that process knows
nothing of the delete and would write the record and the cache back after it. So a delete leaves a
tombstone first, every write of a record looks for one afterwards (and removes what it wrote if it finds
one), and a document with a tombstone reads as gone (whatever is left of it, removed when it is read or
listed). Whichever order the two meet in, a deleted document stays deleted.
"""

from __future__ import annotations

import builtins
import fcntl
import json
import logging
import os
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cache_backends import CacheBackend, open_backend
from ..documents import Document
from ..errors import ConfigError
from .errors import StorageError, StoreUnreadable
from .registry import (
    DOCUMENT,
    META,
    DocumentRecord,
    Registry,
    document_file,
    saved_document,
    valid_document_id,
)

if TYPE_CHECKING:
    from ..document import CompressedDocument
    from ..engine import InfoKVEngine
    from .settings import Settings
    from .worker import ModelWorker

log = logging.getLogger(__name__)

STAGING_PREFIX = "staging-"
"""Each process's local directory under the data directory, for the uploads it is receiving (`_claim_staging`)."""
DOCUMENTS = "documents"
PENDING = "pending"
PENDING_MARK = "lease"
PENDING_STATUSES = ("queued", "processing")
PROBE = "probes"
DELETED = "deleted"
TOMBSTONE = "tombstone"
DELETE_CHECK_SECONDS = 1.0
"""How often a process looks for the tombstones of the documents it is answering (`DeleteWatcher`)."""
CLAIM_SETTLE_SECONDS = 0.5
"""After claiming an expired lease, wait this long before reading the record back to see who won."""


def _lease(data: dict[str, Any]) -> dict[str, Any]:
    """The lease of a stored record (empty when it has none, or none that reads as one)."""
    lease = data.get("lease")
    return lease if isinstance(lease, dict) else {}


def _key(doc_id: str) -> str:
    if not valid_document_id(doc_id):  # the only place a store key is built from an id
        raise ValueError(f"invalid document id {doc_id!r}")
    return f"{DOCUMENTS}/{doc_id}"


class StoreRegistry(Registry):
    """A `Registry` whose records, texts and caches live in a `CacheBackend` shared by many processes."""

    load_origin = "store"
    retries_by_lease = True

    def __init__(self, backend: CacheBackend, staging_dir: Path, loaded_documents: int, lease_seconds: float) -> None:
        super().__init__(staging_dir, loaded_documents)
        self.backend = backend
        self.lease_seconds = lease_seconds
        self.holder = secrets.token_hex(8)
        """Names this process in the leases it writes."""
        self.counters["takeovers"] = 0

    # Start-up ------------------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Refuses (ConfigError naming the store and the reason) a store this process cannot write to; makes this
        process's staging directory (`_claim_staging`)."""
        probe = f"{PROBE}/{self.holder}"
        try:
            self._claim_staging()
            self.uploads_dir.mkdir(parents=True, exist_ok=True)
            self.backend.put(probe, "probe", b"probe")
            self.backend.get(probe, "probe")
            self.backend.remove(probe, last="probe")
        except OSError as exc:
            raise ConfigError(
                f"the store {self.backend.url} is not usable ({exc}); check its URL, credentials "
                "(e.g. AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL) and permissions"
            ) from None

    def _claim_staging(self) -> None:
        """Makes this process's staging directory, locked (flock on the directory, held until `close`) before it
        takes its name: another process's sweep (`_sweep_staging`) never sees it unlocked while this one lives."""
        if self._lock_file is not None:
            return
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        claiming = self.data_dir.with_name(f".{self.data_dir.name}.new")
        claiming.mkdir(mode=0o700)
        handle = os.open(claiming, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(claiming, self.data_dir)
        except OSError:
            os.close(handle)
            shutil.rmtree(claiming, ignore_errors=True)
            raise
        self._lock_file = handle

    def _sweep_staging(self) -> None:
        """Removes the staging directories beside this one that no live process holds (`_claim_staging`): a
        process killed with uploads half received left them."""
        for sibling in self.data_dir.parent.glob(f"{STAGING_PREFIX}*"):
            if sibling == self.data_dir:
                continue
            try:
                handle = os.open(sibling, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its process lives
            else:
                shutil.rmtree(sibling, ignore_errors=True)
            finally:
                os.close(handle)

    def close(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)
        super().close()

    def open(self) -> list[DocumentRecord]:
        """Reads the store's records. Nothing is returned to read again: `LeaseKeeper` takes over documents
        whose reader died, whichever process that was."""
        self._sweep_staging()
        shutil.rmtree(self.uploads_dir, ignore_errors=True)
        self.uploads_dir.mkdir(parents=True, exist_ok=True)
        self.list()
        return []

    # Records -------------------------------------------------------------------------------------

    def _write_meta(self, record: DocumentRecord) -> None:
        until = time.time() + self.lease_seconds
        meta = {**record.to_meta(), "lease": {"holder": self.holder, "until": until}}
        pending = record.status in PENDING_STATUSES
        failure: OSError | None = None
        try:
            if pending:  # the mark first: a pending record without one would never be taken over
                self._mark_pending(record.id, until)
            self.backend.put(_key(record.id), META, json.dumps(meta, indent=1).encode("utf-8"))
            if not pending:
                self._unmark_pending(record.id)
        except OSError as exc:
            # A delete elsewhere removing the document under this write makes it fail (a file put into a
            # directory that vanished): then the delete won, which the tombstone tells.
            failure = exc
        if self._deleted(record.id):  # a delete elsewhere came first: this write brought the document back
            record.deleted = True
            self._remove_leftovers(record.id)
        elif failure is not None:
            raise failure

    def _mark_pending(self, doc_id: str, until: float) -> None:
        self.backend.put(f"{PENDING}/{doc_id}", PENDING_MARK, json.dumps({"until": until}).encode("utf-8"))

    def _unmark_pending(self, doc_id: str) -> None:
        self.backend.remove(f"{PENDING}/{doc_id}", last=PENDING_MARK)

    def _mark_until(self, doc_id: str) -> float | None:
        """The lease deadline that the pending mark of `doc_id` was last written with; None when there is no mark,
        0 for a mark that holds none (written by an earlier version)."""
        try:
            data = json.loads(self.backend.get(f"{PENDING}/{doc_id}", PENDING_MARK))
            return float(data["until"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return 0.0

    def _remove_stale_mark(self, doc_id: str, now: float) -> None:
        """Removes the pending mark of a document that is not pending (or has no record), once no write can be
        on its way: it is what a process killed between a record and its mark's removal left."""
        # A writer puts the mark before the record, so a scan between the two finds no record (a new upload) or
        # the old one (a document read again); removing that mark would leave the pending record without one,
        # never taken over if its writer died. A mark written within its lease may be such a write: it stays.
        until = self._mark_until(doc_id)
        if until is None or until > now:
            return
        self._unmark_pending(doc_id)
        # The store cannot remove a mark only if it is the one looked at: a write that put a fresh mark after the
        # look loses it to this removal. Its record, once written, says so: looking again puts the mark back (and a
        # record written after this second look gets its mark back from its writer's next renewal).
        data = self._stored_meta(doc_id)
        if data is not None and data.get("status") in PENDING_STATUSES:
            self._mark_pending(doc_id, float(_lease(data).get("until", 0)))

    def _deleted(self, doc_id: str) -> bool:
        try:
            self.backend.get(f"{DELETED}/{doc_id}", TOMBSTONE)
        except FileNotFoundError:
            return False
        return True

    def _remove_leftovers(self, doc_id: str) -> None:
        """Removes what a write that lost to a delete left of a deleted document (the delete may be removing
        it at the same moment: a failure is logged, and the next read of the record tries again)."""
        self.forget_loaded(doc_id)
        try:
            self.backend.remove(_key(doc_id), last=META)
            self._unmark_pending(doc_id)
        except OSError as exc:
            log.warning("cannot remove what is left of the deleted document %s: %s", doc_id, exc)

    def _stored_meta(self, doc_id: str) -> dict[str, Any] | None:
        """The record as the store has it now; None when it is gone (deleted by any process).

        The tombstone is looked up first, for every id: an id that was never stored then costs the store the
        same two requests as one that is (another tenant's); only reading the record found differs. What
        is left of a deleted document is removed: a record, or a cache without one (its reader, which had not
        seen the delete, was killed between publishing the cache and writing the record that would find it)."""
        if self._deleted(doc_id):
            self._remove_leftovers(doc_id)
            return None
        try:
            data = json.loads(self.backend.get(_key(doc_id), META))
        except FileNotFoundError:
            return None
        if not isinstance(data, dict) or data.get("id") != doc_id:
            raise ValueError("the record does not describe this document")
        return data

    def _refresh(self, doc_id: str) -> DocumentRecord | None:
        """The record as the store has it now (None when deleted); OSError when the store cannot be read."""
        try:
            data = self._stored_meta(doc_id)
            fresh = DocumentRecord.from_meta(data) if data is not None else None
        except ValueError as exc:
            # A malformed record (its tombstone was looked for, and there is none) is logged and passed over: it
            # must not fail a listing (every tenant's), a replica's start or the takeovers.
            log.warning("cannot read the record of %s from the store: %s", doc_id, exc)
            with self._lock:
                return self._records.get(doc_id)
        with self._lock:
            known = self._records.get(doc_id)
            if data is None or fresh is None:
                if known is not None:
                    known.deleted = True
                    self._records.pop(doc_id, None)
            elif known is None:
                known = self._records[doc_id] = fresh
            elif _lease(data).get("holder") != self.holder:
                # Another process wrote it last (read it, failed it): the store is right. Records this
                # process writes itself are newer in memory (progress) than in the store. Another's progress is
                # unknown here but for a ready record, which was read to its end.
                for name in (*DocumentRecord.PERSISTED, "progress_done", "progress_total"):
                    setattr(known, name, getattr(fresh, name))
        if data is None:
            self.forget_loaded(doc_id)
            return None
        return known

    def get(self, doc_id: str) -> DocumentRecord | None:
        """The record as the store has it now; `StoreUnreadable` (503) when the store cannot be read: what this
        process holds of it may have been deleted by another, so its cache in memory is dropped, not answered."""
        if not valid_document_id(doc_id):
            return None
        try:
            return self._refresh(doc_id)
        except OSError as exc:
            log.warning("cannot read the record of %s from the store: %s", doc_id, exc)
            self.forget_loaded(doc_id)
            raise StoreUnreadable(exc) from exc

    def still_to_read(self, record: DocumentRecord) -> bool:
        """As the store has it now: a reader whose lease ran out while it was still alive may have finished since a
        takeover queued the document here, and reading it again would set it back to processing for a prefill."""
        try:
            fresh = self._refresh(record.id)
        except OSError:
            return super().still_to_read(record)  # cannot tell: as this process last read it
        return fresh is not None and super().still_to_read(fresh)

    def list(self) -> list[DocumentRecord]:
        """Every record as the store has it now. Unlike `get`, a store that cannot be read lists the records (or the
        one record) as this process last read them: a listing serves no document, and one record the store fails to
        return must not fail every tenant's listing nor a replica's start; a question about one of them still
        reads it from the store (`get`)."""
        try:
            ids = [doc_id for doc_id in self.backend.children(DOCUMENTS) if valid_document_id(doc_id)]
        except OSError as exc:
            log.warning("cannot list the store's documents: %s", exc)
            return super().list()
        with self._lock:
            gone = set(self._records) - set(ids)
        records = [record for record in map(self._listed, [*ids, *gone]) if record is not None]
        return sorted(records, key=lambda r: r.created_at)

    def _listed(self, doc_id: str) -> DocumentRecord | None:
        try:
            return self._refresh(doc_id)
        except OSError as exc:
            log.warning("cannot read the record of %s from the store: %s", doc_id, exc)
            with self._lock:
                return self._records.get(doc_id)

    def counts(self) -> dict[str, int]:
        """Documents by status as this process last read them (health checks must not read the whole store)."""
        counts = {"queued": 0, "processing": 0, "ready": 0, "failed": 0}
        for record in super().list():
            counts[record.status] += 1
        return counts

    def create(self, record: DocumentRecord, document: Document) -> None:
        """Stores a new upload's text, then its record; StorageError leaves no record behind."""
        try:
            self.backend.put(_key(record.id), DOCUMENT, document_file(record, document))
            self._write_meta(record)
        except OSError as exc:
            try:
                self.backend.remove(_key(record.id), last=META)
            except OSError:
                log.exception("cannot remove the partial upload %s", record.id)
            raise StorageError("save the upload", exc) from exc
        with self._lock:
            self._records[record.id] = record

    def read_document(self, record: DocumentRecord) -> Document:
        return saved_document(record, self.backend.get(_key(record.id), DOCUMENT))

    def confirm_listed(self, record: DocumentRecord) -> bool:
        """False once `record` is deleted, by this process or any other (its tombstone is looked up in the store).

        `StoreUnreadable` (503), its cache in memory dropped, when the store cannot be read: a delete elsewhere
        cannot be ruled out, and nothing of a deleted document may be served (a question about to start ends with
        that error; the record itself is left as it is, since it may well not be deleted)."""
        if not record.deleted:
            try:
                deleted = self._deleted(record.id)
            except OSError as exc:
                log.warning("cannot look for the tombstone of %s: %s", record.id, exc)
                self.forget_loaded(record.id)
                raise StoreUnreadable(exc) from exc
            if deleted:
                record.deleted = True
                self.forget_loaded(record.id)
                with self._lock:
                    self._records.pop(record.id, None)
        return not record.deleted

    def share(self, record: DocumentRecord, engine: InfoKVEngine) -> bool:
        raise ConfigError("share_caches is not available with a shared store")  # refused by Settings first

    def delete(self, record: DocumentRecord) -> None:
        """Leaves the document's tombstone, then removes it from the store (its record last); returns only once
        it is gone. When removing fails (`StorageError`), the document is deleted all the same and what is left
        of it goes later (see below)."""
        with record.io_lock:
            try:
                self.backend.put(f"{DELETED}/{record.id}", TOMBSTONE, b"")
            except OSError as exc:
                raise StorageError("delete the document", exc, "the document is unchanged") from exc
            record.deleted = True
            self.forget_loaded(record.id)
            with self._lock:
                self._records.pop(record.id, None)
            try:
                self.backend.remove(_key(record.id), last=META)
                self._unmark_pending(record.id)
            except OSError as exc:
                # Unlike a local disk's, this document is not kept listed as delete_incomplete: its tombstone
                # already hides it on every process (no listing shows it, GET and DELETE answer 404), and reading
                # or listing it removes what is left (`_stored_meta`).
                raise StorageError(
                    "remove all of the document's files",
                    exc,
                    "the document is deleted all the same (no longer listed or found); what is left of it in the "
                    "store is removed when documents are next listed",
                ) from exc

    def _save_cache(self, doc_id: str, document: CompressedDocument) -> None:
        self.backend.publish(_key(doc_id), document)

    def _load_cache(self, engine: InfoKVEngine, doc_id: str) -> CompressedDocument:
        return self.backend.load(engine, _key(doc_id))

    # Leases --------------------------------------------------------------------------------------

    def renew(self, record: DocumentRecord) -> None:
        """Extends this process's lease on a document it is reading."""
        with record.io_lock:
            if not record.deleted:
                self._write_meta(record)

    def claim_expired(self, busy: set[str]) -> builtins.list[DocumentRecord]:
        """Takes over queued or processing documents whose reader's lease ran out (not those in `busy`);
        returns the ones this process won."""
        now = time.time()
        claimed = []
        for doc_id in self.backend.children(PENDING):
            if doc_id in busy or not valid_document_id(doc_id):
                continue
            try:
                data = self._stored_meta(doc_id)
                if data is None or data.get("status") not in PENDING_STATUSES:
                    self._remove_stale_mark(doc_id, now)
                    continue
                if float(_lease(data).get("until", 0)) > now:
                    continue
                record = self._refresh(doc_id)
            except (OSError, ValueError, TypeError) as exc:  # one bad record must not stop the others' takeovers
                log.warning("cannot read the record of %s from the store: %s", doc_id, exc)
                continue
            if record is not None and self.update(record, status="queued"):
                claimed.append(record)
        if not claimed:
            return []
        time.sleep(CLAIM_SETTLE_SECONDS)
        won = []
        for record in claimed:
            data = self._stored_meta(record.id)
            if data is not None and _lease(data).get("holder") == self.holder:
                won.append(record)
        return won


class _Ticker:
    """A daemon thread that calls `tick` every `interval` seconds until stopped, surviving its failures."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"infokv-{type(self).__name__}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - it must survive a store that fails for a while
                log.exception("%s failed", type(self).__name__)

    def tick(self) -> None:
        raise NotImplementedError


class DeleteWatcher(_Ticker):
    """Ends the answers of documents another process deleted: every `DELETE_CHECK_SECONDS` it looks up the
    tombstones of the documents this process is answering (`StoreRegistry.confirm_listed`), and the decoding
    thread ends the answers of those found deleted with `document_not_found`."""

    def __init__(self, registry: StoreRegistry, worker: ModelWorker) -> None:
        super().__init__(DELETE_CHECK_SECONDS)
        self.registry = registry
        self.worker = worker

    def tick(self) -> None:
        for record in self.worker.answering():
            try:
                self.registry.confirm_listed(record)
            except StorageError:  # cannot tell now (logged): looked up again next tick, the others meanwhile
                continue


class LeaseKeeper(_Ticker):
    """Renews the leases of the documents this process reads, and takes over those whose reader died."""

    def __init__(self, registry: StoreRegistry, worker: ModelWorker, settings: Settings) -> None:
        super().__init__(registry.lease_seconds / 3)
        self.registry = registry
        self.worker = worker
        self.settings = settings

    def tick(self) -> None:
        busy = self.worker.ingestions()
        for doc_id in busy:
            try:
                record = self.registry.get(doc_id)
                if record is not None:
                    self.registry.renew(record)
            except (OSError, StorageError) as exc:  # one failed renewal must not stop the others' nor the takeovers
                log.warning("cannot renew the lease of %s: %s", doc_id, exc)
        for record in self.registry.claim_expired(set(busy)):
            self._take_over(record)

    def _take_over(self, record: DocumentRecord) -> None:
        """Reads a claimed document again; one whose stored options this process cannot use is failed (by the
        worker), so that it is neither claimed again every tick nor stops the takeovers claimed after it."""
        if self.worker.read_again(record):
            log.info("taking over %s: its reader stopped renewing its lease", record.id)
            self.registry.counters["takeovers"] += 1  # counted once it is really on its way


def open_registry(settings: Settings) -> Registry:
    """The local data directory's registry, or a `StoreRegistry` when `settings.store` names a store."""
    if settings.store is None:
        return Registry(settings.data_dir, settings.loaded_documents)
    staging = settings.data_dir / f"{STAGING_PREFIX}{secrets.token_hex(6)}"
    return StoreRegistry(open_backend(settings.store), staging, settings.loaded_documents, settings.lease_seconds)
