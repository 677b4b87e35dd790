"""What route handlers depend on: the running service's objects, the caller (tenant) and its documents."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from .errors import ServiceError
from .registry import DocumentRecord, Registry
from .settings import Settings
from .tenants import Principal

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
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a graceful stop begins: an upload still arriving is refused then (503 `cancelled`), not left to
    uvicorn, which cancels what is open after its grace period with a plain-text 500."""


def get_service(request: Request) -> Service:
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(get_service)]

# Declared as security schemes so that the OpenAPI schema documents both ways to send a key. The check
# itself reads the raw headers: a credential the schemes would ignore (e.g. `Authorization: Basic ...`)
# must still be refused, not skipped.
_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer <API key>")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="X-API-Key: <API key>")

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="infokv-rag"'}
_ANONYMOUS = Principal(None, admin=True)
"""An open service (INFOKV_ALLOW_ANONYMOUS) has no tenants: its one caller sees the server's activity and every
document of no tenant (`Principal.may_see`)."""


def _unauthorized(code: str, message: str) -> ServiceError:
    return ServiceError(401, code, message, headers=_CHALLENGE)


def presented_keys(headers: Headers) -> list[str]:
    """Every credential a request's headers present, whichever header carries it (empty values included)."""
    keys = []
    for authorization in headers.getlist("authorization"):  # each one: a proxy may have added its own
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("invalid_api_key", "the Authorization header must be 'Bearer <API key>'")
        keys.append(token.strip())
    keys.extend(headers.getlist("x-api-key"))
    return keys


def presents_admin_key(settings: Settings, headers: Headers) -> bool:
    """Whether a request is an admin's: it presents keys and every one is an admin key (or the service is
    anonymous, where every caller is). What only admins may see of the server's activity depends on this."""
    if not settings.keyring:
        return True
    try:
        keys = presented_keys(headers)
    except ServiceError:
        return False
    found = [settings.keyring.find(key) for key in keys]
    return bool(found) and all(credential is not None and credential.admin for credential in found)


def identify(settings: Settings, headers: Headers) -> Principal | None:
    """The caller of a request with `headers`, or None when it presents no key (routes open to anyone); keys that it
    presents must all be valid and name the same tenant (else 401)."""
    keyring = settings.keyring
    if not keyring:  # anonymous access was enabled explicitly (Settings.check_startable)
        return _ANONYMOUS
    keys = presented_keys(headers)
    if not keys:
        return None
    found = [keyring.find(key) for key in keys]
    if any(credential is None for credential in found):
        raise _unauthorized("invalid_api_key", "the API key is not valid")
    principals = {credential.principal for credential in found if credential is not None}
    if len(principals) > 1:
        raise _unauthorized(
            "conflicting_api_keys", "the request carries API keys of different tenants or roles; send one key"
        )
    return principals.pop()


def required(caller: Principal | None) -> Principal:
    """The caller that `identify` found; 401 when the request presents no key."""
    if caller is None:
        raise _unauthorized(
            "missing_api_key", "an API key is required: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"
        )
    return caller


async def optional_caller(
    request: Request,
    service: ServiceDep,
    _bearer_scheme: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)],
    _header_scheme: Annotated[str | None, Security(_header)],
) -> Principal | None:
    """The caller (`identify`), or None when the request presents no key."""
    return identify(service.settings, request.headers)


OptionalCallerDep = Annotated[Principal | None, Depends(optional_caller)]


async def authenticate(caller: OptionalCallerDep) -> Principal:
    """The caller. Every credential presented must be valid, and all of them must name the same tenant."""
    return required(caller)


CallerDep = Annotated[Principal, Depends(authenticate)]


async def find_document(service: Service, caller: Principal, document_id: str) -> DocumentRecord:
    """The caller's document, or 404: for ids that are unknown, not well-formed (they cannot exist) or
    another tenant's (exactly the same answer, so ids cannot be probed across tenants)."""
    # In a thread: with a shared store (`StoreRegistry`), reading a record is a request to the store.
    record = await run_in_threadpool(service.registry.get, document_id)
    if record is None or not caller.may_see(record.owner):
        raise document_not_found()
    return record


def document_not_found() -> ServiceError:
    """The 404 of a document that is not there, or not the caller's, or deleted meanwhile (the same to a client)."""
    return ServiceError(404, "document_not_found", "no document with this id; list yours with GET /v1/documents")


async def visible_documents(service: Service, caller: Principal) -> list[DocumentRecord]:
    records = await run_in_threadpool(service.registry.list)
    return [record for record in records if caller.may_see(record.owner)]
