"""Request and response bodies (they make the OpenAPI schema).

Every numeric field has bounds here, so that out-of-range input is refused by validation (422) before
any code can overflow on it. Limits that depend on the server's settings (max_tokens, question length,
upload size) are written into the schema by `openapi.apply_limits`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StringConstraints,
    model_validator,
)

from ..config import COLD_BITS
from ..scorers import method_names
from .errors import status_on

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
"""Seeds are signed or unsigned 64-bit integers, as the core takes them (`GenerationOptions`)."""
MAX_TOKENS_CAP = 1 << 20
"""Hard bound of max_tokens in validation; the schema shows the server's own, lower limit."""
MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 256
FORM_FIELD_BYTES = 4096
"""Largest multipart field of an upload other than the file."""

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None
# Strict: JSON's true is no number (lax validation reads it as 1, or as the whole cold tier), nor is "3".


def _whole_number(value: object) -> object:
    """A JSON number without a fraction (`2.0`, `4e0`) as the integer it is: OpenAPI's `integer` type takes it."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


WholeNumber = BeforeValidator(_whole_number)
Seed = Annotated[int, Strict(), Field(ge=SEED_MIN, le=SEED_MAX), WholeNumber]
MaxTokens = Annotated[int, Strict(), Field(ge=1, le=MAX_TOKENS_CAP), WholeNumber]
Temperature = Annotated[float, Strict(), Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Strict(), Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Recall = (
    Annotated[float, Strict(), Field(ge=0.0, le=1.0, allow_inf_nan=False)]
    | Annotated[int, Strict(), Field(ge=0, le=MAX_TOKENS_CAP)]
)
"""A recall budget: a ratio in [0, 1] of the document's tokens like 0.1, or a token count like 64 (an integer
is a count), per layer and KV head; 0: none."""
ColdBits = Annotated[
    int, Strict(), Field(ge=min(COLD_BITS), le=max(COLD_BITS), json_schema_extra={"enum": list(COLD_BITS)})
]
MethodName = Annotated[str, Field(json_schema_extra={"enum": list(method_names())})]
"""A method of the registry (`infokv_rag.scorers.method_names`); an unknown one is refused with its choices."""

# Errors ------------------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str = Field(description="What went wrong and what to do about it.")
    type: str = Field(description="Error class, OpenAI-style (invalid_request_error, authentication_error, ...).")
    code: str = Field(description="Machine-readable cause, e.g. encrypted_pdf, no_text, document_not_found.")
    param: str | None = Field(None, description="The request field the error is about, when one is.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (a question that does not fit the model's context window; a malformed multipart "
    "body, one cut before its closing boundary, or too many or too large form fields; a JSON body that is not "
    "UTF-8 or not valid JSON, `invalid_json`)",
    401: "Missing, invalid or conflicting API key (every key presented must be valid)",
    404: "No such document",
    408: "An upload whose body stopped arriving (`upload_timeout`: nothing for `upload_idle_seconds`, or not whole "
    "after `max_upload_seconds`); nothing kept",
    409: "The document is not ready (still being read, or failed)",
    413: "Upload, page count, document or question too large",
    415: "Not a PDF or text file",
    422: "Invalid field, or a document that cannot be read (encrypted, no text, empty, damaged)",
    429: "The caller's tenant holds its whole share of the queue (`tenant_queue_full`); retry later (see Retry-After)",
    503: "Busy (too many queued requests), or a shared store that cannot be read now; retry later (see Retry-After)",
    507: "The server's storage refused a write or a removal (`storage_error`; the message says what was kept), or "
    "on an upload, the caller's tenant keeps `max_documents_per_tenant` documents (`document_quota_exceeded`)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[code]} for code in codes}


ANSWER_ERROR_STATUSES = (400, 401, 404, 409, 413, 422, 429, 503, 507)
"""How answering fails, on every endpoint that answers, before a route answers some with another status."""


def answer_responses(description: str, path: str) -> dict[int | str, dict[str, Any]]:
    """Responses of the endpoint at `path` that answers as JSON, or as Server-Sent Events (`description`) with
    `stream: true`. Answering fails the same ways on every such endpoint, each with the status that its route
    answers it with (`errors.status_on`: OpenAI's answers 400 where the others answer 413 or 422)."""
    answered_as: dict[int, list[int]] = {}
    for status in ANSWER_ERROR_STATUSES:
        answered_as.setdefault(status_on(path, status), []).append(status)
    responses = error_responses(*answered_as)
    for status, causes in answered_as.items():
        for cause in causes:
            if cause != status:
                responses[status]["description"] += (
                    f"; here also what other routes answer as {cause}: {_ERROR_DESCRIPTIONS[cause]}"
                )
    return {
        **responses,
        200: {"description": description, "content": {"text/event-stream": {"schema": SSE_EVENT}}},
    }


SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "description": "One Server-Sent Event, as an EventSource parses it; `data` holds JSON (or `[DONE]`).",
    "properties": {"event": {"type": "string"}, "data": {"type": "string"}, "id": {"type": "string"}},
}
"""The schema of each event of a `text/event-stream` response (what schema checkers validate per event)."""


# Documents ---------------------------------------------------------------------------------------

DocumentStatus = Literal["queued", "processing", "ready", "failed"]


class Progress(BaseModel):
    tokens_done: int
    tokens_total: int
    fraction: float


class DocumentInfo(BaseModel):
    id: str
    object: Literal["document"] = "document"
    owner: str | None = Field(
        description="The tenant that uploaded it (None: uploaded before tenants existed, or to an open service)."
    )
    filename: str
    status: DocumentStatus
    progress: Progress | None = Field(None, description="Prefill progress while processing (and once ready).")
    reason: str | None = Field(None, description="Why reading the document failed (status failed).")
    reason_code: str | None = Field(
        None,
        description="Machine-readable cause of `failed`, e.g. no_text, "
        "storage_error, delete_incomplete (a DELETE that must be sent again).",
    )
    created_at: int
    updated_at: int
    method: str
    keep: float | int
    recall: float | int = Field(
        0, description="What each question recalls from the cold tier by default (0: the document has none)."
    )
    cold_bits: int | None = Field(None, description="Width of the cold tier's codes; None without a cold tier.")
    stored_bits: int | None = Field(
        None, description="Width of the codes the kept entries are held in; None: at the model's dtype."
    )
    size_bytes: int
    pages: int = Field(description="Pages with text.")
    skipped_pages: list[int] = Field(description="PDF pages whose text could not be extracted.")
    warnings: list[str] = Field(
        default_factory=list,
        description="What reading the upload warned about, one message each (PDF pages skipped, and why; stray "
        "bytes of a UTF-8 text read as Windows-1252, with their offsets); empty when nothing was.",
    )
    tokens: int = Field(description="Document tokens (the uncompressed prefix).")
    kept_tokens: int | None = Field(None, description="Tokens kept over all layers, per KV head.")
    cache_bytes: int | None = Field(
        None, description="Bytes of the compressed (hot) cache's keys and values, the memory an answer starts from."
    )
    cold_bytes: int | None = Field(
        None, description="Bytes of the cold tier (what compression evicted, quantised; on disk); 0 without one."
    )
    full_cache_bytes: int | None = None
    compression_ratio: float | None = None
    prefill_seconds: float | None = None
    cache_origin: Literal["prefill", "disk", "store"] | None = Field(
        None,
        description="Where this server process got the document's cache from: read in this process, or loaded "
        "from disk (after a restart: no prefill) or from the shared store (another replica read it: no prefill). "
        "None until the process first holds it (after a restart, until a question needs it). It stays when "
        "the cache leaves memory for room and is loaded back: when that happens depends on other tenants' "
        "documents.",
    )


class DocumentList(BaseModel):
    object: Literal["list"] = "list"
    data: list[DocumentInfo]


class DocumentDeleted(BaseModel):
    id: str
    object: Literal["document.deleted"] = "document.deleted"
    deleted: bool = True


class UploadOptions(BaseModel):
    """The fields of an upload's form but its file: what `uploads.upload_options` validates them against (strictly,
    once read as numbers), so that the bounds the schema shows are the bounds enforced."""

    model_config = ConfigDict(extra="forbid")

    method: MethodName | None = Field(None, description="Compression method. Default: the server's.")
    keep: Annotated[float, Field(gt=0.0, le=1.0)] | Annotated[int, Field(ge=2, le=MAX_TOKENS_CAP)] | None = Field(
        None,
        description="Keep ratio in (0, 1] like 0.25 (1.0: every token), or a token count like 512 (an integer is a "
        "count; 1 is refused, as the whole document is written 1.0).",
    )
    recall: Recall | None = Field(
        None,
        description="Keep what compression evicts in a cold tier, and by default recall this much of it per "
        "question (ratio like 0.1 or token count like 64; each question may change it). Default 0: no cold tier.",
    )
    cold_bits: ColdBits | None = Field(
        None, description="Width of the cold tier's codes, 4 or 8; default: 8 for a 32-bit cache, 4 for a 16-bit one."
    )
    stored_bits: ColdBits | None = Field(
        None,
        description="Hold the kept entries in codes of 4 or 8 bits (about 5/16 or 9/16 of a 16-bit cache's bytes), "
        "each answer decoding them; default: at the model's dtype.",
    )
    # 1024 characters are at most 4096 UTF-8 bytes, the server's limit for a form field.
    password: Annotated[str, StringConstraints(max_length=FORM_FIELD_BYTES // 4)] | None = Field(
        None, description="Password of an encrypted PDF."
    )


class UploadForm(UploadOptions):
    """The multipart/form-data body of an upload (its schema: the form is read by hand after the API-key check, and
    its fields are validated as `UploadOptions`)."""

    file: bytes = Field(
        description="The document: a PDF, or text or markdown (UTF-8, UTF-16 with a BOM, "
        "Western single-byte, or a detected legacy encoding such as GB18030).",
        json_schema_extra={"format": "binary"},
    )


# Asking ------------------------------------------------------------------------------------------


class AskRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_field_only(cls, data: Any) -> Any:
        # pydantic refuses each unknown key apart: 100,000 of them in a 1 MB body held the event loop for seconds
        # (every request of every tenant waited). The first is refused; the others are not looked at.
        if isinstance(data, dict):
            unknown = [key for key in data if key not in cls.model_fields]
            if len(unknown) > 1:
                data = {key: value for key, value in data.items() if key == unknown[0] or key in cls.model_fields}
        return data

    question: str = Field(description="The question (length limited by the server; empty: 422 `empty_message`).")
    max_tokens: MaxTokens | None = Field(None, description="Most tokens to generate (limited by the server).")
    temperature: Temperature = Field(0.0, description="0 is greedy (deterministic).")
    top_p: TopP = 1.0
    stop: Stop = Field(None, description=f"Up to {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters.")
    seed: Seed | None = Field(None, description="Seed for sampling (temperature > 0), a 64-bit integer.")
    recall: Recall | None = Field(
        None,
        description="How much of the document's cold tier this question may recall (ratio like 0.1 or token count "
        "like 64; 0: none). Default: the document's upload `recall`.",
    )
    stream: StrictBool = Field(
        False,
        description="Stream the answer as Server-Sent Events: `token` events "
        '({"text": ...}), then one `done` event (the full answer, as without streaming), '
        "or an `error` event.",
    )


class AskUsage(BaseModel):
    prompt_tokens: int = Field(description="Tokens of the question (the document is not read again).")
    cached_tokens: int = Field(description="Document tokens served from the compressed cache.")
    completion_tokens: int
    total_tokens: int
    recalled_tokens: int = Field(
        description="Entries the question recalled into the layers, per KV head, summed over layers (0 without "
        "recall): cold-tier entries and, once a head's cold entries are all in, the entries its layer kept beside it "
        "(per-head budgets), which the recall budget counts too."
    )


class Timings(BaseModel):
    queued_seconds: float | None = Field(None, description="Wait for the model worker.")
    time_to_first_token: float | None = Field(None, description="From the request reaching the worker queue.")
    total_seconds: float
    tokens_per_second: float | None = Field(None, description="Decoding speed after the first token.")


class AskResponse(BaseModel):
    id: str
    object: Literal["answer"] = "answer"
    document_id: str
    answer: str
    finish_reason: str | None
    usage: AskUsage
    timings: Timings


# OpenAI-compatible -------------------------------------------------------------------------------


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request plus `document_id` (send it with `extra_body`).

    The conversation is about the document: it is placed before the first message, from the
    compressed cache. `temperature` defaults to 0 (greedy) here. Unknown OpenAI fields are ignored.
    """

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _content_parts_in_all(cls, data: Any) -> Any:
        # pydantic refuses each invalid part apart, on the event loop: 256 messages of 256 parts each took 0.4 s.
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list):
            parts = sum(
                len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
            )
            if parts > MAX_CONTENT_PARTS:
                raise ValueError(f"the messages hold {parts} content parts in all, more than {MAX_CONTENT_PARTS}")
        return data

    model: str = Field(max_length=256)
    messages: list[ChatMessage] = Field(
        min_length=1,
        max_length=MAX_MESSAGES,
        description=f"At most {MAX_CONTENT_PARTS} content parts over all messages, besides each one's own maxItems.",
    )
    # No length bound of its own (the body has one): an id that cannot exist is a 404, as on every route.
    document_id: str = Field(description="The document the conversation is about (extension field).")
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop = None
    seed: Seed | None = None
    recall: Recall | None = Field(
        None, description="Cold-tier recall of this answer, as in /ask (extension field; send it with `extra_body`)."
    )
    n: Annotated[int, Strict(), Field(ge=1, le=1), WholeNumber] | None = Field(None, description="Only 1 is supported.")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Not supported, and refused when asked for (400 `unsupported_parameter`): ignored, each would answer
    # something other than what the client relies on (plain text for a tool call or JSON, no logprobs).
    tools: list[Any] | None = Field(None, description="Not supported: refused unless empty.")
    tool_choice: Any = Field(None, description="Not supported: refused unless absent, 'none' or 'auto'.")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'} is supported.")
    logprobs: StrictBool | None = Field(None, description="Not supported: refused when true.")
    top_logprobs: Annotated[int, Strict(), Field(ge=0, le=20), WholeNumber] | None = Field(
        None, description="Not supported: refused unless 0."
    )


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class ChatUsage(BaseModel):
    prompt_tokens: int = Field(description="Document plus conversation tokens.")
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    recalled_tokens: int = Field(description="Entries recalled into the layers, as in /ask (extension field).")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    timings: Timings | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "infokv-rag"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Health ------------------------------------------------------------------------------------------


class Health(BaseModel):
    """Liveness for anyone; what the server is doing for an admin key only (it counts every tenant's work)."""

    status: Literal["ok"] = "ok"
    model: str
    uptime_seconds: float
    documents: dict[str, int] | None = Field(default=None, description="Documents by status (admin keys only).")
    queue: dict[str, int] | None = Field(
        default=None, description="Active and queued answers, queued uploads (admin keys only)."
    )
    counters: dict[str, int] | None = Field(
        default=None,
        description="Since start (admin keys only): prefills (documents read) and their tokens, cache_loads "
        "(caches loaded from disk), generations submitted/completed/cancelled/failed, generated tokens.",
    )
