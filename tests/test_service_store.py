"""The service on a shared cache store (INFOKV_STORE), without Ray: two service processes' worth of apps
in one test process (each with its own engine and model worker) sharing a file:// or S3 (moto) store.

What a replica of the Ray application relies on: a document read by one process is answered by another
from the store without a prefill, tenants stay isolated through the store, a document whose reader died
is taken over and read again, and a delete anywhere is seen everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, cast

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("fsspec", reason="the shared store needs the [scale] extra")

from fastapi.testclient import TestClient  # noqa: E402

from infokv_rag import CacheStoreError, CompressedDocument, InfoKVEngine  # noqa: E402
from infokv_rag.cache_backends import CACHE, CURRENT, CacheBackend, open_backend  # noqa: E402
from infokv_rag.config import CompressionConfig  # noqa: E402
from infokv_rag.documents import document_from_text  # noqa: E402
from infokv_rag.errors import ConfigError, DocumentError  # noqa: E402
from infokv_rag.service import shared_registry  # noqa: E402
from infokv_rag.service.app import create_app  # noqa: E402
from infokv_rag.service.errors import StorageError, StoreUnreadable  # noqa: E402
from infokv_rag.service.registry import DocumentRecord, Registry, new_document_id  # noqa: E402
from infokv_rag.service.settings import Settings  # noqa: E402
from infokv_rag.service.shared_registry import LeaseKeeper, StoreRegistry  # noqa: E402
from infokv_rag.service.worker import IngestJob, ModelWorker  # noqa: E402

from .s3_server import s3_server  # noqa: E402
from .service_helpers import (  # noqa: E402
    assert_error,
    bearer,
    random_model_settings,
    server_counters,
    upload_ready,
    wait_queue,
    wait_settled,
)

KEY_A, KEY_B = "key-tenant-a-0001", "key-tenant-b-0001"
A, B = bearer(KEY_A), bearer(KEY_B)
SECRET = b"Memo for tenant A. The vault code is 9988776. The office closes at five."
QUESTION = {"question": "What is the vault code?", "max_tokens": 6}


def settings_for(tmp_path: Path, store: str, **overrides: Any) -> Settings:
    keys = (f"tenantA:{KEY_A}", f"tenantB:{KEY_B}")
    return random_model_settings(tmp_path / "local", keys, store=store, **overrides)


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path}/store"
        return
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    with s3_server("infokv-service"):
        yield "s3://infokv-service/prefix"


@pytest.fixture
def second_engine(random_model_dir: Path) -> InfoKVEngine:
    """Another engine of the same model: the second process's."""
    return InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu")


def test_another_process_answers_from_the_store_without_a_prefill(
    random_engine: InfoKVEngine, second_engine: InfoKVEngine, tmp_path: Path, store_url: str
) -> None:
    with (
        TestClient(create_app(settings_for(tmp_path / "a", store_url), engine=random_engine)) as first,
        TestClient(create_app(settings_for(tmp_path / "b", store_url), engine=second_engine)) as second,
    ):
        doc_id = upload_ready(first, A, "memo.txt", SECRET)
        reference = first.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A)
        assert reference.status_code == 200, reference.text

        seen_here, seen_there = (client.get(f"/v1/documents/{doc_id}", headers=A).json() for client in (first, second))
        assert seen_there["status"] == "ready" and seen_there["progress"] == seen_here["progress"] is not None
        answer = second.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A)
        assert answer.status_code == 200, answer.text
        assert answer.json()["answer"] == reference.json()["answer"]
        assert server_counters(first)["prefills"] == 1
        assert server_counters(second)["prefills"] == 0 and server_counters(second)["cache_loads"] == 1
        assert second.get(f"/v1/documents/{doc_id}", headers=A).json()["cache_origin"] == "store"

        # Tenants stay apart through the store: B sees nothing of A's, on either process.
        for client in (first, second):
            assert client.get("/v1/documents", headers=B).json()["data"] == []
            assert_error(client.get(f"/v1/documents/{doc_id}", headers=B), 404, "document_not_found")
            assert_error(
                client.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=B), 404, "document_not_found"
            )
        assert [d["id"] for d in second.get("/v1/documents", headers=A).json()["data"]] == [doc_id]

        # A delete on one process is seen by the other.
        assert second.delete(f"/v1/documents/{doc_id}", headers=A).status_code == 200
        assert_error(first.get(f"/v1/documents/{doc_id}", headers=A), 404, "document_not_found")
        assert first.get("/v1/documents", headers=A).json()["data"] == []


def test_a_delete_elsewhere_ends_the_answers_in_flight_here(
    random_engine: InfoKVEngine, second_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """Process 1 is answering a question about a document, with another one queued; process 2 deletes it. Neither
    answer goes on: the running one ends within about a second (`DeleteWatcher`), the queued one never starts."""
    store = f"file://{tmp_path}/store"
    limits = {"max_new_tokens": 3000, "max_active_generations": 1}
    with (
        TestClient(create_app(settings_for(tmp_path / "a", store, **limits), engine=random_engine)) as first,
        TestClient(create_app(settings_for(tmp_path / "b", store, **limits), engine=second_engine)) as second,
    ):
        doc_id = upload_ready(first, A, "memo.txt", SECRET)
        answers: dict[str, Any] = {}

        def ask(name: str, max_tokens: int) -> None:
            body = {**QUESTION, "max_tokens": max_tokens}
            answers[name] = first.post(f"/v1/documents/{doc_id}/ask", json=body, headers=A)

        running = threading.Thread(target=ask, args=("running", 3000))
        running.start()
        wait_queue(first, active_generations=1)
        queued = threading.Thread(target=ask, args=("queued", 4))
        queued.start()
        wait_queue(first, queued_generations=1)
        assert second.delete(f"/v1/documents/{doc_id}", headers=A).status_code == 200
        running.join()
        queued.join()
        for name in ("running", "queued"):  # a running answer that had gone on to its end would be a 200
            assert_error(answers[name], 404, "document_not_found")


def put_orphan(backend: CacheBackend, doc_id: str, **meta: Any) -> None:
    """What a reader killed mid-prefill leaves in the store: the text and a record in `processing` whose lease
    nobody renews (`meta`: fields to change in it)."""
    document = document_from_text(SECRET.decode())
    backend.put(
        f"documents/{doc_id}", "document.json", json.dumps({"text": document.text, **document.layout()}).encode()
    )
    now = time.time()
    record = {
        "id": doc_id,
        "owner": "tenantA",
        "filename": "memo.txt",
        "status": "processing",
        "method": "snapkv",
        "keep": 0.25,
        "created_at": now,
        "updated_at": now,
        "tokens": 0,
        "lease": {"holder": "dead", "until": now - 1},
        **meta,
    }
    backend.put(f"documents/{doc_id}", "meta.json", json.dumps(record).encode())
    backend.put(f"pending/{doc_id}", "lease", b"")


class FakeWorker:
    """What `LeaseKeeper` uses of a `ModelWorker`: the documents read here, the queue takeovers join, and how a
    document is read again (the worker's own `read_again`, over the keeper's registry and settings)."""

    registry: Registry
    settings: Settings
    read_again = ModelWorker.read_again

    def __init__(self, reading: list[str] | None = None) -> None:
        self.reading = reading or []
        self.submitted: list[IngestJob] = []

    def ingestions(self) -> list[str]:
        return list(self.reading)

    def submit_ingestion(self, job: IngestJob) -> None:
        self.submitted.append(job)


def lease_keeper(tmp_path: Path, store_url: str, worker: FakeWorker) -> LeaseKeeper:
    """A keeper (not started: the test ticks it) over a fresh process's registry of the store."""
    registry = StoreRegistry(open_backend(store_url), tmp_path / "keeper", loaded_documents=2, lease_seconds=30)
    worker.registry, worker.settings = registry, settings_for(tmp_path, store_url)
    return LeaseKeeper(registry, cast(ModelWorker, worker), worker.settings)


def test_damaged_text_in_the_store_is_never_read_again(tmp_path: Path) -> None:
    """The text a document is read again from (a takeover, a lost cache) is checked in the store as on a local disk:
    changed after upload, it fails the read (`DocumentError`, the document failed as `unreadable_document`)."""
    backend = open_backend(f"file://{tmp_path}/store")
    registry = StoreRegistry(backend, tmp_path / "replica", loaded_documents=2, lease_seconds=30)
    now = time.time()
    record = DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
    registry.create(record, document_from_text(SECRET.decode()))
    stored = registry.get(record.id)
    assert stored is not None and registry.read_document(stored).text == SECRET.decode()
    saved = backend.get(f"documents/{record.id}", "document.json")
    backend.put(f"documents/{record.id}", "document.json", saved.replace(b"9988776", b"9988771"))
    with pytest.raises(DocumentError, match="saved text is damaged"):
        registry.read_document(stored)


def test_a_takeover_with_unusable_options_fails_that_document_only(tmp_path: Path) -> None:
    """A pending record whose options this process cannot use (an unknown method) is failed, and the documents
    claimed after it in the same tick are still taken over; only the latter count as takeovers."""
    store_url = f"file://{tmp_path}/store"
    backend = open_backend(store_url)
    unusable, usable = "doc_" + "A" * 22, "doc_" + "B" * 22  # the unusable one is claimed first
    put_orphan(backend, unusable, method="no-such-method")
    put_orphan(backend, usable)
    worker = FakeWorker()
    keeper = lease_keeper(tmp_path, store_url, worker)

    keeper.tick()
    assert [job.record.id for job in worker.submitted] == [usable]
    assert keeper.registry.counters["takeovers"] == 1
    failed = keeper.registry.get(unusable)
    assert failed is not None and failed.status == "failed" and failed.reason_code == "invalid_option", failed
    assert backend.children("pending") == [usable], "a failed document is no longer pending"

    keeper.tick()  # nothing is claimed again
    assert len(worker.submitted) == 1 and keeper.registry.counters["takeovers"] == 1


def test_a_document_whose_reader_died_is_taken_over(
    random_engine: InfoKVEngine, tmp_path: Path, store_url: str
) -> None:
    backend = open_backend(store_url)
    doc_id = new_document_id()
    put_orphan(backend, doc_id)

    with TestClient(create_app(settings_for(tmp_path, store_url, lease_seconds=1), engine=random_engine)) as client:
        info = wait_settled(client, doc_id, A, timeout=60)
        assert info["status"] == "ready", info
        assert server_counters(client)["takeovers"] == 1 and server_counters(client)["prefills"] == 1
        assert client.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A).status_code == 200
    assert backend.children("pending") == [], "a ready document is no longer pending"


def test_a_delete_stays_deleted_whatever_a_reader_writes_after_it(
    random_engine: InfoKVEngine, tmp_path: Path, store_url: str
) -> None:
    """A process deletes a document that another process is still reading. The reader writes after the
    delete: a lease renewal, then the finished cache and record. None of it may bring the document back."""
    backend = open_backend(store_url)
    reader = StoreRegistry(backend, tmp_path / "reader", loaded_documents=2, lease_seconds=30)
    deleter = StoreRegistry(open_backend(store_url), tmp_path / "deleter", loaded_documents=2, lease_seconds=30)
    document = document_from_text(SECRET.decode())
    now = time.time()
    records = [
        DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
        for _ in range(2)
    ]
    for record in records:
        reader.create(record, document)
        found = deleter.get(record.id)
        assert found is not None and found.status == "processing"
        deleter.delete(found)
    renewed, finished = records

    def stored() -> set[str]:  # of these two (the store may hold other tests' documents)
        return {record.id for record in records} & set(backend.children("documents"))

    assert stored() == set()

    reader.renew(renewed)  # would have written the record back
    assert renewed.deleted and not reader.update(renewed, status="failed")

    compressed = random_engine.ingest_document(document, CompressionConfig(method="snapkv", keep=0.5))
    assert not finished.deleted, "this process has not seen the delete"
    assert not reader.finish(finished, compressed), "its write found the delete"
    assert finished.deleted and stored() == set(), "and it took away what it wrote"
    for registry in (reader, deleter):
        assert registry.get(finished.id) is None and finished.id not in {r.id for r in registry.list()}

    # A writer killed between its write and its look for a tombstone: the record it left reads as gone
    # (and goes).
    backend.put(f"documents/{finished.id}", "meta.json", json.dumps(finished.to_meta()).encode())
    assert deleter.get(finished.id) is None and stored() == set()

    # A writer killed between publishing the cache (`finish` saves it before the record) and writing the record:
    # no record, so nothing would ever look for the tombstone. The next listing anywhere removes the cache.
    reader._save_cache(finished.id, compressed)
    assert stored() == {finished.id}
    assert finished.id not in {r.id for r in StoreRegistry(backend, tmp_path / "third", 2, 30).list()}
    assert stored() == set()


def test_a_renewal_that_meets_a_delete_finds_it_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete elsewhere removes the document while this process renews its lease, so the write fails (its
    directory is gone): the renewal finds the tombstone and the record reads as deleted, no error."""
    store_url = f"file://{tmp_path}/store"
    reader = StoreRegistry(open_backend(store_url), tmp_path / "reader", loaded_documents=2, lease_seconds=30)
    deleter = StoreRegistry(open_backend(store_url), tmp_path / "deleter", loaded_documents=2, lease_seconds=30)
    now = time.time()
    record = DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
    reader.create(record, document_from_text(SECRET.decode()))

    def put_meeting_a_delete(key: str, name: str, data: bytes) -> None:
        found = deleter.get(record.id)
        assert found is not None
        deleter.delete(found)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", f"{key}/{name}")

    monkeypatch.setattr(reader.backend, "put", put_meeting_a_delete)
    reader.renew(record)
    assert record.deleted and not reader.update(record, status="failed")
    assert record.id not in reader.backend.children("documents") + reader.backend.children("pending")


def test_a_failed_renewal_stops_neither_the_other_renewals_nor_the_takeovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store_url = f"file://{tmp_path}/store"
    orphan = new_document_id()
    put_orphan(open_backend(store_url), orphan)
    now = time.time()
    refused, renewed = (
        DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
        for _ in range(2)
    )
    worker = FakeWorker(reading=[refused.id, renewed.id])
    keeper = lease_keeper(tmp_path, store_url, worker)
    backend = keeper.registry.backend
    for record in (refused, renewed):
        keeper.registry.create(record, document_from_text(SECRET.decode()))

    def lease_until(doc_id: str) -> float:
        return float(json.loads(backend.get(f"documents/{doc_id}", "meta.json"))["lease"]["until"])

    written = lease_until(renewed.id)
    real_put = backend.put

    def put_refusing_one(key: str, name: str, data: bytes) -> None:
        if refused.id in key:
            raise OSError(errno.EIO, "Input/output error", key)
        real_put(key, name, data)

    monkeypatch.setattr(backend, "put", put_refusing_one)
    time.sleep(0.01)
    keeper.tick()
    assert lease_until(renewed.id) > written, "the renewal after the refused one was made"
    assert [job.record.id for job in worker.submitted] == [orphan], "and the takeover too"


def test_malformed_records_in_the_store_are_passed_over(tmp_path: Path, store_url: str) -> None:
    """A record that another version or a broken writer left malformed fails neither the listing (every
    tenant's), nor a replica's start, nor the takeover of the other documents."""
    backend = open_backend(store_url)
    registry = StoreRegistry(backend, tmp_path / "replica", loaded_documents=2, lease_seconds=30)
    document = document_from_text(SECRET.decode())
    now = time.time()
    good = DocumentRecord(new_document_id(), "memo.txt", "ready", "tenantA", "snapkv", 0.5, now, now)
    registry.create(good, document)
    stale = DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
    registry.create(stale, document)
    meta = json.loads(backend.get(f"documents/{stale.id}", "meta.json"))
    meta["lease"]["until"] = now - 1  # its reader died
    backend.put(f"documents/{stale.id}", "meta.json", json.dumps(meta).encode())
    malformed = set()
    for broken in (
        {"owner": "tenantB"},  # fields missing
        {**good.to_meta(), "created_at": None},
        {**good.to_meta(), "status": "exploded"},
        {**good.to_meta(), "status": "processing", "lease": None},  # a record, only its lease is malformed
        {**good.to_meta(), "filename": None},  # one field of the wrong type: the listing's schema would refuse it
    ):
        doc_id = new_document_id()
        backend.put(f"documents/{doc_id}", "meta.json", json.dumps({**broken, "id": doc_id}).encode())
        backend.put(f"pending/{doc_id}", "lease", b"")
        if "lease" not in broken:
            malformed.add(doc_id)
    fresh = StoreRegistry(open_backend(store_url), tmp_path / "other", loaded_documents=2, lease_seconds=30)
    fresh.open()  # a replica starts
    listed = {record.id for record in fresh.list()}
    assert listed >= {good.id, stale.id} and not listed & malformed
    assert fresh.counts()["ready"] >= 1
    # The expired one is taken over (and so is the one without a lease, which no reader holds).
    assert stale.id in {record.id for record in fresh.claim_expired(set())}


def test_a_store_refuses_cache_sharing_and_an_unusable_store(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="share_caches"):
        settings_for(tmp_path, f"file://{tmp_path}/store", share_caches=True)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ConfigError, match="store"):
        create_app(settings_for(tmp_path, f"file://{tmp_path}/file/store"))


def test_an_unknown_id_costs_the_store_what_another_tenants_costs(tmp_path: Path, store_url: str) -> None:
    """The time of a 404 must not tell an id that exists (another tenant's) from one that never did: with a
    store, that time is the number of requests a lookup makes."""
    registry = StoreRegistry(open_backend(store_url), tmp_path / "replica", loaded_documents=2, lease_seconds=30)
    now = time.time()
    stored = DocumentRecord(new_document_id(), "memo.txt", "ready", "tenantA", "snapkv", 0.5, now, now)
    registry.create(stored, document_from_text(SECRET.decode()))
    reads: list[str] = []
    real_get = registry.backend.get

    def counted_get(key: str, name: str) -> bytes:
        reads.append(name)
        return real_get(key, name)

    registry.backend.get = counted_get  # type: ignore[method-assign]
    costs = []
    for doc_id in (stored.id, new_document_id()):
        reads.clear()
        registry.get(doc_id)
        costs.append(len(reads))
    assert costs[0] == costs[1], costs


def replica(tmp_path: Path, name: str, lease_seconds: float = 30) -> StoreRegistry:
    """One process's registry of the file:// store under `tmp_path` (each with its own backend object)."""
    store = open_backend(f"file://{tmp_path}/store")
    return StoreRegistry(store, tmp_path / name, loaded_documents=2, lease_seconds=lease_seconds)


def test_staging_directories_of_killed_processes_are_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    """Each process stages uploads in its own directory: one a killed process left (an upload half received in it)
    stayed for ever, and a clean stop left its empty directory; a live process's is never removed."""
    live = replica(tmp_path, "staging-live")
    live.check_writable()
    live.open()
    (live.uploads_dir / "receiving.pdf").write_bytes(b"%PDF-1.4 half")
    killed = tmp_path / "staging-killed" / "uploads" / "upload-1"
    killed.mkdir(parents=True)
    (killed / "big.pdf").write_bytes(b"%PDF-1.4 half")
    users = tmp_path / "notes"  # not a staging directory: never looked at
    users.mkdir()
    starting = replica(tmp_path, "staging-new")
    starting.check_writable()
    starting.open()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "staging-live", "staging-new", "store"]
    assert (live.uploads_dir / "receiving.pdf").exists()
    starting.close()
    live.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "store"]


def new_record(status: Literal["queued", "ready"]) -> DocumentRecord:
    now = time.time()
    return DocumentRecord(new_document_id(), "memo.txt", status, "tenantA", "snapkv", 0.5, now, now)


@pytest.mark.parametrize("read_again", [False, True], ids=["new upload", "ready document read again"])
def test_a_takeover_scan_between_a_pending_mark_and_its_record_leaves_the_mark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, read_again: bool
) -> None:
    """Another process scans for takeovers while a writer is between its pending mark and its record: it finds no
    record, or the ready one. It must leave the mark, or the document, acknowledged as queued, is never taken over
    once its writer dies before renewing its lease."""
    writer, scanner = replica(tmp_path, "writer", lease_seconds=1), replica(tmp_path, "scanner", lease_seconds=1)
    document = document_from_text(SECRET.decode())
    record = new_record("ready" if read_again else "queued")
    if read_again:
        writer.create(record, document)
    real_put = writer.backend.put

    def put_then_scan(key: str, name: str, data: bytes) -> None:
        real_put(key, name, data)
        if key.startswith("pending/"):
            assert scanner.claim_expired(set()) == []

    monkeypatch.setattr(writer.backend, "put", put_then_scan)
    if read_again:
        assert writer.update(record, if_status="ready", status="queued")
    else:
        writer.create(record, document)
    monkeypatch.undo()
    assert writer.backend.children("pending") == [record.id]

    time.sleep(1.1)  # the writer died: its lease runs out unrenewed
    assert [taken.id for taken in scanner.claim_expired(set())] == [record.id]


def test_a_stale_mark_removed_as_its_document_is_read_again_is_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed between a ready record and removing its mark left the mark. A scan removes it just as the
    document is read again, the new mark and queued record written after the scan looked at them: the scan puts the
    mark back, so the document is still taken over if its new reader dies."""
    writer, scanner = replica(tmp_path, "writer"), replica(tmp_path, "scanner")
    record = new_record("ready")
    writer.create(record, document_from_text(SECRET.decode()))
    writer.backend.put(f"pending/{record.id}", "lease", json.dumps({"until": time.time() - 1}).encode())
    real_remove = scanner.backend.remove

    def read_again_then_remove(key: str, last: str) -> None:
        if key.startswith("pending/"):
            assert writer.update(record, if_status="ready", status="queued")
        real_remove(key, last)

    monkeypatch.setattr(scanner.backend, "remove", read_again_then_remove)
    assert scanner.claim_expired(set()) == []
    monkeypatch.undo()
    assert scanner.backend.children("pending") == [record.id]


def test_a_store_that_cannot_tell_of_a_delete_serves_nothing_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Process 2 holds a document in memory that process 1 deletes; then the store fails to say whether there is a
    tombstone (throttled: an OSError other than not found). A read of the document or a question about it is
    refused (503 `storage_error`) and its cache in memory is dropped, never answered from memory."""
    deleter, holder = replica(tmp_path, "deleter"), replica(tmp_path, "holder")
    record = new_record("ready")
    deleter.create(record, document_from_text(SECRET.decode()))
    held = holder.get(record.id)
    assert held is not None
    loaded_cache = cast(CompressedDocument, object())
    holder.remember_loaded(held, loaded_cache, "store")
    found = deleter.get(record.id)
    assert found is not None
    deleter.delete(found)
    real_get = holder.backend.get

    def get_throttled(key: str, name: str) -> bytes:
        if key.startswith("deleted/"):
            raise OSError(errno.EIO, "Service Unavailable (SlowDown)", key)
        return real_get(key, name)

    monkeypatch.setattr(holder.backend, "get", get_throttled)
    with pytest.raises(StorageError) as refused:  # a read of the document, and every question, starts with this
        holder.get(record.id)
    assert refused.value.status == 503 and refused.value.code == "storage_error", refused.value.message
    assert holder.loaded(record.id) is None
    holder.remember_loaded(held, loaded_cache, "store")
    with pytest.raises(StorageError) as refused:  # a question about to start ends with it (the worker's first turn)
        holder.confirm_listed(held)
    assert refused.value.status == 503 and holder.loaded(record.id) is None
    monkeypatch.undo()
    assert holder.get(record.id) is None


def test_a_question_whose_store_cannot_tell_of_a_delete_is_a_503_to_retry(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store fails between the route finding the document and the answer's first turn: the answer does not start,
    and the client is told to retry (503 `storage_error`), not that the document is gone (404)."""
    app = create_app(settings_for(tmp_path, f"file://{tmp_path}/store"), engine=random_engine)
    with TestClient(app) as client:
        doc_id = upload_ready(client, A, "memo.txt", SECRET)
        registry = app.state.service.registry

        def unreadable(record: DocumentRecord) -> bool:
            raise StoreUnreadable(OSError(errno.EIO, "Service Unavailable (SlowDown)"))

        monkeypatch.setattr(registry, "confirm_listed", unreadable)
        assert_error(client.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A), 503, "storage_error")
        monkeypatch.undo()
        assert client.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A).status_code == 200


def test_an_incomplete_delete_in_a_store_says_what_it_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete whose removal fails answers 507, saying what is true with a store: its tombstone already hides the
    document (not listed; GET and DELETE answer 404), and a later listing removes what is left of it."""
    registry = replica(tmp_path, "replica")
    record = new_record("ready")
    registry.create(record, document_from_text(SECRET.decode()))
    real_remove = registry.backend.remove

    def remove_refused(key: str, last: str) -> None:
        if key.startswith("documents/"):
            raise PermissionError(errno.EACCES, "Access Denied", key)
        real_remove(key, last)

    monkeypatch.setattr(registry.backend, "remove", remove_refused)
    with pytest.raises(StorageError, match="deleted all the same") as refused:
        registry.delete(record)
    assert refused.value.status == 507 and "delete_incomplete" not in refused.value.message
    assert registry.get(record.id) is None and record.id not in {listed.id for listed in registry.list()}
    assert registry.backend.children("documents") == [record.id]
    monkeypatch.undo()
    registry.list()
    assert registry.backend.children("documents") == []


def _failing_once(backend: Any, ending: str, error: OSError) -> dict[str, int]:
    """Makes `backend`'s next read of a path ending in `ending` fail with `error`, once; counts the failures left."""
    read, left = backend.fs.cat_file, {"failures": 1}

    def flaky(path: str, *args: Any, **kwargs: Any) -> Any:
        if path.endswith(ending) and left["failures"]:
            left["failures"] -= 1
            raise error
        return read(path, *args, **kwargs)

    backend.fs.cat_file = flaky
    return left


def test_a_store_that_fails_a_read_once_takes_no_document_offline(
    random_engine: InfoKVEngine, second_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """One read error (an S3 SlowDown, a reset connection) while a replica loaded a cache was taken for damage: the
    document was read again (409 cache_rebuilding), queued and unanswerable on every replica until a prefill ended.
    It is a 503 to retry, nothing changed; only a cache that is missing or damaged is read again."""
    store = f"file://{tmp_path}/store"
    with (
        TestClient(create_app(settings_for(tmp_path / "a", store), engine=random_engine)) as first,
        TestClient(create_app(settings_for(tmp_path / "b", store), engine=second_engine)) as second,
    ):
        doc_id = upload_ready(first, A, "memo.txt", SECRET)
        expected = first.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A).json()["answer"]
        backend = second.app.state.service.registry.backend  # type: ignore[attr-defined]
        _failing_once(backend, "tensors.safetensors", OSError(errno.EIO, "SlowDown (simulated)"))
        refused = second.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A)
        assert_error(refused, 503, "storage_error")
        assert refused.headers.get("retry-after") and "read the document's cache from its store" in refused.text
        assert first.get(f"/v1/documents/{doc_id}", headers=A).json()["status"] == "ready"
        assert second.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A).json()["answer"] == expected
        assert server_counters(second)["prefills"] == 0


def test_a_sweep_that_fails_after_a_publish_fails_no_document(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """Removing the versions a publish replaced is best effort: its read error, after CURRENT had moved to a whole
    cache, failed the document ("the cache could not be saved")."""
    with TestClient(create_app(settings_for(tmp_path, f"file://{tmp_path}/store"), engine=random_engine)) as client:
        backend = client.app.state.service.registry.backend  # type: ignore[attr-defined]
        children = backend.children
        failures = {"left": 1}

        def flaky_children(prefix: str) -> list[str]:
            if prefix.endswith("/cache") and failures["left"]:
                failures["left"] -= 1
                raise OSError(errno.ECONNRESET, "connection reset (simulated)")
            return children(prefix)

        backend.children = flaky_children
        doc_id = upload_ready(client, A, "memo.txt", SECRET)
        assert failures["left"] == 0, "the sweep ran"
        assert client.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A).status_code == 200


def test_a_document_its_first_reader_finished_after_a_takeover_is_not_read_again(tmp_path: Path) -> None:
    """A reader whose lease renewals failed for a while, alive all along, finished the document after another
    replica took it over: that replica still read it again when its turn came, setting the ready document back
    to processing (every replica answering 409 for a prefill). It looks at the store first."""
    backend = open_backend(f"file://{tmp_path}/store")
    first = StoreRegistry(backend, tmp_path / "first", loaded_documents=2, lease_seconds=30)
    second = StoreRegistry(backend, tmp_path / "second", loaded_documents=2, lease_seconds=30)
    now = time.time()
    record = DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
    first.create(record, document_from_text(SECRET.decode()))
    taken = second.get(record.id)
    assert taken is not None and second.update(taken, status="queued")  # the takeover, its lease now second's
    assert second.still_to_read(taken)
    assert first.update(record, status="ready")  # the first reader ends (its cache published)
    assert not second.still_to_read(taken) and taken.status == "ready"
    first.delete(record)
    assert not second.still_to_read(taken)


@pytest.mark.parametrize(("shared", "missing"), [(True, False), (False, False), (True, True)])
def test_a_store_that_fails_reading_an_uploads_text_leaves_it_to_be_read_again(
    random_engine: InfoKVEngine, tmp_path: Path, shared: bool, missing: bool
) -> None:
    """The saved text unreadable for a moment (read for a takeover, a restart, a lost cache) failed the document for
    good as an internal error, its text whole in the store. With a shared store it is left pending, read again once
    its lease runs out; a local disk has no takeovers: it fails as the storage's error. A text that is gone fails
    the document as unreadable (left to the lease, it was taken over again and again for good)."""
    settings = settings_for(tmp_path, f"file://{tmp_path}/store", lease_seconds=2)
    if not shared:
        settings = settings.with_(store=None)
    with TestClient(create_app(settings, engine=random_engine)) as client:
        registry = client.app.state.service.registry  # type: ignore[attr-defined]
        read_document = registry.read_document
        failures = {"left": 1}

        def flaky(record: DocumentRecord) -> Any:
            if failures["left"]:
                failures["left"] -= 1
                if missing:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory")
                raise OSError(errno.ECONNRESET, "connection reset (simulated)")
            return read_document(record)

        registry.read_document = flaky
        doc_id = upload_ready(client, A, "memo.txt", SECRET)
        registry.forget_loaded(doc_id)
        record = registry.get(doc_id)
        assert registry.update(record, if_status="ready", status="queued")  # as a lost cache is read again
        client.app.state.service.worker.read_again(record)  # type: ignore[attr-defined]
        info = wait_settled(client, doc_id, A)
        assert failures["left"] == 0
        if missing:
            assert (info["status"], info["reason_code"]) == ("failed", "unreadable_document"), info
        elif shared:
            assert info["status"] == "ready", info
        else:
            assert (info["status"], info["reason_code"]) == ("failed", "storage_error"), info
            assert "storage failed while this document was read" in info["reason"]


# Pinned by a mutation review ----------------------------------------------------------------------------------------


def test_a_lapsed_lease_of_a_document_read_here_is_not_taken_over_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal the store refused once lets this process's own lease lapse: its takeover scan must pass over the
    document it is reading (claimed, it went back to queued and was read a second time here)."""
    now = time.time()
    record = DocumentRecord(new_document_id(), "memo.txt", "processing", "tenantA", "snapkv", 0.5, now, now)
    worker = FakeWorker(reading=[record.id])
    keeper = lease_keeper(tmp_path, f"file://{tmp_path}/store", worker)
    keeper.registry.lease_seconds = 0.05
    keeper.registry.create(record, document_from_text(SECRET.decode()))
    backend = keeper.registry.backend
    put = backend.put
    refused: list[str] = []

    def refusing_once(key: str, name: str, data: bytes) -> None:
        if record.id in key and name == "meta.json" and not refused:
            refused.append(key)
            raise OSError(errno.EIO, "Input/output error", key)
        put(key, name, data)

    time.sleep(0.2)  # the lease has lapsed
    monkeypatch.setattr(backend, "put", refusing_once)
    with contextlib.suppress(OSError):
        keeper.tick()
    assert refused and worker.submitted == [] and record.status == "processing"


def test_a_claim_another_process_overwrote_is_not_won(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Of two processes claiming one expired lease, only the last claimer reads the document again."""
    url = f"file://{tmp_path}/store"
    doc_id = new_document_id()
    put_orphan(open_backend(url), doc_id)
    first = StoreRegistry(open_backend(url), tmp_path / "one", loaded_documents=2, lease_seconds=30)
    second = StoreRegistry(open_backend(url), tmp_path / "two", loaded_documents=2, lease_seconds=30)
    sleep = time.sleep

    def second_claims_meanwhile(seconds: float) -> None:  # while `first` waits for its claim to settle
        monkeypatch.setattr(shared_registry.time, "sleep", sleep)
        record = second.get(doc_id)
        assert record is not None and second.update(record, status="queued")

    monkeypatch.setattr(shared_registry.time, "sleep", second_claims_meanwhile)
    assert first.claim_expired(set()) == []


def test_a_record_that_names_another_document_is_passed_over(tmp_path: Path) -> None:
    """A record copied under documents/X that names document Y is no record of X's: read as X's, a DELETE of X
    deleted Y."""
    url = f"file://{tmp_path}/store"
    registry = StoreRegistry(open_backend(url), tmp_path / "one", loaded_documents=2, lease_seconds=30)
    now = time.time()
    named = DocumentRecord(new_document_id(), "memo.txt", "failed", "tenantA", "snapkv", 0.5, now, now)
    registry.create(named, document_from_text(SECRET.decode()))
    copied = new_document_id()
    registry.backend.put(f"documents/{copied}", "meta.json", registry.backend.get(f"documents/{named.id}", "meta.json"))
    other = StoreRegistry(open_backend(url), tmp_path / "two", loaded_documents=2, lease_seconds=30)
    assert other.get(copied) is None and other.get(named.id) is not None


def test_a_version_replaced_by_another_keys_cache_is_not_loaded(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """A version whose files were replaced whole by another key's valid cache is not what CURRENT published."""
    backend = open_backend(f"file://{tmp_path}/store")
    for key, keep in (("a", 0.25), ("b", 0.5)):
        backend.publish(
            f"documents/{key}", random_engine.ingest_text(f"{key} {SECRET.decode()}", CompressionConfig(keep=keep))
        )
    version = {key: json.loads(backend.get(f"documents/{key}/{CACHE}", CURRENT))["version"] for key in "ab"}
    replaced, source = (tmp_path / "store/documents" / key / CACHE / version[key] for key in "ab")
    for path in replaced.iterdir():
        path.unlink()
    for path in source.iterdir():
        (replaced / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CacheStoreError, match="not the one published"):
        backend.load(random_engine, "documents/a")
