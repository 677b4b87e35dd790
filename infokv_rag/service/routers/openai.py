"""OpenAI-compatible face: POST /v1/chat/completions (with `document_id`) and GET /v1/models.

client = OpenAI(base_url="http://host:8000/v1", api_key=KEY)
client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "..."}],
                               extra_body={"document_id": doc_id}, stream=True)
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ...errors import ConfigError, EmptyQuestionError
from ...prompt import Turn, check_conversation
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
from ..dependencies import CallerDep, Service, ServiceDep, authenticate, find_document
from ..errors import OPENAI_CHAT_PATH, ServiceError
from ..schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatUsage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    answer_responses,
    error_responses,
)
from ..worker import GenerationJob

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(authenticate)])

CONVERSATION_CHAR_FACTOR = 4
"""A conversation may hold this many times the question limit in characters, over all messages."""


@router.get(
    "/models", response_model=ModelList, summary="The served model (OpenAI-compatible)", responses=error_responses(401)
)
async def list_models(service: ServiceDep) -> ModelList:
    return ModelList(data=[ModelCard(id=service.model_id, created=int(service.started_at))])


@router.get(
    "/models/{model_id:path}",
    response_model=ModelCard,
    summary="The served model by its id (OpenAI-compatible)",
    responses=error_responses(401, 404),
)
async def retrieve_model(model_id: str, service: ServiceDep) -> ModelCard:
    _check_model(service, model_id)
    return ModelCard(id=service.model_id, created=int(service.started_at))


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    """400 `unsupported_parameter` for what this server cannot do and a client would rely on."""
    format_type = (request.response_format or {}).get("type", "text")
    asked = {
        "tools": bool(request.tools),
        "tool_choice": request.tool_choice not in (None, "none", "auto"),
        "response_format": format_type != "text",
        "logprobs": bool(request.logprobs),
        "top_logprobs": bool(request.top_logprobs),
    }
    for param, unsupported in asked.items():
        if unsupported:
            raise ServiceError(
                400,
                "unsupported_parameter",
                f"{param} is not supported here: this server answers in plain text, without tool calls, structured "
                "output or log probabilities",
                param=param,
            )


def _turns(request: ChatCompletionRequest) -> list[Turn]:
    turns: list[Turn] = []
    for index, message in enumerate(request.messages):
        role = "system" if message.role == "developer" else message.role
        if role not in ("system", "user", "assistant"):
            raise ServiceError(
                400,
                "unsupported_role",
                f"messages[{index}]: role {message.role!r} is not supported; use system, developer, user or assistant",
                param=f"messages.{index}.role",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ServiceError(
                        400,
                        "unsupported_content",
                        f"messages[{index}]: only text content is supported, not {part.type!r}",
                        param=f"messages.{index}.content",
                    )
                texts.append(part.text)
            content = "".join(texts)
        if not content:
            raise ServiceError(
                400, "empty_message", f"messages[{index}] has no text content", param=f"messages.{index}.content"
            )
        turns.append((role, content))
    # The core's check, before the document loads: a last user message of whitespace or control characters only
    # is as empty as "" (one turn per message, so a turn's index is its message's).
    try:
        check_conversation(turns)
    except EmptyQuestionError as exc:
        users = [index for index, (role, _) in enumerate(turns) if role == "user"]
        where, param = (f"messages[{users[-1]}]: ", f"messages.{users[-1]}.content") if users else ("", "messages")
        raise ServiceError(400, "empty_message", f"{where}{exc}", param=param) from exc
    except ConfigError as exc:  # as when the answer starts (`start_answer`), only sooner
        raise ServiceError(400, "invalid_conversation", str(exc), param="messages") from exc
    return turns


def _usage(job: GenerationJob) -> ChatUsage:
    usage = job.generation.usage
    prompt = usage.prompt_tokens + usage.cached_tokens
    return ChatUsage(
        prompt_tokens=prompt,
        completion_tokens=usage.completion_tokens,
        total_tokens=prompt + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        recalled_tokens=usage.recalled_tokens,
    )


def _check_model(service: Service, model: str) -> None:
    if model != service.model_id:
        raise ServiceError(
            404, "model_not_found", f"model {model!r} is not served here; use {service.model_id!r} (GET /v1/models)"
        )


@router.post(
    "/chat/completions",
    response_model=ChatCompletion,
    summary="OpenAI-compatible chat completion about a document (`document_id`; streaming and not)",
    responses=answer_responses(
        "A chat completion, or with `stream: true` OpenAI's `text/event-stream` of "
        "`chat.completion.chunk` objects ending in `data: [DONE]`.",
        OPENAI_CHAT_PATH,
    ),
)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    service: ServiceDep,
    caller: CallerDep,
) -> ChatCompletion | StreamingResponse:  # the response_model documents the JSON answer
    _check_model(service, body.model)
    _refuse_unsupported(body)
    if body.stream_options is not None and not body.stream:
        # As OpenAI's: without a stream there is no usage chunk to ask for, so the option would be dropped unseen.
        raise ServiceError(
            422, "invalid_request", "stream_options is only allowed when stream is true", param="stream_options"
        )
    record = await find_document(service, caller, body.document_id)
    turns = _turns(body)
    # A 413 or 422 from these shared checks answers 400 here, as OpenAI's does (`errors.status_on`).
    check_question(
        service,
        sum(len(content) for _, content in turns),
        what="conversation",
        param="messages",
        limit=service.settings.max_question_chars * CONVERSATION_CHAR_FACTOR,
    )
    # OpenAI's newer name wins over the older; a refusal names the field the limit came from.
    max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    options = generation_options(
        service,
        record,
        body.max_completion_tokens or body.max_tokens,
        body.temperature,
        body.top_p,
        body.stop,
        body.seed,
        body.recall,
        max_tokens_param=max_tokens_param,
    )
    document = await ready_document(service, record)
    job = await start_answer(
        service,
        caller,
        record,
        document,
        turns,
        options,
        conversation_param="messages",
        max_tokens_param=max_tokens_param,
        length_given=body.max_completion_tokens is not None or body.max_tokens is not None,
    )
    completion_id = "chatcmpl-" + secrets.token_urlsafe(18)
    created = int(time.time())
    if not body.stream:
        answer = await collect(job, request)
        return ChatCompletion(
            id=completion_id,
            created=created,
            model=service.model_id,
            choices=[
                ChatChoice(
                    message=ChatCompletionMessage(content=answer), finish_reason=job.generation.usage.finish_reason
                )
            ],
            usage=_usage(job),
            timings=job.timings(),  # type: ignore[arg-type]
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": service.model_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
            # OpenAI's: with the usage chunk asked for, every other chunk carries a null usage.
            **({"usage": None} if include_usage else {}),
        }

    async def events() -> AsyncIterator[str]:
        yield sse(chunk({"role": "assistant", "content": ""}))
        async for kind, payload in sse_events(job):
            if kind == "heartbeat":
                yield ": keep-alive\n\n"
            elif kind == "piece":
                yield sse(chunk({"content": payload}))
            elif kind == "done":
                yield sse(chunk({}, job.generation.usage.finish_reason))
                if include_usage:
                    final = {**chunk({}), "choices": [], "usage": _usage(job).model_dump()}
                    yield sse(final)
                yield sse("[DONE]")
            else:
                yield sse(payload)  # OpenAI clients raise an APIError with this message

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)
