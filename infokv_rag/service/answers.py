"""From a request to an answer job: readiness, limits, options, and reading the job's events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..errors import (
    AnswerRoomError,
    CacheStoreError,
    CacheUnreadableError,
    ConfigError,
    ContextLengthError,
    EmptyQuestionError,
    InfoKVError,
)
from ..generation import Generation, GenerationOptions
from .dependencies import Service, document_not_found
from .errors import ServiceError, StorageError, StoreUnreadable, from_core
from .registry import DocumentRecord
from .tenants import Principal
from .worker import Event, GenerationJob, QueueFull

if TYPE_CHECKING:
    from ..document import CompressedDocument
    from ..prompt import Turn

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HEARTBEAT_SECONDS = 10.0


async def ready_document(service: Service, record: DocumentRecord) -> CompressedDocument:
    """The document's compressed cache (from memory or disk), or a 409 that says why not."""
    if record.status in ("queued", "processing"):
        done, total = record.progress_done, record.progress_total
        progress = f", {done} of {total} tokens read" if record.status == "processing" and total else ""
        raise ServiceError(
            409,
            "document_not_ready",
            f"the document is still being read (status {record.status}{progress}); poll GET /v1/documents/{record.id}",
        )
    if record.status == "failed":
        raise _failed(record)
    assert service.engine is not None
    document = service.registry.loaded(record.id)
    if document is not None:
        return document
    try:
        return await run_in_threadpool(service.registry.load, service.engine, record)
    except CacheUnreadableError as exc:  # the storage failing now, not the cache damaged: read nothing again
        cause = exc.__cause__ if isinstance(exc.__cause__, OSError) else OSError(str(exc))
        raise StoreUnreadable(cause, "the document's cache") from exc
    except CacheStoreError as exc:
        raise _rebuild(service, record, exc) from exc
    except OSError as exc:  # the server's own space (a cold tier's temporary copy): no damage of the cache
        consequence = "nothing was changed. Retry later, or tell the operator"
        raise StorageError("load the document's cache", exc, consequence) from exc


def _failed(record: DocumentRecord) -> ServiceError:
    return ServiceError(409, "document_failed", f"reading the document failed: {record.reason}")


def _rebuild(service: Service, record: DocumentRecord, exc: CacheStoreError) -> ServiceError:
    """Reads the document again, its saved cache being unusable; the error that tells the client so. Of the
    questions that find it unusable at once, the first starts the one read; a deleted document is a 404."""
    assert service.worker is not None
    service.worker.read_cache_again(record, exc)
    return _rebuilding(record)


def _rebuilding(record: DocumentRecord) -> ServiceError:
    """What a question gets whose document's saved cache could not be used (`ModelWorker.read_cache_again`)."""
    if record.deleted:  # its files went while it loaded: that is the failure, not a damaged cache
        return document_not_found()
    if record.status == "failed":
        return _failed(record)
    return ServiceError(
        409,
        "cache_rebuilding",
        "the document's saved cache could not be used (damaged, changed on disk, another document's, or made by "
        f"another model); it is being read again: poll GET /v1/documents/{record.id}",
    )


def check_question(
    service: Service, chars: int, *, what: str = "question", param: str = "question", limit: int | None = None
) -> None:
    """413 `<what>_too_long` when the question (`param`, the request field) has more characters than `limit`."""
    limit = limit or service.settings.max_question_chars
    if chars > limit:
        raise ServiceError(
            413,
            f"{what}_too_long",
            f"the {what} is {chars} characters; this server accepts at most {limit}",
            param=param,
        )


def generation_options(
    service: Service,
    record: DocumentRecord,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    stop: str | Sequence[str] | None,
    seed: int | None,
    recall: float | int | None,
    *,
    max_tokens_param: str = "max_tokens",
) -> GenerationOptions:
    """The request's generation options, checked against this server's limits; `max_tokens_param` is the request
    field `max_tokens` came from, which a refusal of it names."""
    settings = service.settings
    if recall and not record.recall:
        # Said here, before the document loads, in the upload's terms (the core would refuse it as well).
        raise ServiceError(
            422,
            "no_cold_tier",
            f"document {record.id} was uploaded without a cold tier, so it has nothing to recall: ask without "
            "'recall' (or with 0), or upload it again with the form field 'recall' (e.g. 0.1)",
            param="recall",
        )
    max_tokens = max_tokens or settings.default_max_tokens
    if max_tokens > settings.max_new_tokens:
        raise ServiceError(
            422,
            "max_tokens_too_large",
            f"{max_tokens_param} is {max_tokens}; this server generates at most {settings.max_new_tokens} tokens "
            "per answer",
            param=max_tokens_param,
        )
    stops = [stop] if isinstance(stop, str) else list(stop or [])  # counts and lengths: validated by the schema
    try:
        return GenerationOptions.build(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stops,
            seed=seed,
            recall=recall,
        )
    except ConfigError as exc:
        raise ServiceError(422, "invalid_option", str(exc)) from exc


async def start_answer(
    service: Service,
    caller: Principal,
    record: DocumentRecord,
    document: CompressedDocument,
    turns: list[Turn],
    options: GenerationOptions,
    *,
    conversation_param: str,
    max_tokens_param: str = "max_tokens",
    length_given: bool = True,
) -> GenerationJob:
    """Tokenises and checks the conversation, then queues it with the model worker as the caller's tenant's (the
    one that asks holds a share of the answers, whoever owns the document: an admin asks as its own tenant).
    `conversation_param` is the request field that holds the conversation and `max_tokens_param` the one that holds
    the answer's length, which a refusal of them names; without `length_given` (the server's default length) the
    length is cut to the room the context window has left."""
    assert service.worker is not None
    try:
        generation = await run_in_threadpool(_generate, document, turns, options, length_given)
    except AnswerRoomError as exc:
        raise from_core(exc.worded(max_tokens_param), param=conversation_param) from exc
    # The routes refuse an empty question before the document loads; this is the core's word.
    except (EmptyQuestionError, ContextLengthError) as exc:
        raise from_core(exc, param=conversation_param) from exc
    except ConfigError as exc:
        raise ServiceError(400, "invalid_conversation", str(exc), param=conversation_param) from exc
    except CacheStoreError as exc:  # a cold tier changed on disk since it was loaded
        raise _rebuild(service, record, exc) from exc
    except InfoKVError as exc:
        raise from_core(exc) from exc
    try:
        return service.worker.submit_generation(generation, asyncio.get_running_loop(), record, caller.tenant)
    except QueueFull as exc:
        raise exc.refusal(retry_after=2) from exc


def _generate(
    document: CompressedDocument, turns: list[Turn], options: GenerationOptions, length_given: bool
) -> Generation:
    """`document.generate`; where the server's default answer length (not `length_given`) does not fit, the length the
    context window has left beside the document and the conversation: a long document leaves less than a default the
    operator raised (the upload check reserves only the library's default), and a request that named no length must
    not be told to lower it."""
    try:
        return document.generate(turns, options)
    except AnswerRoomError as exc:
        if length_given or exc.room is None or exc.room.spare < 1:
            raise
        return document.generate(turns, dataclasses.replace(options, max_new_tokens=exc.room.spare))


def event_error(job: GenerationJob, event: Event) -> ServiceError:
    if event.kind == "cancelled":
        return ServiceError(503, "cancelled", "the answer was cancelled because the server is shutting down")
    if event.kind == "deleted":
        return document_not_found()
    exc = event.error
    if isinstance(exc, ServiceError):
        return exc
    if isinstance(exc, CacheStoreError):  # found unusable as the answer began (the worker reads it again)
        return _rebuilding(job.record)
    if isinstance(exc, InfoKVError):
        error = from_core(exc)
        if error.status < 500:
            return error
    return ServiceError(500, "internal_error", "internal server error while generating the answer")


async def collect(job: GenerationJob, request: Request) -> str:
    """The whole answer; cancels it when the client disconnects while waiting."""
    pieces: list[str] = []
    checked = time.monotonic()
    async for event in job.stream(heartbeat=0.5):
        if time.monotonic() - checked >= 0.5 or event.kind == "heartbeat":
            checked = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
                raise ServiceError(499, "client_closed", "the client closed the connection")
        if event.kind == "piece":
            pieces.append(event.text)
        elif event.kind == "done":
            return "".join(pieces)
        elif event.kind in ("error", "cancelled", "deleted"):
            raise event_error(job, event)
    raise ServiceError(500, "internal_error", "the answer ended unexpectedly")


def sse(data: Any, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    head = f"event: {event}\n" if event else ""
    return head + "".join(f"data: {line}\n" for line in body.split("\n")) + "\n"


async def sse_events(job: GenerationJob) -> AsyncIterator[tuple[str, Any]]:
    """('piece', text), then ('done', None) or ('error', error body); heartbeats as ('heartbeat', None).

    When the client disconnects, the response stops iterating and the job is cancelled.
    """
    async for event in job.stream(heartbeat=HEARTBEAT_SECONDS):
        if event.kind in ("piece", "heartbeat"):
            yield event.kind, event.text
        elif event.kind == "done":
            yield "done", None
        else:
            error = event_error(job, event)
            yield "error", error.body()
