"""The service's queues and lifecycle, on a live server (the random model): a place in a queue is held only by
work someone still waits for, one tenant cannot take more than its share of a queue (429 `tenant_queue_full`,
while the others still find places; 503 `busy` only when the queue as a whole is full), nothing of a deleted
document is served after its DELETE returned, and a graceful stop answers the requests in flight with 503
`cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from infokv_rag.config import CompressionConfig  # noqa: E402
from infokv_rag.documents import document_from_text  # noqa: E402
from infokv_rag.errors import CacheStoreError  # noqa: E402
from infokv_rag.service.answers import _rebuild, ready_document  # noqa: E402
from infokv_rag.service.dependencies import Service  # noqa: E402
from infokv_rag.service.errors import ServiceError  # noqa: E402
from infokv_rag.service.launcher import ServerProcess, read_sse  # noqa: E402
from infokv_rag.service.registry import DocumentRecord, Registry, Status, new_document_id  # noqa: E402
from infokv_rag.service.worker import ModelWorker, QueueFull, TenantShareFull  # noqa: E402

from .service_helpers import (  # noqa: E402
    ADMIN_ENTRY,
    admin_health,
    assert_error,
    bearer,
    random_model_settings,
    read_response,
    send_part_of_an_upload,
    upload,
    upload_ready,
    wait_queue,
)

KEY_A, KEY_B, KEY_C = "queues-key-tenant-a", "queues-key-tenant-b", "queues-key-tenant-c"
A, B, C = bearer(KEY_A), bearer(KEY_B), bearer(KEY_C)
SETTINGS = {
    "warmup": False,
    "default_method": "snapkv",
    "ingest_chunk_size": 32,  # a long upload stays in "processing" for many seconds
    # The tenants' shares are the defaults, half of each queue: 1 upload waiting, 2 answers in flight.
    "max_queued_uploads": 2,
    "max_active_generations": 1,
    "max_queued_generations": 2,
    "max_new_tokens": 2048,  # an answer that runs while the test does what it needs
    "upload_idle_seconds": 2,
    "max_upload_seconds": 6,
    "default_max_tokens": 4,
}
LONG_ANSWER = {"question": "Q?", "max_tokens": 2048}


VOCABULARY = "the supplier shall deliver goods within thirty days of order either party may terminate".split()


def text(words: int, seed: int) -> bytes:
    """A document of `words` words (about 2.4 tokens each for the random model's tokenizer)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(words)).encode()


def start_server(model_dir: Path, root: Path) -> ServerProcess:
    server = ServerProcess(
        str(model_dir),
        root / "data",
        api_keys=[f"tenantA:{KEY_A}", f"tenantB:{KEY_B}", f"tenantC:{KEY_C}"],
        admin_keys=[ADMIN_ENTRY],
        settings=SETTINGS,
        log_path=root / "server.log",
        env={"OMP_NUM_THREADS": "1"},
    )
    return server.start()


@pytest.fixture(scope="module")
def server(random_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = start_server(random_model_dir, tmp_path_factory.mktemp("queues"))
    yield process
    process.stop()


@pytest.fixture()
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client
        # Every test leaves the server idle for the next: its documents deleted, no answer running.
        for headers in (A, B, C):
            for document in client.get("/v1/documents", headers=headers).json()["data"]:
                client.delete(f"/v1/documents/{document['id']}", headers=headers)
        deadline = time.monotonic() + 120
        while any(admin_health(client)["queue"].values()):
            assert time.monotonic() < deadline, admin_health(client)["queue"]
            time.sleep(0.1)


def wait_status(client: httpx.Client, doc_id: str, headers: dict[str, str], status: str) -> None:
    deadline = time.monotonic() + 120
    while client.get(f"/v1/documents/{doc_id}", headers=headers).json()["status"] != status:
        assert time.monotonic() < deadline, f"{doc_id} never {status}"
        time.sleep(0.02)


def in_thread(target: Any) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_an_upload_that_stops_arriving_is_refused_and_gives_its_place_back(
    client: httpx.Client, server: ServerProcess
) -> None:
    """A client that sent part of its upload and then nothing, its connection left open, held its queue place for
    as long as it liked: two such clients of two tenants answered every other upload 503 busy. After
    `upload_idle_seconds` of silence (2 here) the upload is refused with 408 and its place given back."""
    with (
        send_part_of_an_upload(server.port, KEY_A, text(4000, seed=5)) as stalled_a,
        send_part_of_an_upload(server.port, KEY_B, text(4000, seed=6)),
    ):
        wait_queue(client, receiving_uploads=2)
        assert_error(upload(client, C, "c.txt", text(60, seed=7)), 503, "busy")
        stalled_a.settimeout(30)
        answer = read_response(stalled_a).decode()
        assert answer.startswith("HTTP/1.1 408") and "upload_timeout" in answer, answer
        created = upload(client, C, "c.txt", text(60, seed=7))
        assert created.status_code == 202, created.text
    assert client.get("/v1/documents", headers=A).json()["data"] == []


def test_an_upload_that_trickles_is_refused_after_max_upload_seconds(
    client: httpx.Client, server: ServerProcess
) -> None:
    """A body sending a byte within every idle interval was never cut, holding its queue place for good: after
    `max_upload_seconds` in all (6 here) it is refused with 408 and its place given back."""
    with send_part_of_an_upload(server.port, KEY_A, text(4000, seed=8)) as trickling:
        started = time.monotonic()
        wait_queue(client, receiving_uploads=1)
        trickling.settimeout(0.5)
        answer = b""
        while not answer:
            assert time.monotonic() - started < 30, "the trickling upload was never cut"
            trickling.sendall(b"x")
            with contextlib.suppress(TimeoutError):
                answer = trickling.recv(65536)
        assert 6 <= time.monotonic() - started, "cut before max_upload_seconds"
        trickling.settimeout(30)
        answer = read_response(trickling, answer)
        assert answer.startswith(b"HTTP/1.1 408") and b"took longer than 6 s" in answer, answer
    assert client.get("/v1/documents", headers=A).json()["data"] == []


def test_deleted_uploads_free_their_places_and_a_refused_upload_is_never_made(client: httpx.Client) -> None:
    big = upload(client, A, "big.txt", text(1600, seed=1)).json()["id"]
    wait_status(client, big, A, "processing")
    # Two tenants fill the queue, each with its share of one place.
    queued = [upload(client, headers, "q.txt", text(60, seed=10)).json() for headers in (A, B)]
    # The queue is full: refused before the upload is parsed (a corrupt PDF is not even looked at) or listed.
    assert_error(upload(client, C, "c.txt", text(60, seed=20)), 503, "busy")
    assert_error(upload(client, C, "broken.pdf", b"%PDF-1.7 not really"), 503, "busy")
    assert client.get("/v1/documents", headers=C).json()["data"] == []
    for document, headers in zip(queued, (A, B), strict=True):
        assert client.delete(f"/v1/documents/{document['id']}", headers=headers).status_code == 200
    health = admin_health(client)
    assert health["queue"]["queued_uploads"] == 0 and health["documents"]["queued"] == 0, health
    accepted = upload(client, C, "c.txt", text(60, seed=20))
    assert accepted.status_code == 202, accepted.text
    # What this test is about: the places freed while the long upload was still being read.
    assert client.get(f"/v1/documents/{big}", headers=A).json()["status"] == "processing"


def test_questions_whose_clients_left_free_their_places(client: httpx.Client, server: ServerProcess) -> None:
    doc_id, doc_b = (upload_ready(client, h, "d.txt", text(300, seed=2)) for h in (A, B))
    long = in_thread(lambda: client.post(f"/v1/documents/{doc_id}/ask", json=LONG_ANSWER, headers=A))
    wait_queue(client, active_generations=1)
    # Two questions (one of each tenant: each tenant's share is 2 answers in flight) fill the queue behind it,
    # and their clients give up.
    for document, headers in ((doc_id, A), (doc_b, B)):
        with pytest.raises(httpx.TimeoutException):
            url = f"{server.url}/v1/documents/{document}/ask"
            httpx.post(url, json={"question": "Q?"}, headers=headers, timeout=0.5)
    time.sleep(1.5)  # the server looks for a closed connection every half second
    assert admin_health(client)["queue"]["queued_generations"] == 0
    assert client.post(f"/v1/documents/{doc_id}/ask", json={"question": "Q?"}, headers=B).status_code == 404
    answer = client.post(f"/v1/documents/{doc_id}/ask", json={"question": "Q?"}, headers=A)
    # Waited behind the long answer instead of a 503 or a 429: the place in the queue and in A's share are free.
    assert answer.status_code == 200, answer.text
    long.join()


def test_nothing_of_a_deleted_document_is_served_after_its_delete(client: httpx.Client, server: ServerProcess) -> None:
    busy, doomed = (upload_ready(client, A, f"{name}.txt", text(300, seed=3 + i)) for i, name in enumerate("xy"))
    long = in_thread(lambda: client.post(f"/v1/documents/{busy}/ask", json=LONG_ANSWER, headers=A))
    wait_queue(client, active_generations=1)
    queued: dict[str, httpx.Response] = {}

    def ask_doomed() -> None:
        queued["answer"] = httpx.post(
            f"{server.url}/v1/documents/{doomed}/ask", json={"question": "Q?"}, headers=A, timeout=120
        )

    waiting = in_thread(ask_doomed)
    wait_queue(client, queued_generations=1)
    assert client.delete(f"/v1/documents/{doomed}", headers=A).status_code == 200
    waiting.join(60)
    assert_error(queued["answer"], 404, "document_not_found")  # queued before the DELETE, never started
    long.join()

    streamed = upload_ready(client, A, "z.txt", text(300, seed=6))
    events_after_delete: list[str] = []
    with httpx.stream(
        "POST", f"{server.url}/v1/documents/{streamed}/ask", json={**LONG_ANSWER, "stream": True}, headers=A
    ) as stream:
        deleted = False
        for name, data in read_sse(stream.iter_lines()):
            if name == "token" and not deleted:
                assert client.delete(f"/v1/documents/{streamed}", headers=A).status_code == 200
                deleted = True
            elif deleted:
                events_after_delete.append(name)
                last = data
    # Pieces made while the DELETE was under way still arrive; then the answer stops (it had 2,048 tokens to go).
    assert events_after_delete[-1] == "error" and len(events_after_delete) < 500, len(events_after_delete)
    assert '"document_not_found"' in last


def documents_on_disk(server: ServerProcess) -> set[str]:
    """Ids of the documents with a directory in the server's data directory (a deletion in progress aside)."""
    return {path.name for path in (server.data_dir / "documents").iterdir() if not path.name.startswith(".")}


def test_a_tenant_over_its_upload_share_is_refused_and_others_still_upload(
    client: httpx.Client, server: ServerProcess
) -> None:
    first = upload(client, A, "big.txt", text(1500, seed=30))  # under the model's 3776 document tokens
    assert first.status_code == 202, first.text
    big = first.json()["id"]
    wait_status(client, big, A, "processing")  # being read: it no longer waits, and holds no place
    queued = upload(client, A, "q.txt", text(60, seed=31)).json()["id"]
    # A holds its share (one upload waiting): refused before the upload is parsed (a corrupt PDF is not even
    # looked at), stored or listed; the queue itself still has a place.
    for name, data in (("more.txt", text(60, seed=32)), ("broken.pdf", b"%PDF-1.7 not really")):
        response = upload(client, A, name, data)
        error = assert_error(response, 429, "tenant_queue_full")
        assert response.headers["retry-after"] == "10" and "share" in error["message"], error
    assert {d["id"] for d in client.get("/v1/documents", headers=A).json()["data"]} == {big, queued}
    assert documents_on_disk(server) == {big, queued}
    assert list((server.data_dir / "uploads").iterdir()) == []
    # Another tenant still finds the place that is left.
    other = upload(client, B, "b.txt", text(60, seed=33))
    assert other.status_code == 202, other.text
    assert documents_on_disk(server) == {big, queued, other.json()["id"]}
    # A's share is free again once its waiting upload is gone.
    assert client.delete(f"/v1/documents/{queued}", headers=A).status_code == 200
    accepted = upload(client, A, "more.txt", text(60, seed=32))
    assert accepted.status_code == 202, accepted.text


def test_a_tenant_over_its_answer_share_is_refused_and_others_still_ask(
    client: httpx.Client, server: ServerProcess
) -> None:
    doc_a, doc_b = (upload_ready(client, h, "d.txt", text(300, seed=40)) for h in (A, B))
    answers: dict[str, httpx.Response] = {}

    def ask(name: str, document: str, headers: dict[str, str], question: dict[str, Any]) -> threading.Thread:
        def post() -> None:
            answers[name] = httpx.post(
                f"{server.url}/v1/documents/{document}/ask", json=question, headers=headers, timeout=120
            )

        return in_thread(post)

    asked = [ask("long", doc_a, A, LONG_ANSWER)]
    wait_queue(client, active_generations=1)
    asked.append(ask("a", doc_a, A, {"question": "Q?"}))
    wait_queue(client, queued_generations=1)
    # A has its share (2 answers in flight) while the queue has a place: A is refused, on every route.
    response = client.post(f"/v1/documents/{doc_a}/ask", json={"question": "Q?"}, headers=A)
    error = assert_error(response, 429, "tenant_queue_full")
    assert response.headers["retry-after"] == "2" and "share" in error["message"], error
    model = client.get("/v1/models", headers=A).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "Q?"}], "document_id": doc_a, "max_tokens": 2}
    assert_error(client.post("/v1/chat/completions", json=chat, headers=A), 429, "tenant_queue_full")
    # B takes the place that is left; once the queue is full, B (under its share) is told the server is busy.
    asked.append(ask("b", doc_b, B, {"question": "Q?"}))
    wait_queue(client, queued_generations=2)
    response = client.post(f"/v1/documents/{doc_b}/ask", json={"question": "Q?"}, headers=B)
    assert_error(response, 503, "busy")
    assert response.headers["retry-after"] == "2"
    for thread in asked:
        thread.join(120)
    assert {name: answer.status_code for name, answer in answers.items()} == {"long": 200, "a": 200, "b": 200}


def listed_record(filename: str, status: Status, owner: str, method: str, keep: float) -> DocumentRecord:
    """A new document's registry record, made at time 0."""
    return DocumentRecord(
        id=new_document_id(),
        filename=filename,
        status=status,
        owner=owner,
        method=method,
        keep=keep,
        created_at=0,
        updated_at=0,
    )


@pytest.fixture()
def in_process(random_engine: Any, tmp_path: Path) -> Iterator[tuple[Service, DocumentRecord]]:
    """A service in this process (its worker not started: what is submitted to it stays queued) with one ready
    document whose cache is on disk, not in memory."""
    settings = random_model_settings(tmp_path / "data", (KEY_A,))
    registry = Registry(settings.data_dir, settings.loaded_documents)
    registry.open()
    document = random_engine.ingest_text("The notice period is ninety days.", CompressionConfig(method="full"))
    record = listed_record("memo.txt", "ready", "default", "full", 1.0)
    registry.create(record, document.document)
    registry.finish(record, document)
    registry.forget_loaded(record.id)
    worker = ModelWorker(random_engine, registry, settings)
    yield Service(settings=settings, registry=registry, engine=random_engine, model_id="random", worker=worker), record
    registry.close()


def refusal(service: Service, record: DocumentRecord) -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        asyncio.run(ready_document(service, record))
    return refused.value


def test_questions_that_find_a_cache_damaged_at_once_start_one_read(
    in_process: tuple[Service, DocumentRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, record = in_process
    assert service.worker is not None
    submitted: list[str] = []
    monkeypatch.setattr(service.worker, "submit_ingestion", lambda job: submitted.append(job.record.id))
    tensors = service.registry.cache_path(record.id) / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-10])
    error = refusal(service, record)
    assert (error.status, error.code) == (409, "cache_rebuilding") and record.status == "queued"
    # A second question that passed the status check before the first one's load failed, failing now.
    error = _rebuild(service, record, CacheStoreError("damaged"))
    assert (error.status, error.code) == (409, "cache_rebuilding")
    assert submitted == [record.id]


def test_a_question_that_finds_its_document_deleted_is_told_so(in_process: tuple[Service, DocumentRecord]) -> None:
    """A question that read the record just before a DELETE removed the files: 404, not 'being read again'."""
    service, record = in_process
    assert service.worker is not None
    service.registry.delete(record)
    error = refusal(service, record)
    assert (error.status, error.code) == (404, "document_not_found")
    assert isinstance(error.__cause__, CacheStoreError) and service.worker.ingestions() == []


def test_a_graceful_stop_answers_the_questions_in_flight(random_model_dir: Path, tmp_path: Path) -> None:
    server = start_server(random_model_dir, tmp_path)
    outcomes: dict[str, Any] = {}
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            doc_id = upload_ready(client, A, "d.txt", text(300, seed=7))

        def streamed() -> None:
            with httpx.stream(
                "POST", f"{server.url}/v1/documents/{doc_id}/ask", json={**LONG_ANSWER, "stream": True}, headers=A
            ) as stream:
                outcomes["stream"] = list(read_sse(stream.iter_lines()))[-1]

        def whole() -> None:
            outcomes["json"] = httpx.post(
                f"{server.url}/v1/documents/{doc_id}/ask", json=LONG_ANSWER, headers=A, timeout=120
            )

        clients = [in_thread(streamed), in_thread(whole)]
        with httpx.Client(base_url=server.url, timeout=120) as client:
            wait_queue(client, active_generations=1, queued_generations=1)
            # An upload still arriving: uvicorn cut it after its grace period with a plain-text 500.
            arriving = send_part_of_an_upload(server.port, KEY_A, text(4000, seed=9))
            wait_queue(client, receiving_uploads=1)
    finally:
        server.stop()  # SIGTERM: a graceful stop
    for thread in clients:
        thread.join(60)
    assert_error(outcomes["json"], 503, "cancelled")
    name, data = outcomes["stream"]
    assert name == "error" and '"cancelled"' in data, outcomes["stream"]
    arriving.settimeout(30)
    answer = read_response(arriving).decode()
    assert answer.startswith("HTTP/1.1 503") and '"code":"cancelled"' in answer.replace(" ", ""), answer
    assert "application/json" in answer and list((tmp_path / "data" / "uploads").iterdir()) == [], answer
    log = server.log_tail(20000)
    assert "Application shutdown complete" in log and "Exception in ASGI application" not in log, log


def test_documents_read_again_are_never_refused_but_hold_their_tenants_share(
    random_engine: Any, tmp_path: Path
) -> None:
    """Documents read again (after a restart, a takeover or a lost cache) are already listed: they take their
    places even beyond the share and the queue, and then count against their owner's share like any upload. An
    open service's caller (no tenant) has no share, only the queue."""
    settings = random_model_settings(tmp_path / "data", (f"tenantA:{KEY_A}",), max_queued_uploads=4)
    assert settings.upload_share == 2
    # Not started: what is queued stays queued (and, read again from nothing, no registry file is needed).
    worker = ModelWorker(random_engine, Registry(settings.data_dir, settings.loaded_documents), settings)
    with contextlib.ExitStack() as slots:
        for _ in range(settings.max_queued_uploads):  # the whole queue, twice the share of a tenant
            slots.enter_context(worker.upload_slot(None))
        with pytest.raises(QueueFull) as refused, worker.upload_slot(None):
            pass
        assert type(refused.value) is QueueFull  # the queue is full: 503 busy, not a share of it
    for number in range(3):
        assert worker.read_again(listed_record(f"{number}.txt", "queued", "tenantA", "snapkv", 0.5))
    assert worker.queue_state()["queued_uploads"] == 3
    with pytest.raises(TenantShareFull), worker.upload_slot("tenantA"):
        pass
    with worker.upload_slot("tenantB"):  # another tenant takes the place that is left
        with pytest.raises(QueueFull) as refused, worker.upload_slot("tenantC"):
            pass
        assert type(refused.value) is QueueFull


def test_a_share_of_the_whole_queue_is_off_and_the_queue_answers_busy(random_engine: Any, tmp_path: Path) -> None:
    """A tenant's share equal to its queue turns the share off: a tenant that fills the queue is refused by the
    queue (503 busy), not by a share (429), as a single-tenant deployment that sets it so expects."""
    settings = random_model_settings(
        tmp_path / "data", (f"tenantA:{KEY_A}",), max_queued_uploads=2, max_queued_uploads_per_tenant=2
    )
    worker = ModelWorker(random_engine, Registry(settings.data_dir, settings.loaded_documents), settings)
    with worker.upload_slot("tenantA"), worker.upload_slot("tenantA"):
        with pytest.raises(QueueFull) as refused, worker.upload_slot("tenantA"):
            pass
    assert type(refused.value) is QueueFull


def test_a_restart_fails_an_interrupted_upload_whose_options_it_cannot_use(random_engine: Any, tmp_path: Path) -> None:
    """An upload left queued by the last run, with an option this server cannot use (a method it lacks): the
    server starts, fails that document with the reason, and reads the others again."""
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app

    settings = random_model_settings(tmp_path / "data", (f"tenantA:{KEY_A}",))
    registry = Registry(settings.data_dir, settings.loaded_documents)
    registry.open()
    ids = {}
    for method in ("no-such-method", "snapkv"):
        record = DocumentRecord(
            id=new_document_id(),
            filename=f"{method}.txt",
            status="queued",
            owner="tenantA",
            method=method,
            keep=0.5,
            created_at=0,
            updated_at=0,
        )
        registry.create(record, document_from_text(text(100, seed=8).decode()))
        ids[method] = record.id
    registry.close()
    with TestClient(create_app(settings, engine=random_engine)) as client:
        unusable = client.get(f"/v1/documents/{ids['no-such-method']}", headers=A).json()
        assert unusable["status"] == "failed" and unusable["reason_code"] == "invalid_option", unusable
        deadline = time.monotonic() + 60
        while client.get(f"/v1/documents/{ids['snapkv']}", headers=A).json()["status"] != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.05)
