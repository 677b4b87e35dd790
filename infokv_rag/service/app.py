"""The application factory and `serve()` (what `infokv-rag serve` runs).

    from infokv_rag.service import Settings, create_app
    app = create_app(Settings.from_env(model="tiny"))   # any ASGI server; run ONE process per model

`create_app` refuses (ConfigError) settings that would leave the service unprotected, and a data directory
it cannot write to or that another server holds. The app loads the model at startup (lifespan), reopens
the data directory (ready documents answer from their saved caches without a prefill; interrupted uploads
are read again, or failed with `invalid_option` when their stored options are not usable here) and starts the
model worker. `serve()` stops the worker before uvicorn waits for the open requests (`DrainingServer`), so on
SIGTERM the answers in flight end with 503 `cancelled`; under another ASGI server the worker stops only at the
lifespan's shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

try:
    # Starlette parses uploads with python_multipart: without it the service would start, then fail every upload.
    import python_multipart  # noqa: F401
    import uvicorn
    from fastapi import FastAPI
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ConfigError(
        f"the service needs FastAPI, uvicorn and python-multipart ({exc.name} is missing): "
        "pip install 'infokv-rag[service]'"
    ) from exc
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .dependencies import Service
from .errors import error_body, install_error_handlers, status_on
from .openapi import openapi_with_limits
from .routers import documents, health, openai, page
from .settings import Settings
from .shared_registry import DeleteWatcher, LeaseKeeper, StoreRegistry, open_registry

if TYPE_CHECKING:
    from ..engine import InfoKVEngine
    from .registry import Registry

log = logging.getLogger(__name__)

UPLOAD_OVERHEAD = 64 * 1024
"""Multipart framing and form fields allowed on top of the upload size limit."""


def route_path(scope: Scope) -> str:
    """The path that the routes match. Run under an ASGI `root_path` (a prefix, as uvicorn's `--root-path` sets),
    the server puts the prefix in front of `path`, and the routing strips it again (as Starlette's does, whole
    segments only)."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path


def body_limit(settings: Settings, method: str, path: str) -> int:
    """The most bytes the body of a request for `path` (its `route_path`) may hold: an upload's file and form, or
    any other request's (a JSON question or chat)."""
    if method == "POST" and path.rstrip("/") == "/v1/documents":
        return settings.max_upload_bytes + UPLOAD_OVERHEAD
    return settings.max_request_bytes


class BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes")


class BodyLimitMiddleware:
    """Refuses request bodies over their route's limit (`body_limit`; 413, 400 on OpenAI's route: `errors.status_on`)
    before they are read, or as soon as they pass it."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = body_limit(self.settings, scope["method"], route_path(scope))
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    status = status_on(scope["path"], 413)  # OpenAI's route answers 400, as its handlers do
                    await _send_json(send, status, error_body(status, "request_too_large", BodyTooLarge(limit).detail))
                    return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited, send)


class SecurityHeadersMiddleware:
    HEADERS = [
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
        (b"x-frame-options", b"DENY"),
    ]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + self.HEADERS
            await send(message)

        await self.app(scope, receive, with_headers)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    import json

    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def model_id(settings: Settings) -> str:
    """The model's id in the API: a file's or directory's name, else the name given (`tiny`, `org/name`)."""
    name = settings.model
    return Path(name).name if name.endswith(".gguf") or Path(name).expanduser().is_dir() else name


def create_app(settings: Settings | None = None, engine: InfoKVEngine | None = None) -> FastAPI:
    """The service as an ASGI app. `engine` may be given (tests); otherwise `settings.model` loads at startup.

    Raises `ConfigError` when the settings would leave the service unprotected (no API keys and
    anonymous access not enabled explicitly), or when the data directory is not writable or in use by
    another server (the message names the path and the reason). The directory's lock is held from here
    until the app shuts down.
    """
    settings = settings or Settings.from_env()
    settings.check_startable()
    registry = open_registry(settings)
    registry.check_writable()  # before the model loads: a server that cannot keep documents must not start
    service = Service(settings=settings, registry=registry, engine=engine, model_id=model_id(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from ..engine import InfoKVEngine
        from .worker import ModelWorker

        keepers: list[LeaseKeeper | DeleteWatcher] = []
        service.shutting_down = asyncio.Event()  # this run's: an event waits on the loop it first waited on
        try:
            if service.engine is None:
                log.info("loading model %s", settings.model)
                service.engine = await run_in_threadpool(
                    InfoKVEngine.from_pretrained, settings.model, settings.device, settings.dtype
                )
            if settings.warmup:
                await run_in_threadpool(_warm_up, service.engine)
            pending = await run_in_threadpool(service.registry.open)
            if not settings.auth_required:
                await run_in_threadpool(_warn_of_tenants_documents, service.registry)
            worker = ModelWorker(service.engine, service.registry, settings)
            worker.start()
            service.worker = worker
            if isinstance(service.registry, StoreRegistry):
                keepers = [LeaseKeeper(service.registry, worker, settings), DeleteWatcher(service.registry, worker)]
                for keeper in keepers:
                    keeper.start()
            for record in pending:
                log.info("reading %s again (interrupted by the last shutdown)", record.id)
                worker.read_again(record)
            service.started_at = time.time()
            yield
        finally:
            for keeper in keepers:
                await run_in_threadpool(keeper.stop)
            if service.worker is not None:
                await run_in_threadpool(service.worker.stop)
            service.registry.close()  # releases the data directory for the next server

    app = FastAPI(
        title="infokv-rag",
        version=_version(),
        summary="Question answering over long documents from an InfoKV-compressed, persisted KV cache",
        description=(
            "Upload a PDF or text file once; it is read into the model's KV cache, compressed with InfoKV and "
            "saved. Then ask any number of questions: each costs only its own tokens. Authenticate with "
            "`Authorization: Bearer <key>` or `X-API-Key: <key>`; every key presented must be valid. Each key "
            "belongs to a tenant, and a tenant sees only its own documents. Errors are JSON: "
            '`{"error": {"message", "type", "code"}}`.'
        ),
        lifespan=lifespan,
    )
    app.openapi = openapi_with_limits(app.openapi, settings)  # type: ignore[method-assign]
    app.state.service = service
    install_error_handlers(app)
    app.include_router(documents.router)
    app.include_router(openai.router)
    app.include_router(health.router)
    app.include_router(page.router)
    app.add_middleware(BodyLimitMiddleware, settings=settings)
    app.add_middleware(SecurityHeadersMiddleware)
    return app


def _warm_up(engine: InfoKVEngine) -> None:
    from ..config import CompressionConfig

    engine.ingest_text("Warm-up.", CompressionConfig(method="full")).ask("Ready?", max_new_tokens=1)


def _warn_of_tenants_documents(registry: Registry) -> None:
    """An open service shows no tenant's documents (`Principal.may_see`): say so where it holds some."""
    tenants = sorted({record.owner for record in registry.list() if record.owner is not None})
    if tenants:
        log.warning(
            "the documents of %d tenant(s) (%s) are kept here; an open service (INFOKV_ALLOW_ANONYMOUS) does not show "
            "them to anyone: start it with their keys to reach them",
            len(tenants),
            ", ".join(tenants[:5]) + (", ..." if len(tenants) > 5 else ""),
        )


def _version() -> str:
    from .. import __version__

    return __version__


class DrainingServer(uvicorn.Server):
    """Stops the model worker, and uploads still arriving, before uvicorn waits for the open requests and then
    cancels them: their answers end with 503 `cancelled` (an SSE `error` event), which the handlers can still send,
    and so do those uploads."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn says where it listens only for a socket it bound itself
            self._log_started_message(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.service.shutting_down.set()
        if self.service.worker is not None:
            await run_in_threadpool(self.service.worker.stop)
        await super().shutdown(sockets)


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    model: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    root_path: str = "",
    **overrides: Any,
) -> None:
    """Runs the service with uvicorn (one process: the model worker owns the model). `root_path`: the path prefix
    the service is reached under behind a proxy (`/kb`; the proxy may pass the prefix on or strip it)."""
    settings = Settings.from_env(model=model, data_dir=data_dir, **overrides)
    # A model or placement that cannot load is the caller's error, told before anything starts or is created (the
    # app loads the model inside uvicorn's startup, which would print a traceback and exit 3).
    from ..models import resolve_model
    from ..placement import resolve_placement

    resolve_placement(settings.device, settings.dtype)
    resolve_model(settings.model)
    listening = listening_socket(host, port)
    app = create_app(settings)
    if not settings.auth_required:
        bound = listening.getsockname()[1]  # port 0: the one the system picked
        where = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        log.warning("anonymous access is enabled (INFOKV_ALLOW_ANONYMOUS): anyone who can reach %s can use it", where)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        root_path=root_path,
        workers=1,
        # h11 refuses a request whose headers pass 16 KiB (its h11_max_incomplete_event_size); httptools, the default
        # where installed, read a header of 128 MiB in 30 s of the event loop, before any API key was checked.
        http="h11",
        timeout_graceful_shutdown=5,
        server_header=False,
        log_level=os.environ.get("INFOKV_LOG_LEVEL", "info").lower(),
    )
    DrainingServer(config, app.state.service).run(sockets=[listening])


def listening_socket(host: str, port: int) -> socket.socket:
    """The service's socket, bound before the model loads: a port in use or a host that does not resolve is the
    caller's error, told at once (uvicorn binds after the app's startup has loaded the model, minutes for a large
    one, then exits 3 with its log)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # an IPv6 address, as uvicorn tells it
    listening = socket.socket(family, socket.SOCK_STREAM)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:  # "::" is IPv6's any address, not IPv4's too (as asyncio binds it)
        listening.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        listening.bind((host, port))
        listening.listen()  # claims the port: with SO_REUSEADDR a second server's bind passes, its listen fails
    except OSError as exc:
        listening.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): pass another --host or --port"
        ) from exc
    return listening
