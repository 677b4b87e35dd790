"""Errors as clients see them: one JSON shape, a status code per cause, never a stack trace.

Every error body is OpenAI-shaped, so OpenAI clients show the message:
    {"error": {"message": "...", "type": "invalid_request_error", "code": "encrypted_pdf"}}
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from .. import errors as core

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "overloaded_error",
    507: "storage_error",
}


class ServiceError(Exception):
    """An error with the status code, code and message the client receives; `param` names the request field
    it is about, when one is (OpenAI's error body has it)."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.code, self.message, self.param)


class StorageError(ServiceError):
    """The server's disk refused a write or a removal (HTTP 507 `storage_error`).

    The message names the action and the operating system's reason (no space, read-only, permission),
    never a server path.
    """

    def __init__(self, action: str, exc: OSError, consequence: str | None = None) -> None:
        reason = exc.strerror or type(exc).__name__
        message = f"the server could not {action}: {reason}"
        message += f"; {consequence}" if consequence else "; nothing was kept. Retry later, or tell the operator"
        super().__init__(507, "storage_error", message)


class StoreUnreadable(StorageError):
    """The store could not be read to answer for one document (HTTP 503 `storage_error`, with Retry-After): a
    store that fails for a while (throttled, unreachable) is a reason to retry, not a refused write (507)."""

    def __init__(self, exc: OSError, what: str = "the document's record") -> None:
        super().__init__(f"read {what} from its store", exc, "nothing was changed. Retry shortly, or tell the operator")
        self.status = 503
        self.headers = {"Retry-After": "2"}


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "code": code, "param": param}
    }


# The typed core errors, mapped to status and code (most specific first).
_CORE: list[tuple[type[BaseException], int, str]] = [
    (core.UnsupportedFormatError, 415, "unsupported_format"),
    (core.EncryptedPDFError, 422, "encrypted_pdf"),
    (core.NoExtractableTextError, 422, "no_text"),
    (core.EmptyDocumentError, 422, "empty_document"),
    (core.CorruptPDFError, 422, "corrupt_pdf"),
    (core.PDFContentLimitError, 413, "too_much_content"),
    (core.DocumentError, 422, "unreadable_document"),
    (core.ContextLengthError, 400, "context_length_exceeded"),
    (core.EmptyQuestionError, 422, "empty_message"),  # 400 on /v1/chat/completions (`status_on`), as "" is there
    (core.ConfigError, 422, "invalid_option"),
    (core.CacheStoreError, 500, "cache_error"),
]


def error_code(exc: BaseException) -> str:
    for kind, _, code in _CORE:
        if isinstance(exc, kind):
            return code
    return "internal_error"


def from_core(exc: BaseException, message: str | None = None, param: str | None = None) -> ServiceError:
    """The client's error for a core error; `param` is the request field it is about, when one is."""
    for kind, status, code in _CORE:
        if isinstance(exc, kind):
            return ServiceError(status, code, message or str(exc), param=param)
    return ServiceError(500, "internal_error", "internal server error")


SHOWN_VALIDATION_ERRORS = 5
"""The validation errors a 422's message lists (a body may hold thousands: a message of megabytes)."""


def _validation_message(exc: RequestValidationError, content_type: str) -> str:
    parts = []
    errors = exc.errors()
    for error in errors[:SHOWN_VALIDATION_ERRORS]:
        if tuple(error.get("loc", ())) == ("body",) and "json" not in content_type.lower():
            # FastAPI reads a body as JSON only when its content-type says so; otherwise no field can be found.
            shown = f"content-type {content_type!r}" if content_type else "no content-type"
            return f"the request body was not read as JSON ({shown}): send it with content-type application/json"
        location = _field_of(error)
        parts.append(f"{location}: {error.get('msg', 'invalid')}" if location else str(error.get("msg", "invalid")))
    more = len(errors) - SHOWN_VALIDATION_ERRORS
    if more > 0:
        parts.append(f"and {more} more")
    return "invalid request: " + "; ".join(parts) if parts else "invalid request"


def _validation_param(exc: RequestValidationError) -> str | None:
    """The field of the first validation error, dotted (`messages.0.role`); None for the body as a whole."""
    for error in exc.errors():
        return _field_of(error) or None
    return None


def _field_of(error: dict[str, Any]) -> str:
    """The request field a validation error is about, dotted (`messages.0.role`); "" for the body as a whole. The
    members of a union that pydantic names in the location (`recall.constrained-float`, `stop.list[str]`,
    `content.str`) are left out: the client's field is the union's."""
    location: list[str] = []
    for part in error.get("loc", ()):
        if part in ("body", "query", "path") and not location:
            continue
        if location and isinstance(part, str) and (part in _UNION_MEMBERS or _UNION_MEMBER.search(part)):
            break  # the first part is the client's own key, whatever it looks like (an unknown one is refused)
        location.append(str(part))
    return ".".join(location)


_UNION_MEMBER = re.compile(r"[-\[\]]")  # constrained-float, list[constrained-str]
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "bytes"})


FASTAPI_BODY_ERROR = "There was an error parsing the body"
"""FastAPI's detail of its 400 for a JSON body that it could not decode (not UTF-8, nested too deeply)."""


def invalid_json(problem: str) -> ServiceError:
    """400 `invalid_json`: the body is not UTF-8 JSON (bytes that are not UTF-8, or malformed JSON); `problem`
    says what and where, never echoing the body back. The same answer on every route (a 400 on OpenAI's too)."""
    return ServiceError(
        400,
        "invalid_json",
        f"the request body is not valid UTF-8 JSON: {problem}; send one JSON object, encoded as UTF-8, with "
        "content-type application/json",
    )


def _json_syntax_error(exc: RequestValidationError) -> ServiceError | None:
    """`invalid_json` for FastAPI's `json_invalid` validation error (malformed JSON), naming where it is."""
    for error in exc.errors():
        if error.get("type") != "json_invalid":
            continue
        reason = str((error.get("ctx") or {}).get("error") or "malformed JSON").removesuffix(" at")
        position = (error.get("loc") or (None,))[-1]
        if not isinstance(position, int):
            return invalid_json(reason)
        where = f"character {position}"
        if isinstance(exc.body, str) and position <= len(exc.body):
            line = exc.body.count("\n", 0, position) + 1
            column = position - (exc.body.rfind("\n", 0, position) + 1) + 1
            where = f"line {line}, column {column} ({where})"
        return invalid_json(f"{reason} at {where}")
    return None


async def _empty_body(request: Request, exc: RequestValidationError) -> ServiceError | None:
    """`invalid_json` for a JSON body that FastAPI found missing because it has no bytes at all (a body of JSON
    `null` is missing to FastAPI too, but it is JSON: a field's error)."""
    missing = any(error.get("type") == "missing" and tuple(error.get("loc", ())) == ("body",) for error in exc.errors())
    if missing and not await request.body():  # the bytes FastAPI read, kept by the request
        return invalid_json("the body is empty")
    return None


def _body_decode_error(exc: StarletteHTTPException) -> ServiceError | None:
    """`invalid_json` for FastAPI's 400 "There was an error parsing the body", from its cause (a body that is not
    UTF-8, JSON nested too deeply); None for any other HTTP error."""
    if exc.status_code != 400 or exc.detail != FASTAPI_BODY_ERROR:
        return None
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        encoding = "UTF-8" if cause.encoding.lower().startswith("utf-8") else cause.encoding.upper()
        offset = cause.start
        if isinstance(cause.object, (bytes, bytearray)) and offset < len(cause.object):
            problem = f"the byte 0x{cause.object[offset]:02x} at byte offset {offset} is not {encoding}"
        else:
            problem = f"the bytes at byte offset {offset} are not {encoding}"
        if encoding == "UTF-8":
            problem += " (JSON must be UTF-8, not Latin-1 or Windows-1252)"
        return invalid_json(problem)
    if isinstance(cause, RecursionError):
        return invalid_json("it is nested too deeply")
    return invalid_json("it could not be decoded")


OPENAI_CHAT_PATH = "/v1/chat/completions"


def status_on(path: str, status: int) -> int:
    """The status a refusal answers with on the route of the request for `path`: OpenAI's answers 400 where the
    others answer 413 or 422 (its clients raise BadRequestError for 400 only). The one place of this rule: the
    error handlers and the body limit (a middleware, before any route) use it."""
    return 400 if status in (413, 422) and path.rstrip("/").endswith(OPENAI_CHAT_PATH) else status


def error_response(path: str, exc: ServiceError) -> JSONResponse:
    """The response that tells `exc` to the client of a request for `path`."""
    status = status_on(path, exc.status)
    return JSONResponse(error_body(status, exc.code, exc.message, exc.param), status_code=status, headers=exc.headers)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at the request's path (RFC 9110's `Allow`): each one tried as the routes
    match it (routers included in others are matched through them)."""
    routes = request.app.router.routes
    return ", ".join(
        method
        for method in _METHODS
        if any(route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes)
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(core.InfoKVError)
    async def _core(request: Request, exc: core.InfoKVError) -> JSONResponse:
        error = from_core(exc)
        if error.status >= 500:
            log.error("unexpected core error: %s", exc, exc_info=exc)
            error = ServiceError(500, "internal_error", "internal server error")
        return error_response(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # The message names the fields and what is wrong with them; it never echoes the input back.
        if (syntax := _json_syntax_error(exc) or await _empty_body(request, exc)) is not None:  # not a field's error
            return await _service(request, syntax)
        status = status_on(request.url.path, 422)
        message = _validation_message(exc, request.headers.get("content-type", ""))
        body = error_body(status, "invalid_request", message, _validation_param(exc))
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if (undecodable := _body_decode_error(exc)) is not None:  # a JSON body that is not UTF-8
            return await _service(request, undecodable)
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 400: "bad_request"}
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such endpoint; see /docs for the API"
        status = status_on(request.url.path, exc.status_code)  # e.g. a body that passed the limit as it was read
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names the methods of the path's first route only
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return JSONResponse(
            error_body(status, codes.get(exc.status_code, "http_error"), message), status_code=status, headers=headers
        )

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, exc: ClientDisconnect) -> JSONResponse:
        # A client that hangs up while its request is read (an upload cut off) is no server error: nobody
        # reads this answer, and the route has already removed what it had received.
        log.info("the client closed the connection before its request was read")
        return JSONResponse(error_body(499, "client_closed", "the client closed the connection"), status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return JSONResponse(error_body(500, "internal_error", "internal server error"), status_code=500)
