"""What route handlers depend on: the running service's objects, and the API-key check."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from .errors import ServiceError
from .registry import DocumentRecord, Registry
from .settings import Settings

if TYPE_CHECKING:
    from ..engine import InfoKVEngine
    from .worker import ModelWorker


@dataclass
class Service:
    """The running service: settings, the model worker (which owns the engine) and the documents."""

    settings: Settings
    registry: Registry
    engine: InfoKVEngine | None = None
    worker: ModelWorker | None = None
    model_id: str = ""
    started_at: float = 0.0


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]

# Declared as security schemes so that the OpenAPI schema documents both ways to send a key.
_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="X-API-Key: <API key>")


def key_matches(candidate: str, keys: tuple[str, ...]) -> bool:
    """Constant-time comparison against every configured key (no early exit, no length leak).

    Both sides are hashed first so that `hmac.compare_digest` always compares equal-length digests.
    """
    given = hashlib.sha256(candidate.encode("utf-8", "surrogatepass")).digest()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, hashlib.sha256(key.encode("utf-8")).digest())
    return matched


async def require_api_key(
    service: ServiceDep,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    header: Annotated[str | None, Security(_header)],
) -> None:
    settings = service.settings
    if not settings.auth_required:  # anonymous access was enabled explicitly (Settings.check_startable)
        return
    candidate = header if header else (bearer.credentials if bearer else None)
    challenge = {"WWW-Authenticate": 'Bearer realm="infokv-rag"'}
    if not candidate:
        raise ServiceError(
            401,
            "missing_api_key",
            "an API key is required: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
            headers=challenge,
        )
    if not key_matches(candidate, settings.api_keys):
        raise ServiceError(401, "invalid_api_key", "the API key is not valid", headers=challenge)


def find_document(service: Service, document_id: str) -> DocumentRecord:
    """The document's record, or 404 (also for ids that are not well-formed: they cannot exist)."""
    record = service.registry.get(document_id)
    if record is None:
        raise ServiceError(404, "document_not_found", "no document with this id; list yours with GET /v1/documents")
    return record
