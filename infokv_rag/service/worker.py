"""The one model worker: owns the engine, reads uploads in the background, decodes answers fairly.

Two threads do all model work, and nothing else touches the model:
- the decoding thread takes answers in FIFO order (at most `max_active_generations` at a time) and
  advances them round-robin, one text piece (usually one decoding step) each per turn;
- the ingestion thread reads one upload at a time in small prefill chunks, with progress.
Their forward passes alternate through a `FairLock` installed as `engine.lock`: the ingestion thread
holds it for one prefill chunk, the decoding thread for a time slice of about the same length, so while
an upload is read, answers keep about half of the model's time and wait at most one chunk at a time.

Results reach the HTTP handlers through an asyncio queue per answer; a handler whose client went away
cancels its answer, and the decoding thread drops it at its next turn (a waiting answer gives its queue place
back at once). An answer whose document is deleted ends with a `deleted` event (404), and `stop` ends every
answer in flight with `cancelled` (503).

Each queue is shared by every tenant, so each tenant may hold only its share of it (`Settings.generation_share`,
`Settings.upload_share`): a tenant over its share is refused (`TenantShareFull`, 429) while the others still find
places; only when the queue as a whole is full is everyone refused (`QueueFull`, 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..config import CompressionConfig
from ..errors import CacheStoreError, ConfigError, InfoKVError, is_damage
from .errors import ServiceError, StorageError
from .registry import DocumentRecord, Registry
from .scheduling import FairLock
from .uploads import record_config

if TYPE_CHECKING:
    from ..documents import Document
    from ..engine import InfoKVEngine
    from ..generation import Generation
    from .settings import Settings

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The worker's queue is full: the client should retry later (HTTP 503 `busy`)."""

    def refusal(self, retry_after: int) -> ServiceError:
        """The error the client receives, with `retry_after` seconds to wait before it tries again."""
        return ServiceError(
            503, "busy", f"the server is busy ({self}); retry shortly", headers={"Retry-After": str(retry_after)}
        )


class TenantShareFull(QueueFull):
    """The caller's tenant already holds its whole share of a queue (HTTP 429 `tenant_queue_full`): the server
    may have room for others, but not for more of this tenant's work until some of it is done. A 429, not a
    503, because the cause is the caller's own load, and OpenAI clients back off and retry it on their own."""

    def refusal(self, retry_after: int) -> ServiceError:
        return ServiceError(
            429,
            "tenant_queue_full",
            f"{self}; retry once some of it is done (other tenants' work is not held back by yours)",
            headers={"Retry-After": str(retry_after)},
        )


class DocumentQuotaFull(Exception):
    """The caller's tenant keeps `max_documents_per_tenant` documents already (HTTP 507 `document_quota_exceeded`,
    RFC 4331's status for a quota): none is freed by waiting, so no Retry-After."""

    def refusal(self) -> ServiceError:
        return ServiceError(507, "document_quota_exceeded", f"{self}; delete some of them to upload more")


def check_document_quota(settings: Settings, kept: int) -> None:
    """Refuses an upload of a tenant that keeps `kept` documents, counting its other uploads being received, when
    that is its whole `max_documents_per_tenant` (`DocumentQuotaFull`)."""
    if kept >= settings.max_documents_per_tenant:
        raise DocumentQuotaFull(
            f"your tenant keeps {kept} documents, counting uploads being received, its whole quota of "
            f"{settings.max_documents_per_tenant}"
        )


class _Cancelled(Exception):
    pass


@dataclass
class Event:
    kind: str  # piece | done | error | cancelled (shutting down) | deleted (its document was)
    text: str = ""
    error: BaseException | None = None


@dataclass
class GenerationJob:
    """One answer being generated for an HTTP request, from `record`'s document."""

    generation: Generation
    loop: asyncio.AbstractEventLoop
    record: DocumentRecord
    tenant: str | None = None
    """The caller's tenant, whose share of the answers this one holds (None: an open service's caller, no share)."""
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    first_piece: float | None = None
    finished: float | None = None
    outcome: str | None = None
    _iterator: Iterator[str] | None = None

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def timings(self) -> dict[str, float | None]:
        end = self.finished or time.perf_counter()
        completion = self.generation.usage.completion_tokens
        decode = end - self.first_piece if self.first_piece is not None else None
        return {
            "queued_seconds": _round(self.started - self.submitted) if self.started else None,
            "time_to_first_token": _round(self.first_piece - self.submitted) if self.first_piece else None,
            "total_seconds": _round(end - self.submitted),
            "tokens_per_second": _round((completion - 1) / decode) if decode and completion > 1 else None,
        }

    async def stream(self, heartbeat: float | None = None) -> AsyncIterator[Event]:
        """Events until the answer ends; `Event('heartbeat')` every `heartbeat` seconds of silence.

        Leaving the iteration early (the client disconnected) cancels the answer.
        """
        try:
            while True:
                try:
                    event = await asyncio.wait_for(self.events.get(), heartbeat)
                except asyncio.TimeoutError:
                    yield Event("heartbeat")
                    continue
                yield event
                if event.kind != "piece":
                    return
        finally:
            if not self.done:
                self.cancel()


def _check_share(what: str, mine: int, share: int, whole: int) -> None:
    """Refuses a tenant that holds `mine` of a queue's `what` when that is its whole `share` (`TenantShareFull`).
    Checked before the queue as a whole: a tenant at its share is told that its own load is the cause. A share of
    the `whole` queue is no share (off): the queue's own refusal, 503 `busy`, answers."""
    if share < whole and mine >= share:
        raise TenantShareFull(f"your tenant has {mine} {what} already, its whole share of {share}")


def _round(value: float) -> float:
    return round(value, 4)


@dataclass
class IngestJob:
    record: DocumentRecord
    config: CompressionConfig
    document: Document | None = None
    """The parsed upload; None after a restart (then read again from the saved text)."""
    cancelled: threading.Event = field(default_factory=threading.Event)


class ModelWorker:
    """Owns the engine; see the module docstring."""

    def __init__(self, engine: InfoKVEngine, registry: Registry, settings: Settings) -> None:
        self.engine = engine
        self.registry = registry
        self.settings = settings
        self.lock = FairLock()
        self._cond = threading.Condition()
        self._pending: deque[GenerationJob] = deque()
        self._active: deque[GenerationJob] = deque()
        self._stepping: GenerationJob | None = None  # the job the decoding thread took off _active to advance
        self._uploads: queue.Queue[IngestJob | None] = queue.Queue()
        self._ingest_jobs: dict[str, IngestJob] = {}
        # Queued, not cancelled, not yet taken by the ingestion thread: id -> its owner (whose share it holds).
        self._waiting_uploads: dict[str, str | None] = {}
        self._upload_slots: Counter[str | None] = Counter()  # places held by uploads being saved, by tenant
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self.counters: dict[str, int] = {
            "prefills": 0,
            "prefill_tokens": 0,
            "prefills_cancelled": 0,
            "generations_submitted": 0,
            "generations_completed": 0,
            "generations_cancelled": 0,
            "generations_failed": 0,
            "generated_tokens": 0,
        }

    # Lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.engine.lock = self.lock  # every forward pass of the engine now takes turns fairly
        for name, target in (("infokv-decode", self._decode_loop), ("infokv-ingest", self._ingest_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancels running work (an interrupted upload is read again after a restart) and joins the threads."""
        with self._cond:
            self._stopping = True  # every answer, queued or running, ends at its next step (`_step`)
            self._cond.notify_all()
        for upload in list(self._ingest_jobs.values()):
            upload.cancelled.set()
        self._uploads.put(None)
        for thread in self._threads:
            thread.join(timeout)

    # Status --------------------------------------------------------------------------------------

    def queue_state(self) -> dict[str, int]:
        with self._cond:
            self._drop_cancelled_pending()
            return {
                "active_generations": len(self._active) + (self._stepping is not None),
                "queued_generations": len(self._pending),
                "queued_uploads": len(self._waiting_uploads),
                "receiving_uploads": self._upload_slots.total(),  # places held while a body arrives or is saved
            }

    # Answers -------------------------------------------------------------------------------------

    def submit_generation(
        self, generation: Generation, loop: asyncio.AbstractEventLoop, record: DocumentRecord, tenant: str | None
    ) -> GenerationJob:
        """Queues an answer for `tenant` (the caller's): `TenantShareFull` when that tenant has its whole share
        of answers in flight, `QueueFull` when the queue is full."""
        job = GenerationJob(generation, loop, record, tenant)
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            self._drop_cancelled_pending()
            if tenant is not None:
                stepping = [self._stepping] if self._stepping is not None else []
                mine = sum(other.tenant == tenant for other in (*self._pending, *self._active, *stepping))
                _check_share("answers in flight", mine, self.settings.generation_share, self.settings.generations_held)
            if len(self._pending) >= self.settings.max_queued_generations:
                raise QueueFull(f"{len(self._pending)} questions are waiting already")
            self._pending.append(job)
            self.counters["generations_submitted"] += 1
            self._cond.notify()
        return job

    def _drop_cancelled_pending(self) -> None:
        """Ends the waiting answers whose clients left (under `_cond`): they hold no place in the queue."""
        for job in [job for job in self._pending if job.cancelled.is_set()]:
            self._pending.remove(job)
            self._end(job, Event("cancelled"), "cancelled")

    def _decode_loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._active:
                    self._cond.wait()
                if self._stopping and not self._active and not self._pending:
                    return
            # One time slice: decode round-robin while holding the model. When the prefill thread waits,
            # hand over after about as long as its last chunk took (min/max bounded), so answers and
            # uploads share the model's time evenly and neither waits for more than one turn of the other.
            with self.lock:
                began = time.perf_counter()
                while True:
                    job = self._next_job()
                    if job is None:
                        break
                    ended = self._step(job)
                    with self._cond:
                        self._stepping = None
                        if not ended:
                            self._active.append(job)
                    if self.lock.waiting:
                        turn = min(max(self.lock.others_last_hold(), self.MIN_SLICE), self.MAX_SLICE)
                        if time.perf_counter() - began >= turn:
                            break

    MIN_SLICE = 0.05
    MAX_SLICE = 2.0

    def _next_job(self) -> GenerationJob | None:
        with self._cond:
            while self._pending and len(self._active) < self.settings.max_active_generations:
                self._active.append(self._pending.popleft())
            if not self._active:
                return None
            self._stepping = self._active.popleft()
            return self._stepping

    def _step(self, job: GenerationJob) -> bool:
        """Advances one answer by one text piece; True when it has ended."""
        if job.cancelled.is_set() or self._stopping:
            self._close(job)
            return self._end(job, Event("cancelled"), "cancelled")
        # Nothing of a deleted document is served, not even the rest of an answer. Its first turn asks the registry,
        # which sees a delete by another process too (later turns: `DeleteWatcher`).
        try:
            listed = not job.record.deleted and (job.started is not None or self.registry.confirm_listed(job.record))
        except StorageError as exc:  # a store that cannot tell of a delete now: the client may retry
            self._close(job)
            return self._end(job, Event("error", error=exc), "failed")
        if not listed:
            self._close(job)
            return self._end(job, Event("deleted"), "cancelled")
        if job.started is None:
            job.started = time.perf_counter()
        try:
            if job._iterator is None:
                job._iterator = iter(job.generation)
            piece = next(job._iterator)
        except StopIteration:
            self.counters["generated_tokens"] += job.generation.usage.completion_tokens
            return self._end(job, Event("done"), "completed")
        except Exception as exc:  # noqa: BLE001 - reported to the client as a clean error
            if isinstance(exc, CacheStoreError):
                try:
                    self.read_cache_again(job.record, exc)
                except StorageError as storage:
                    exc = storage  # the client is told that, not that the document is being read again
            elif not isinstance(exc, InfoKVError):
                log.exception("generation failed")
            self._close(job)
            return self._end(job, Event("error", error=exc), "failed")
        if job.first_piece is None:
            job.first_piece = time.perf_counter()
        if not self._emit(job, Event("piece", piece)):
            self._close(job)
            return self._end(job, Event("cancelled"), "cancelled")
        return False

    @staticmethod
    def _close(job: GenerationJob) -> None:
        close = getattr(job._iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001
                log.exception("closing a generation failed")

    def _end(self, job: GenerationJob, event: Event, outcome: str) -> bool:
        job.finished = time.perf_counter()
        job.outcome = outcome
        self.counters[f"generations_{outcome}"] += 1
        self._emit(job, event)
        return True

    @staticmethod
    def _emit(job: GenerationJob, event: Event) -> bool:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
            return True
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            job.cancel()
            return False

    # Uploads -------------------------------------------------------------------------------------

    @contextmanager
    def upload_slot(self, tenant: str | None) -> Iterator[int]:
        """Holds a place in the upload queue for `tenant` (the uploader's) while an upload is saved, before anyone
        can see it: `TenantShareFull` when that tenant holds its whole share of the queue, `QueueFull` when none is
        left. `submit_ingestion` inside takes the place, leaving without it gives the place back. Yields how many
        other uploads of the tenant were being received as the place was taken (`check_document_quota`)."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            receiving = self._upload_slots[tenant]
            if tenant is not None:
                mine = sum(owner == tenant for owner in self._waiting_uploads.values()) + self._upload_slots[tenant]
                _check_share(
                    "uploads waiting to be read", mine, self.settings.upload_share, self.settings.max_queued_uploads
                )
            waiting = len(self._waiting_uploads) + self._upload_slots.total()
            if waiting >= self.settings.max_queued_uploads:
                raise QueueFull(f"{waiting} uploads are waiting to be read already")
            self._upload_slots[tenant] += 1
        try:
            yield receiving
        finally:
            with self._cond:
                self._upload_slots[tenant] -= 1

    def submit_ingestion(self, job: IngestJob) -> None:
        """Queues a document to be read: an upload inside its `upload_slot`, or a document read again (after a
        restart, a takeover or a lost cache: never refused, it is already listed)."""
        with self._cond:
            self._ingest_jobs[job.record.id] = job
            self._waiting_uploads[job.record.id] = job.record.owner
        self._uploads.put(job)

    def read_again(self, record: DocumentRecord) -> bool:
        """Queues a listed document to be read again with the options it was uploaded with (after a restart, a
        takeover or a lost cache). One whose options this server cannot use is failed instead (False): left
        queued, it would be tried again and again."""
        try:
            config = record_config(self.settings, record)
        except (ServiceError, ConfigError) as exc:
            log.warning("cannot read %s again: its options are not usable here (%s)", record.id, exc)
            self.registry.fail(record, "invalid_option", f"this document cannot be read again: {exc}")
            return False
        self.submit_ingestion(IngestJob(record, config))
        return True

    def answering(self) -> list[DocumentRecord]:
        """The documents of the answers waiting or being generated here, each once."""
        with self._cond:
            jobs = [*self._pending, *self._active, *([self._stepping] if self._stepping else [])]
        return list({id(job.record): job.record for job in jobs}.values())

    def read_cache_again(self, record: DocumentRecord, exc: CacheStoreError) -> None:
        """Reads a ready document again, its saved cache having been found unusable (`exc`: why). Of the questions
        that find it so at once, the first starts the one read; a deleted document is left alone.
        `StorageError` when its new status cannot be saved: it then stays ready, and the next question tries again."""
        if record.deleted:
            return
        self.registry.forget_loaded(record.id)
        if self.registry.update(record, if_status="ready", status="queued", reason=None, reason_code=None):
            log.warning("cache of %s unusable, reading the document again: %s", record.id, exc)
            self.read_again(record)

    def ingestions(self) -> list[str]:
        """Ids of the documents queued or being read here."""
        return list(self._ingest_jobs)

    def cancel_ingestion(self, doc_id: str) -> None:
        with self._cond:
            job = self._ingest_jobs.get(doc_id)
            self._waiting_uploads.pop(doc_id, None)
        if job is not None:
            job.cancelled.set()

    def _ingest_loop(self) -> None:
        while True:
            job = self._uploads.get()
            if job is None or self._stopping:
                return
            with self._cond:
                self._waiting_uploads.pop(job.record.id, None)
            try:
                self._ingest(job)
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("ingestion of %s failed", job.record.id)
            finally:
                self._ingest_jobs.pop(job.record.id, None)

    def _ingest(self, job: IngestJob) -> None:
        record = job.record
        if job.cancelled.is_set() or record.deleted:
            return
        try:
            if self.settings.share_caches and self.registry.share(record, self.engine):
                return  # an identical upload's cache serves it: no prefill
            self._prefill_and_save(job)
        except StorageError as exc:
            self.registry.fail(record, exc.code, exc.message)
        except Exception:  # noqa: BLE001 - a document settles ready or failed, never stays queued
            log.exception("ingestion of %s failed", record.id)
            self.registry.fail(record, "internal_error", READ_FAILED)

    def _prefill_and_save(self, job: IngestJob) -> None:
        record = job.record
        document = job.document
        if not self.registry.still_to_read(record):
            return
        try:
            if document is None:
                document = self.registry.read_document(record)
            total = record.tokens or 0
            record.progress_done, record.progress_total = 0, total
            if not self.registry.update(record, status="processing"):
                return

            def progress(done: int, total: int) -> None:
                record.progress_done, record.progress_total = done, total
                # `record.deleted` also covers a delete by another process, found out by renewing the lease.
                if job.cancelled.is_set() or self._stopping or record.deleted:
                    raise _Cancelled

            compressed = self.engine.ingest_document(document, job.config, progress=progress)
        except StorageError:
            raise  # `_ingest` records it as the document's failure
        except _Cancelled:
            self.counters["prefills_cancelled"] += 1
            return  # deleted (its files are gone) or shutting down (read again after the restart)
        except InfoKVError as exc:
            self.registry.fail(record, _error_code(exc), str(exc))
            return
        except OSError as exc:  # the storage failing now (the saved text unreadable): nothing shows the upload bad
            if is_damage(exc):  # its text gone (or something else in its place): no reading again brings it back
                self.registry.fail(record, "unreadable_document", f"{TEXT_LOST} ({exc.strerror or type(exc).__name__})")
                return
            if self.registry.retries_by_lease:
                log.warning("reading %s stopped (%s); it is read again once its lease runs out", record.id, exc)
                return
            log.exception("reading %s failed", record.id)
            self.registry.fail(record, "storage_error", f"{STORAGE_FAILED} ({exc.strerror or type(exc).__name__})")
            return
        except Exception:  # noqa: BLE001
            log.exception("ingestion of %s failed", record.id)
            self.registry.fail(record, "internal_error", READ_FAILED)
            return
        self.counters["prefills"] += 1
        self.counters["prefill_tokens"] += compressed.stats.document_tokens
        try:
            self.registry.finish(record, compressed)
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the cache store wraps the OS error; say what to do
            if record.deleted:
                return
            log.exception("saving the cache of %s failed", record.id)
            self.registry.fail(
                record,
                "storage_error",
                f"the cache could not be saved ({type(exc).__name__}); check the server's disk and upload again",
            )


READ_FAILED = "an internal error stopped reading this document; upload it again, and tell the operator if it persists"
TEXT_LOST = "the document's saved text is missing or damaged; upload it again"
STORAGE_FAILED = "the server's storage failed while this document was read; upload it again later, or tell the operator"


def _error_code(exc: BaseException) -> str:
    from .errors import error_code

    return error_code(exc)
