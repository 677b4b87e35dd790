"""The OpenAPI schema with this server's own limits written in.

The request models carry hard bounds (see `schemas`); the limits an operator configures (`Settings`) are
lower, and a generated client or a schema-driven test must see the same limits the server enforces.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .errors import status_on
from .schemas import SEED_MAX, SEED_MIN
from .settings import Settings

Schema = dict[str, Any]


def _bound(properties: Schema, name: str, keyword: str, value: int) -> None:
    """Sets `keyword` on the property's non-null alternatives (an optional field is `anyOf: [T, null]`)."""
    prop = properties[name]
    for alternative in prop.get("anyOf", [prop]):
        if alternative.get("type") != "null":
            alternative[keyword] = value


_FASTAPI_VALIDATION_ERROR = "#/components/schemas/HTTPValidationError"


def _drop_statuses_not_answered(schema: Schema) -> None:
    """FastAPI lists its own 422 (a validation error) on every route with a body; a route that answers it with
    another status (`errors.status_on`: OpenAI's answers 400) never answers 422, so its schema must not say so.
    FastAPI also lists its 422, in its own `{"detail": [...]}` shape, on a route whose only parameters are in the
    path: those are plain strings the route checks itself (an unknown id is 404), so no such 422 is ever sent (and
    the service's validation errors are `ErrorResponse`s): dropped, with its schemas once nothing names them."""
    for path, item in schema["paths"].items():
        for operation in item.values():
            responses = operation.get("responses", {})
            for status in [code for code in responses if code.isdigit() and status_on(path, int(code)) != int(code)]:
                del responses[status]
            validation = responses.get("422", {}).get("content", {}).get("application/json", {}).get("schema", {})
            only_path = "requestBody" not in operation and all(
                parameter["in"] == "path" for parameter in operation.get("parameters", [])
            )
            if only_path and validation.get("$ref") == _FASTAPI_VALIDATION_ERROR:
                del responses["422"]
    if _FASTAPI_VALIDATION_ERROR not in json.dumps(schema["paths"]):
        for name in ("HTTPValidationError", "ValidationError"):
            schema["components"]["schemas"].pop(name, None)


def apply_limits(schema: Schema, settings: Settings) -> Schema:
    components = schema["components"]["schemas"]
    ask = components["AskRequest"]["properties"]
    _bound(ask, "max_tokens", "maximum", settings.max_new_tokens)
    _bound(ask, "question", "maxLength", settings.max_question_chars)
    chat = components["ChatCompletionRequest"]["properties"]
    for name in ("max_tokens", "max_completion_tokens"):
        _bound(chat, name, "maximum", settings.max_new_tokens)
    for properties in (ask, chat):
        # FastAPI's OpenAPI models hold bounds as floats, which rounds 2**63 - 1 up to 2**63: restore them.
        _bound(properties, "seed", "minimum", SEED_MIN)
        _bound(properties, "seed", "maximum", SEED_MAX)
    upload = schema["paths"]["/v1/documents"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    upload["properties"]["file"]["description"] += (
        f" At most {settings.max_upload_bytes} bytes, {settings.max_pages} pages, "
        f"{settings.max_pdf_content_bytes} bytes of decoded page content (a PDF) and "
        f"{settings.max_document_chars} characters of text, and it must fit the model's context window. The body "
        f"must arrive within {settings.max_upload_seconds} s, with no pause of {settings.upload_idle_seconds} s."
    )
    _drop_statuses_not_answered(schema)
    return schema


def openapi_with_limits(generate: Callable[[], Schema], settings: Settings) -> Callable[[], Schema]:
    """Wraps FastAPI's `app.openapi` (which caches its result): the limits are applied once."""
    applied: list[Schema] = []

    def openapi() -> Schema:
        if not applied:
            applied.append(apply_limits(generate(), settings))
        return applied[0]

    return openapi
