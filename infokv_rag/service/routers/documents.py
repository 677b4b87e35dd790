"""/v1/documents: upload (read in the background), status, list, delete, ask (JSON or SSE)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from ...errors import ConfigError, EmptyQuestionError
from ...prompt import question_turns
from ..answers import (
    SSE_HEADERS,
    check_question,
    collect,
    generation_options,
    ready_document,
    sse,
    sse_events,
    start_answer,
)
from ..dependencies import CallerDep, Service, ServiceDep, authenticate, find_document, visible_documents
from ..errors import ServiceError
from ..registry import DocumentRecord, new_document_id
from ..schemas import (
    AskRequest,
    AskResponse,
    AskUsage,
    DocumentDeleted,
    DocumentInfo,
    DocumentList,
    Progress,
    UploadForm,
    answer_responses,
    error_responses,
)
from ..uploads import (
    StagedUpload,
    compression_config,
    parse_upload,
    receive_upload,
    require_multipart,
    shutting_down_refusal,
)
from ..worker import DocumentQuotaFull, GenerationJob, IngestJob, QueueFull, check_document_quota

router = APIRouter(prefix="/v1", tags=["documents"], dependencies=[Depends(authenticate)])


def document_info(record: DocumentRecord) -> DocumentInfo:
    progress = None
    if record.progress_total:
        fraction = record.progress_done / record.progress_total
        progress = Progress(
            tokens_done=record.progress_done, tokens_total=record.progress_total, fraction=round(fraction, 4)
        )
    return DocumentInfo(
        id=record.id,
        owner=record.owner,
        filename=record.filename,
        status=record.status,
        progress=progress,
        reason=record.reason,
        reason_code=record.reason_code,
        created_at=int(record.created_at),
        updated_at=int(record.updated_at),
        method=record.method,
        keep=record.keep,
        recall=record.recall,
        cold_bits=record.cold_bits,
        stored_bits=record.stored_bits,
        size_bytes=record.size_bytes,
        pages=record.pages,
        skipped_pages=record.skipped_pages,
        warnings=record.warnings,
        tokens=record.tokens,
        kept_tokens=record.kept_tokens,
        cache_bytes=record.cache_bytes,
        cold_bytes=record.cold_bytes,
        full_cache_bytes=record.full_cache_bytes,
        compression_ratio=record.compression_ratio,
        prefill_seconds=record.prefill_seconds,
        cache_origin=record.cache_origin,  # type: ignore[arg-type]
    )


def _multipart_schema() -> dict[str, Any]:
    """`UploadForm`'s schema as a multipart body's: a form has no null (a field left out is not sent), so each
    option's null alternative is dropped (clients sent the text "null", refused as a value)."""
    schema = UploadForm.model_json_schema()
    for name, field in schema["properties"].items():
        if "default" in field and field["default"] is None:
            del field["default"]
        alternatives = [kind for kind in field.get("anyOf", ()) if kind != {"type": "null"}]
        if "anyOf" in field and len(alternatives) == 1:
            schema["properties"][name] = {**{k: v for k, v in field.items() if k != "anyOf"}, **alternatives[0]}
        elif "anyOf" in field:
            field["anyOf"] = alternatives
    return schema


_UPLOAD_BODY = {"required": True, "content": {"multipart/form-data": {"schema": _multipart_schema()}}}


@router.post(
    "/documents",
    status_code=202,
    response_model=DocumentInfo,
    summary="Upload a document (PDF or text); it is read and compressed in the background",
    responses=error_responses(400, 401, 408, 413, 415, 422, 429, 503, 507),
    openapi_extra={"requestBody": _UPLOAD_BODY},
)
async def upload_document(request: Request, response: Response, service: ServiceDep, caller: CallerDep) -> DocumentInfo:
    """Returns 202 with the document's id at once; poll `GET /v1/documents/{id}` until `ready`.

    The document belongs to the caller's tenant: no other tenant can see, ask about or delete it."""
    assert service.worker is not None
    tenant = caller.tenant
    require_multipart(request)
    try:
        # The queue's place is taken before the upload is received: a refused upload is neither read from the
        # client nor staged, parsed, saved or listed. Leaving the block on any path gives the place back.
        with service.worker.upload_slot(tenant) as receiving:
            if tenant is not None:
                # Counted with the place held: an upload of the tenant that ends meanwhile is counted by its place
                # (taken before the count) or by its record (made before its place is given back), never by neither.
                stored = await run_in_threadpool(service.registry.documents_of, tenant)
                check_document_quota(service.settings, stored + receiving)
            staged = await receive_upload(request, service.registry, service.settings, service.shutting_down)
            try:
                record = await _save_upload(service, caller.tenant, staged)
            finally:
                await run_in_threadpool(staged.discard)
    except QueueFull as exc:
        raise exc.refusal(retry_after=10) from exc
    except DocumentQuotaFull as exc:
        raise exc.refusal() from exc
    response.headers["Location"] = f"{request.scope.get('root_path', '')}/v1/documents/{record.id}"  # under a prefix
    return document_info(record)


async def _save_upload(service: Service, tenant: str | None, staged: StagedUpload) -> DocumentRecord:
    """Parses a received upload, saves it for `tenant` and queues it to be read (inside its `upload_slot`)."""
    assert service.engine is not None and service.worker is not None
    options = staged.options
    config = service.engine.resolve_config(
        compression_config(
            service.settings, options.method, options.keep, options.recall, options.cold_bits, options.stored_bits
        )
    )
    document, tokens, load_warnings = await run_in_threadpool(parse_upload, staged, service.settings, service.engine)
    now = time.time()
    record = DocumentRecord(
        id=new_document_id(),
        owner=tenant,
        sha256=document.sha256,
        filename=staged.name,
        status="queued",
        method=config.method,
        keep=config.keep,
        recall=config.recall,
        cold_bits=config.cold_bits,
        stored_bits=config.stored_bits,
        created_at=now,
        updated_at=now,
        size_bytes=staged.size,
        pages=len(document.pages),
        skipped_pages=list(document.skipped_pages),
        warnings=load_warnings,
        tokens=tokens,
    )
    record.progress_total = tokens
    if service.shutting_down.is_set():  # read while the server began to stop: not saved, so not read after it
        raise shutting_down_refusal("the upload")
    await run_in_threadpool(service.registry.create, record, document)
    service.worker.submit_ingestion(IngestJob(record, config, document))
    return record


@router.get(
    "/documents", response_model=DocumentList, summary="List the caller's documents", responses=error_responses(401)
)
async def list_documents(service: ServiceDep, caller: CallerDep) -> DocumentList:
    return DocumentList(data=[document_info(record) for record in await visible_documents(service, caller)])


@router.get(
    "/documents/{document_id}",
    response_model=DocumentInfo,
    summary="A document's status (queued, processing with progress, ready, failed with the reason) and sizes",
    responses=error_responses(401, 404, 503),
)
async def get_document(document_id: str, service: ServiceDep, caller: CallerDep) -> DocumentInfo:
    return document_info(await find_document(service, caller, document_id))


@router.delete(
    "/documents/{document_id}",
    response_model=DocumentDeleted,
    summary="Delete a document and its cache (stops reading it if still in progress)",
    responses=error_responses(401, 404, 503, 507),
)
async def delete_document(document_id: str, service: ServiceDep, caller: CallerDep) -> DocumentDeleted:
    """Answers only once the files are gone; otherwise 507, and the document stays listed (see reason_code)."""
    record = await find_document(service, caller, document_id)
    assert service.worker is not None
    try:
        await run_in_threadpool(service.registry.delete, record)
    finally:
        # Only a delete that took effect stops the reading: one refused before it (507, "the document is
        # unchanged") leaves the document to be read as it was, never stuck as being read with no one reading it.
        if record.deleted:
            service.worker.cancel_ingestion(record.id)
    return DocumentDeleted(id=record.id)


def _ask_response(record: DocumentRecord, answer_id: str, answer: str, job: GenerationJob) -> AskResponse:
    usage = job.generation.usage
    return AskResponse(
        id=answer_id,
        document_id=record.id,
        answer=answer,
        finish_reason=usage.finish_reason,
        usage=AskUsage(
            prompt_tokens=usage.prompt_tokens,
            cached_tokens=usage.cached_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.cached_tokens + usage.completion_tokens,
            recalled_tokens=usage.recalled_tokens,
        ),
        timings=job.timings(),  # type: ignore[arg-type]
    )


@router.post(
    "/documents/{document_id}/ask",
    response_model=AskResponse,
    summary="Ask a question about a ready document (JSON, or Server-Sent Events with stream=true)",
    responses=answer_responses(
        "The answer as JSON, or with `stream: true` a `text/event-stream` of `token` "
        'events ({"text": ...}) then one `done` event (the JSON answer) or an `error` event.',
        "/v1/documents/{document_id}/ask",
    ),
)
async def ask(
    document_id: str,
    body: AskRequest,
    request: Request,
    service: ServiceDep,
    caller: CallerDep,
) -> AskResponse | StreamingResponse:  # the response_model documents the JSON answer
    record = await find_document(service, caller, document_id)
    check_question(service, len(body.question))
    try:
        turns = question_turns(body.question)  # before the document loads
    except EmptyQuestionError as exc:
        raise ServiceError(422, "empty_message", str(exc), param="question") from exc
    except ConfigError as exc:  # not text: a lone surrogate
        raise ServiceError(422, "invalid_request", str(exc), param="question") from exc
    options = generation_options(
        service, record, body.max_tokens, body.temperature, body.top_p, body.stop, body.seed, body.recall
    )
    document = await ready_document(service, record)
    job = await start_answer(
        service,
        caller,
        record,
        document,
        turns,
        options,
        conversation_param="question",
        length_given=body.max_tokens is not None,
    )
    answer_id = "ans_" + secrets.token_urlsafe(12)
    if not body.stream:
        answer = await collect(job, request)
        return _ask_response(record, answer_id, answer, job)

    async def events() -> AsyncIterator[str]:
        pieces: list[str] = []
        async for kind, payload in sse_events(job):
            if kind == "heartbeat":
                yield ": keep-alive\n\n"
            elif kind == "piece":
                pieces.append(payload)
                yield sse({"text": payload}, "token")
            elif kind == "done":
                yield sse(_ask_response(record, answer_id, "".join(pieces), job).model_dump(), "done")
            else:
                yield sse(payload, "error")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
