"""The service on Ray Serve: an ingress deployment and N model-worker replicas that share a cache store.

    INFOKV_API_KEYS=... infokv-rag serve --ray --replicas 2 --store s3://bucket/prefix --model default
    INFOKV_STORE=s3://bucket/prefix serve run infokv_rag.service.ray_app:app_builder replicas=2   # Ray's CLI

Each replica runs the single-process application (`create_app`: the same routers, tenants, limits, SSE,
OpenAI route, and its own model worker with its backpressure and cancellation) on a `StoreRegistry`: the
documents, their owners and their caches live in the shared store, so any replica answers any ready
document by loading its cache from the store, without a prefill. An upload is read by the replica that
received it, which publishes the cache to the store.

The ingress forwards every HTTP request it does not refuse itself (`Ingress`) unchanged to a replica, chosen by
Ray Serve's model multiplexing with the document's id as the model id (from the path, or `document_id` of an
OpenAI chat request): a replica that has served a document (or received its upload) keeps getting its questions
while it holds it, so its cache stays in memory there. Every response carries `x-infokv-replica` (the replica's
id), and a response to an admin key `x-infokv-prefills` (how many documents that replica has read), so that
operators and tests can tell who answered and whether it read the document itself.

This module imports Ray: only `infokv-rag serve --ray` and Ray's own CLI import it (extra [scale]).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import re
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

from ray import serve
from ray.serve.deployment import Application, Deployment
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message

from ..errors import ConfigError
from .app import BodyTooLarge, body_limit, create_app, route_path
from .dependencies import identify, presents_admin_key, required
from .errors import ServiceError, error_body, error_response
from .registry import valid_document_id
from .settings import Settings

log = logging.getLogger(__name__)

DOCUMENTS_PER_REPLICA = 8
"""Documents one replica is known to hold for routing (Ray's multiplexing LRU; the default of
`Settings.loaded_documents`, the caches each replica keeps in memory)."""
APP_NAME = "infokv-rag"
CONTROL_REQUESTS = 32
"""Requests a replica takes beside its answer and upload queues: status, lists, deletes, health."""
DOCUMENT_PATH = re.compile(r"^/v1/documents/([^/]+)(/|$)")
CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request as the ingress received it, sent whole to a replica."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None


@dataclass(frozen=True)
class ResponseStart:
    """The first part of a replica's answer: status and headers; the body's bytes follow."""

    status: int
    headers: list[tuple[bytes, bytes]]


def routing_key(request: ForwardedRequest) -> str:
    """The document a request is about (empty when none): its id in the path, or an OpenAI chat's
    `document_id`."""
    match = DOCUMENT_PATH.match(request.path)
    if match:
        return _document_id(match.group(1))
    if request.method == "POST" and request.path.rstrip("/") == CHAT_PATH:
        try:
            return _document_id(json.loads(request.body).get("document_id"))
        except (ValueError, AttributeError, RecursionError):  # RecursionError: JSON nested too deeply
            return ""  # the replica answers the malformed request with its usual error
    return ""


def _document_id(value: object) -> str:
    return value if isinstance(value, str) and valid_document_id(value) else ""


async def run_asgi(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
    """Runs one request through `app` in this process: its start, then its body as the app sends it.

    When the caller stops iterating (the client went away), the app's `receive` reports a disconnect, so
    the answer is cancelled exactly as in the single-process service.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": request.path,
        "raw_path": request.path.encode(),
        "query_string": request.query_string,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": None,
    }
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        await app(scope, receive, send)

    task = asyncio.create_task(run())
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], list(message.get("headers", [])))
            elif message["type"] == "http.response.body" and message.get("body"):
                yield bytes(message["body"])
        await task  # an exception of the app surfaces here
    finally:
        disconnected.set()


class ModelWorkerReplica:
    """One model worker: the single-process service app on the shared store."""

    async def __init__(self, settings: Settings) -> None:  # type: ignore[misc]  # Ray awaits an async __init__
        self.app = create_app(settings)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # loads the model, starts the worker and the lease keeper
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()

    @serve.multiplexed(max_num_models_per_replica=DOCUMENTS_PER_REPLICA)
    async def hold(self, document_id: str) -> str:
        """Marks a document as held here, for routing; its cache loads on first use (verified, from the store)."""
        return document_id

    def _identity_headers(self, request: ForwardedRequest) -> list[tuple[bytes, bytes]]:
        service = self.app.state.service
        headers = [(b"x-infokv-replica", self.replica.encode())]
        # Every tenant's uploads move the count: like /healthz's counters, it is for admin keys only.
        if presents_admin_key(service.settings, Headers(raw=request.headers)):
            headers.append((b"x-infokv-prefills", str(service.worker.counters["prefills"]).encode()))
        return headers

    async def __call__(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        document_id = serve.get_multiplexed_model_id()
        if document_id:
            await self.hold(document_id)
        async for part in run_asgi(self.app, request):
            if isinstance(part, ResponseStart):
                if part.status == 202:  # an upload read here: its questions should come here too
                    location = dict(part.headers).get(b"location", b"").decode()
                    match = DOCUMENT_PATH.match(location)
                    if match and valid_document_id(match.group(1)):
                        await self.hold(match.group(1))
                part = ResponseStart(part.status, part.headers + self._identity_headers(request))
            yield part

    async def __del__(self) -> None:
        await self._lifespan.__aexit__(None, None, None)  # stops the worker; interrupted uploads get taken over


class Ingress:
    """Forwards each request to a model-worker replica, routed by the document it is about.

    It holds each request's whole body in memory before forwarding it, so it refuses, with the replica's answer and
    before reading the body, a body over its route's limit (`body_limit`: a JSON body's is far below an upload's)
    and a POST, or a request of any method that sends a body (every route that takes one needs a key), whose keys
    are missing or not valid. Otherwise anyone
    could make it hold an upload's limit for each of the many requests it admits at once.
    """

    def __init__(self, workers: DeploymentHandle, settings: Settings) -> None:
        self.workers = workers
        self.settings = settings

    async def _body(self, request: Request) -> bytes:
        """The whole body, once the request may send it; the `ServiceError` a replica would answer with for a body
        over the limit (by its Content-Length, or as soon as it passes it), or for a caller it does not know."""
        limit = body_limit(self.settings, request.method, route_path(request.scope))
        too_large = ServiceError(413, "request_too_large", BodyTooLarge(limit).detail)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        sends_body = declared not in ("", "0") or "transfer-encoding" in request.headers
        if request.method == "POST" or sends_body:
            # Any method: a DELETE or GET with a body would be held as long as a POST's.
            required(identify(self.settings, request.headers))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def __call__(self, request: Request) -> Response:
        try:
            body = await self._body(request)
        except ServiceError as exc:
            return error_response(request.url.path, exc)
        forwarded = ForwardedRequest(
            method=request.method,
            path=request.url.path,
            query_string=request.url.query.encode(),
            headers=list(request.headers.raw),
            body=body,
            client=(request.client.host, request.client.port) if request.client else None,
        )
        parts = cast(
            DeploymentResponseGenerator,
            self.workers.options(stream=True, multiplexed_model_id=routing_key(forwarded)).remote(forwarded),
        )
        try:
            start = await parts.__anext__()
        except Exception as exc:  # noqa: BLE001 - a replica that died or is stopping: the client retries
            log.warning("no replica answered %s %s: %r", forwarded.method, forwarded.path, exc)
            return JSONResponse(
                error_body(503, "busy", "no model worker could take the request; retry shortly"),
                status_code=503,
                headers={"Retry-After": "2"},
            )
        assert isinstance(start, ResponseStart)

        async def rest() -> AsyncIterator[bytes]:
            async for part in parts:
                yield part

        response = StreamingResponse(rest(), status_code=start.status)
        response.raw_headers = start.headers
        return response


def _deployment(cls: type) -> Deployment:
    # Applied to a class, serve.deployment returns a Deployment; its annotation only describes the
    # decorator-factory form.
    return cast(Deployment, serve.deployment(cls))


def build_app(settings: Settings, replicas: int, replica_cpus: float = 1.0, replica_gpus: float = 0.0) -> Application:
    """The Ray Serve application: `replicas` model workers (each `replica_cpus` CPUs and `replica_gpus`
    GPUs) behind one ingress."""
    settings.check_startable()
    if settings.store is None:
        raise ConfigError(
            "the Ray application needs a shared store: --store s3://bucket/prefix (or file:///shared/dir)"
        )
    if replicas < 1:
        raise ConfigError(f"replicas must be positive, got {replicas}")
    for option, amount in (("--replica-cpus", replica_cpus), ("--replica-gpus", replica_gpus)):
        if not (math.isfinite(amount) and amount >= 0):
            raise ConfigError(f"{option} must be a finite number >= 0 (a share of a CPU or GPU), got {amount}")
    # Ray admits this many requests to a replica at once: enough for its own queues to fill, so that the
    # replica's backpressure (503 busy, and 429 tenant_queue_full for a tenant over its share) answers as in the
    # single-process service, not Ray's queue. Sized by the whole queues, not by a tenant's share: the replica
    # enforces the shares itself, and one tenant's requests must never fill Ray's admission ahead of the others'.
    per_replica = settings.generations_held + settings.max_queued_uploads + CONTROL_REQUESTS
    workers = (
        _deployment(ModelWorkerReplica)
        .options(
            name="ModelWorker",
            num_replicas=replicas,
            max_ongoing_requests=per_replica,
            ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus},
        )
        .bind(settings)
    )
    # The ingress only forwards bytes: it reserves no CPU, so it never competes with a model worker.
    return (
        _deployment(Ingress)
        .options(name="Ingress", max_ongoing_requests=per_replica * replicas, ray_actor_options={"num_cpus": 0})
        .bind(workers, settings)
    )


def app_builder(args: dict[str, str]) -> Application:
    """For `serve run infokv_rag.service.ray_app:app_builder replicas=N model=...`: settings from INFOKV_*
    environment variables, then `args` (any `Settings` field, plus `replicas`, `replica_cpus`, `replica_gpus`)."""
    options = dict(args)
    replicas = int(options.pop("replicas", os.environ.get("INFOKV_REPLICAS", "2")))
    replica_cpus = float(options.pop("replica_cpus", "1"))
    replica_gpus = float(options.pop("replica_gpus", "0"))
    environ = {**os.environ, **{f"INFOKV_{name.upper()}": value for name, value in options.items()}}
    return build_app(Settings.from_env(environ), replicas, replica_cpus, replica_gpus)


def serve_ray(
    settings: Settings, replicas: int, host: str, port: int, replica_cpus: float = 1.0, replica_gpus: float = 0.0
) -> None:
    """`infokv-rag serve --ray`: joins the Ray cluster of RAY_ADDRESS (or starts a local one) and runs the
    application until SIGINT or SIGTERM, then removes it gracefully (each replica stops its worker; an upload
    it was reading is taken over by the next replicas)."""
    import ray

    application = build_app(settings, replicas, replica_cpus, replica_gpus)  # refuses bad settings before Ray starts
    ray.init(address=os.environ.get("RAY_ADDRESS") or None)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):  # after ray.init, whose own handler would exit at once
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        log.info("serving on http://%s:%s with %d replicas", host, port, replicas)
        stop.wait()
        serve.delete(APP_NAME)  # this application only: a shared cluster may serve others
    finally:
        ray.shutdown()
