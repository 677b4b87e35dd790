"""Service pieces without the real model: settings, auth, ids, names, the fair lock, and the app in-process."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import stat
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from infokv_rag.documents import document_from_text  # noqa: E402
from infokv_rag.errors import ConfigError  # noqa: E402
from infokv_rag.service.answers import sse  # noqa: E402
from infokv_rag.service.errors import ServiceError  # noqa: E402
from infokv_rag.service.launcher import read_sse  # noqa: E402
from infokv_rag.service.registry import (  # noqa: E402
    DocumentRecord,
    Registry,
    new_document_id,
    valid_document_id,
)
from infokv_rag.service.scheduling import FairLock  # noqa: E402
from infokv_rag.service.settings import Settings  # noqa: E402
from infokv_rag.service.tenants import KeyRing  # noqa: E402
from infokv_rag.service.uploads import _arriving, display_name  # noqa: E402


def test_settings_from_env_and_refusal_without_keys(tmp_path: Path) -> None:
    env = {
        "INFOKV_API_KEYS": " key-one-12345 ,key-two-67890,, ",
        "INFOKV_MAX_UPLOAD_BYTES": "1000",
        "INFOKV_DEFAULT_KEEP": "512",
        "INFOKV_DATA_DIR": str(tmp_path),
    }
    settings = Settings.from_env(env, model="tiny")
    assert settings.api_keys == ("key-one-12345", "key-two-67890")
    assert settings.max_upload_bytes == 1000 and settings.default_keep == 512 and settings.data_dir == tmp_path
    assert settings.model == "tiny" and settings.auth_required
    settings.check_startable()

    with pytest.raises(ConfigError, match="refusing to start without API keys"):
        Settings.from_env({}, data_dir=tmp_path).check_startable()
    Settings.from_env({"INFOKV_ALLOW_ANONYMOUS": "1"}, data_dir=tmp_path).check_startable()
    with pytest.raises(ConfigError, match="INFOKV_ALLOW_ANONYMOUS"):
        Settings.from_env({"INFOKV_ALLOW_ANONYMOUS": "maybe"})
    with pytest.raises(ConfigError, match="at least 8"):
        Settings(api_keys=("short",))
    with pytest.raises(ConfigError, match="INFOKV_MAX_PAGES must be an integer"):
        Settings.from_env({"INFOKV_MAX_PAGES": "many"})
    with pytest.raises(ConfigError, match="INFOKV_DEFAULT_KEEP 1 is a count of one token.*write 1.0"):
        Settings.from_env({"INFOKV_DEFAULT_KEEP": "1"})
    assert Settings.from_env({"INFOKV_DEFAULT_KEEP": "1.0"}).default_keep == 1.0
    # Set to nothing (a compose file's `INFOKV_DATA_DIR=`) is unset: not the directory the server starts in.
    blank = Settings.from_env({"INFOKV_DATA_DIR": "", "INFOKV_DEFAULT_KEEP": " "})
    assert blank.data_dir == Settings().data_dir != Path(".") and blank.default_keep == Settings().default_keep


def test_tenant_shares_default_to_half_of_each_queue_and_never_exceed_it() -> None:
    defaults = Settings()
    assert (defaults.upload_share, defaults.generation_share) == (8, 36)  # 16 uploads; 8 active + 64 queued
    # Unset, a share follows its queue (rounded up: a queue of one place still takes one).
    assert Settings(max_queued_uploads=5).upload_share == 3 and defaults.with_(max_queued_uploads=1).upload_share == 1
    env = {"INFOKV_MAX_QUEUED_UPLOADS_PER_TENANT": "3", "INFOKV_MAX_GENERATIONS_PER_TENANT": ""}
    settings = Settings.from_env(env)
    assert (settings.upload_share, settings.max_generations_per_tenant, settings.generation_share) == (3, None, 36)
    # Equal to the queue: no share. Above it: refused, saying what the whole server holds.
    assert Settings(max_generations_per_tenant=72).generation_share == 72
    with pytest.raises(ConfigError, match=r"max_generations_per_tenant is 73, more than the 72 the whole server"):
        Settings(max_generations_per_tenant=73)
    with pytest.raises(ConfigError, match=r"max_queued_uploads_per_tenant is 5, more than the 4 .*max_queued_uploads"):
        Settings.from_env({"INFOKV_MAX_QUEUED_UPLOADS": "4", "INFOKV_MAX_QUEUED_UPLOADS_PER_TENANT": "5"})
    with pytest.raises(ConfigError, match="max_queued_uploads_per_tenant must be positive"):
        Settings(max_queued_uploads_per_tenant=0)
    with pytest.raises(ConfigError, match="INFOKV_MAX_GENERATIONS_PER_TENANT must be an integer"):
        Settings.from_env({"INFOKV_MAX_GENERATIONS_PER_TENANT": "half"})
    # Upload defaults that make no compression were accepted, then refused every upload as the client's 422 (and
    # failed for good a document read again after a restart).
    for variable, value, refusal in (
        ("INFOKV_INGEST_CHUNK_SIZE", "16", r"chunk_size \(16\) must be at least the window"),
        ("INFOKV_DEFAULT_METHOD", "nosuchmethod", "unknown method 'nosuchmethod'"),
    ):
        with pytest.raises(ConfigError, match=f"make no compression an upload can use: {refusal}"):
            Settings.from_env({variable: value, "INFOKV_ALLOW_ANONYMOUS": "1"})


def test_create_app_refuses_to_start_unprotected(tmp_path: Path) -> None:
    from infokv_rag.service.app import create_app

    with pytest.raises(ConfigError, match="refusing to start"):
        create_app(Settings(data_dir=tmp_path))


def test_key_matching_is_exact() -> None:
    ring = KeyRing.from_entries(["alpha-key-123", "beta-key-4567"])
    assert ring.find("alpha-key-123") and ring.find("beta-key-4567")
    for wrong in ("", "alpha-key-12", "alpha-key-1234", "ALPHA-KEY-123", "beta-key-4567 ", "ключ"):
        assert ring.find(wrong) is None
    assert KeyRing([]).find("anything") is None


def test_document_ids_are_random_and_never_paths(tmp_path: Path) -> None:
    ids = {new_document_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(valid_document_id(i) for i in ids)
    for bad in (
        "",
        "..",
        "doc_",
        "doc_../../../etc/passwd",
        "doc_" + "a" * 21,
        "doc_" + "a" * 23,
        "doc_aaaaaaaaaaaaaaaaaaaaa/",
        "DOC_aaaaaaaaaaaaaaaaaaaaaa",
        "doc_aaaaaaaaaaaaaaaaaaaa\n",
    ):
        assert not valid_document_id(bad), bad
    registry = Registry(tmp_path)
    with pytest.raises(ValueError):
        registry.directory("../outside")
    assert registry.get("../outside") is None


def test_an_upload_and_a_delete_are_durable_before_they_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload is answered (202) once its directory's entry in documents/ and the files in it are synced to disk,
    a delete (200) once its rename aside and its removal are: a power loss after the answer cannot undo either."""
    registry = Registry(tmp_path)
    registry.open()
    synced: list[tuple[int, int]] = []  # the directories synced, as (device, inode)
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        real_fsync(descriptor)
        status = os.fstat(descriptor)
        if stat.S_ISDIR(status.st_mode):
            synced.append((status.st_dev, status.st_ino))

    def identity(path: Path) -> tuple[int, int]:
        status = path.stat()
        return status.st_dev, status.st_ino

    monkeypatch.setattr(os, "fsync", recording_fsync)
    now = time.time()
    record = DocumentRecord(new_document_id(), "memo.txt", "queued", "tenantA", "snapkv", 0.5, now, now)
    registry.create(record, document_from_text("The notice period is ninety days."))
    documents, directory = identity(registry.documents_dir), identity(registry.directory(record.id))
    # documents/ for the new directory, then the directory for document.json, then for meta.json.
    assert synced == [documents, directory, directory], synced
    synced.clear()
    registry.delete(record)
    assert synced == [documents, documents], synced  # after the rename aside, and after the removal
    assert list(registry.documents_dir.iterdir()) == []


MALFORMED_FIELDS = [
    ("filename", None),
    ("owner", 7),
    ("sha256", ["ab"]),
    ("saved_text_sha256", 5),
    ("status", "exploded"),
    ("method", ""),
    ("method", None),
    ("keep", 0),
    ("keep", "0.5"),
    ("keep", True),
    ("recall", -1),
    ("cold_bits", 4.0),
    ("created_at", None),
    ("updated_at", float("inf")),
    ("size_bytes", "12"),
    ("pages", 1.5),
    ("skipped_pages", [1, "2"]),
    ("skipped_pages", None),
    ("warnings", ["ok", 3]),
    ("warnings", "stray bytes"),
    ("tokens", False),
    ("kept_tokens", "many"),
    ("compression_ratio", float("nan")),
    ("prefill_seconds", "fast"),
    ("reason", {"why": "no"}),
    ("reason_code", 3),
]


@pytest.mark.parametrize(("name", "value"), MALFORMED_FIELDS)
def test_a_record_with_a_malformed_field_is_refused_as_a_whole(name: str, value: object) -> None:
    """A record left by another version or a broken writer is refused (ValueError: logged and passed over),
    never listed to fail every listing that would show it."""
    now = time.time()
    good = DocumentRecord(new_document_id(), "memo.txt", "ready", "tenantA", "snapkv", 0.5, now, now).to_meta()
    assert DocumentRecord.from_meta({**good, "keep": 512, "created_at": int(now), "skipped_pages": [2]}).keep == 512
    with pytest.raises(ValueError, match="malformed"):
        DocumentRecord.from_meta({**good, name: value})


def test_a_record_saved_before_load_warnings_were_kept_loads_without_them() -> None:
    now = time.time()
    record = DocumentRecord(new_document_id(), "notes.txt", "ready", "tenantA", "snapkv", 0.5, now, now)
    record.warnings = ["notes.txt is UTF-8 but for 1 stray byte"]
    meta = record.to_meta()
    assert DocumentRecord.from_meta(meta).warnings == record.warnings
    del meta["warnings"]  # what a version without them wrote
    assert DocumentRecord.from_meta(meta).warnings == []


def test_display_names_are_one_safe_path_component() -> None:
    assert display_name("contract.pdf") == "contract.pdf"
    assert display_name("../../etc/passwd") == "passwd"
    assert display_name("C:\\Users\\me\\Q3 report (final).pdf") == "Q3 report (final).pdf"
    assert display_name("..") == "upload" and display_name(None) == "upload" and display_name("") == "upload"
    assert display_name("a\x00b\nc<script>.txt") == "a_b_c_script.txt"
    # Letters of any script are kept, and the suffix is kept whatever the stem loses.
    assert display_name("договор-1.txt") == "договор-1.txt" and display_name("契約書.pdf") == "契約書.pdf"
    for marked in ("नमस्ते.txt", "สัญญาเช่า.pdf", "عَقْد.pdf"):  # combining marks are part of the word
        assert display_name(marked) == marked
    assert display_name("x" * 1000 + ".pdf") == "x" * 116 + ".pdf"
    assert display_name("合" * 100 + ".pdf") == "合" * 38 + ".pdf"  # 120 bytes in UTF-8 at most
    assert display_name(".pdf") == "upload.pdf" and display_name("report.\u202epdf") == "report._pdf"


def test_event_stream_reader_reads_what_the_server_writes() -> None:
    stream = sse({"text": "hi"}, "token") + ": keep-alive\n\n" + sse("line one\nline two") + sse("[DONE]")
    assert list(read_sse(stream.split("\n"))) == [
        ("token", '{"text": "hi"}'),
        ("message", "line one\nline two"),
        ("message", "[DONE]"),
    ]


def test_fair_lock_is_reentrant_and_first_come_first_served() -> None:
    lock = FairLock()
    with lock:
        with lock:  # reentrant
            pass
    order: list[int] = []
    lock.acquire()
    threads = []

    def take_turn(i: int) -> None:
        lock.acquire()
        order.append(i)
        lock.release()

    for index in range(4):
        thread = threading.Thread(target=take_turn, args=(index,))
        thread.start()
        threads.append(thread)
        while lock.waiting < index + 1:
            time.sleep(0.001)
    lock.release()
    for thread in threads:
        thread.join(5)
    assert order == [0, 1, 2, 3]
    with pytest.raises(RuntimeError):
        lock.release()


def test_fair_lock_does_not_starve_a_waiter() -> None:
    """A thread re-taking the lock in a tight loop cannot keep a waiting thread out (a plain Lock can)."""
    lock = FairLock()
    stop = threading.Event()
    turns = {"greedy": 0, "other": 0}

    def greedy() -> None:
        while not stop.is_set():
            with lock:
                turns["greedy"] += 1
                time.sleep(0.002)

    def other() -> None:
        while not stop.is_set():
            with lock:
                turns["other"] += 1
                time.sleep(0.002)

    threads = [threading.Thread(target=greedy), threading.Thread(target=other)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(5)
    assert turns["other"] > 0.3 * turns["greedy"], turns


def test_anonymous_service_in_process(random_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The app factory with an injected engine: open when explicitly configured, upload, ask, stream."""
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app

    settings = Settings(
        allow_anonymous=True, data_dir=tmp_path, model="random", max_new_tokens=8, default_max_tokens=4, warmup=False
    )
    with TestClient(create_app(settings, engine=random_engine)) as client:
        assert client.get("/v1/documents").status_code == 200  # no key needed: anonymous was asked for
        text = "The supplier shall deliver the goods within thirty days of the order date. " * 3
        created = client.post("/v1/documents", files={"file": ("terms.txt", text.encode())}, data={"method": "snapkv"})
        assert created.status_code == 202, created.text
        doc_id = created.json()["id"]
        deadline = time.monotonic() + 60
        while (info := client.get(f"/v1/documents/{doc_id}").json())["status"] != "ready":
            assert info["status"] in ("queued", "processing") and time.monotonic() < deadline, info
            time.sleep(0.05)
        answer = client.post(f"/v1/documents/{doc_id}/ask", json={"question": "When?", "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["completion_tokens"] <= 4 and body["usage"]["cached_tokens"] == info["tokens"]
        with client.stream(
            "POST", f"/v1/documents/{doc_id}/ask", json={"question": "When?", "max_tokens": 4, "stream": True}
        ) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("event:")]
        assert lines[-1] == "event: done" and "event: token" in lines
        models = client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["random"]
        assert client.delete(f"/v1/documents/{doc_id}").status_code == 200
        assert not (tmp_path / "documents" / doc_id).exists()


def test_unexpected_errors_are_json_without_details(random_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app

    app = create_app(Settings(api_keys=("unit-test-key-1",), data_dir=tmp_path, warmup=False), engine=random_engine)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret detail at /srv/internal/path.py line 42")

    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
        assert response.status_code == 500
        assert response.json() == {
            "error": {
                "message": "internal server error",
                "type": "server_error",
                "code": "internal_error",
                "param": None,
            }
        }
        missing = client.get("/no/such/route")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        assert client.put("/healthz").json()["error"]["code"] == "method_not_allowed"


def test_a_body_over_the_limit_is_400_on_openais_route_and_413_elsewhere(random_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's clients raise BadRequestError for 400 only: its route answers 400 where the others answer 413, for
    a body refused from its Content-Length and one refused as it passes the limit (sent in chunks)."""
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app

    settings = Settings(allow_anonymous=True, data_dir=tmp_path, model="random", warmup=False)
    body = json.dumps({"model": "random", "messages": [{"role": "user", "content": "x" * settings.max_request_bytes}]})

    def chunks() -> Iterator[bytes]:
        data = body.encode()
        yield from (data[start : start + 65536] for start in range(0, len(data), 65536))

    with TestClient(create_app(settings, engine=random_engine)) as client:
        for path, status in (("/v1/chat/completions", 400), (f"/v1/documents/{new_document_id()}/ask", 413)):
            for content in (body, chunks()):
                response = client.post(path, content=content, headers={"content-type": "application/json"})
                assert response.status_code == status, (path, response.status_code, response.text)
                assert response.json()["error"]["code"] == "request_too_large"


def _ready_terms(client: Any) -> str:
    """The id of a short terms document uploaded through `client` (an open service), once it is ready."""
    text = "The supplier shall deliver the goods within thirty days of the order date. " * 3
    doc_id: str = client.post("/v1/documents", files={"file": ("terms.txt", text.encode())}).json()["id"]
    deadline = time.monotonic() + 60
    while client.get(f"/v1/documents/{doc_id}").json()["status"] != "ready":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return doc_id


def test_an_empty_question_is_refused_alike_on_both_routes(random_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Whitespace or control characters only is as empty as "": /ask answers 422 `empty_message` to both, the chat 400
    `empty_message` (its last user message is the question), before the document is read."""
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app

    settings = Settings(allow_anonymous=True, data_dir=tmp_path, model="random", warmup=False)
    with TestClient(create_app(settings, engine=random_engine)) as client:
        doc_id = _ready_terms(client)

        def chat(*contents: str) -> Any:
            roles = ("user", "assistant")
            messages = [{"role": roles[index % 2], "content": content} for index, content in enumerate(contents)]
            body = {"model": "random", "document_id": doc_id, "max_tokens": 2, "messages": messages}
            return client.post("/v1/chat/completions", json=body)

        for question in ("", "   ", "\n\t", "\x00", "\u200b"):
            asked = client.post(f"/v1/documents/{doc_id}/ask", json={"question": question, "max_tokens": 2})
            assert asked.status_code == 422 and asked.json()["error"]["code"] == "empty_message", asked.text
            assert asked.json()["error"]["param"] == "question"
        for blank in ("   ", "\n\t", "\x00", "\u200b"):
            for contents in ((blank,), ("When?", "Within thirty days.", blank)):
                refused = chat(*contents)
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["code"] == "empty_message" and f"messages[{len(contents) - 1}]" in error["message"]
        assert chat("").json()["error"]["code"] == "empty_message"  # as before: "" in any message
        # Only the question counts: an earlier blank user message is part of the conversation.
        assert chat("  ", "Yes.", "When?").status_code == 200
        answered = client.post(f"/v1/documents/{doc_id}/ask", json={"question": "When?", "max_tokens": 2})
        assert answered.status_code == 200, answered.text


def test_the_chat_stream_carries_usage_as_openais_does(random_engine, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With `stream_options.include_usage` every chunk but the last has `"usage": null` and the last (no choices)
    the counts; without it no chunk has the field; `stream_options` without a stream is a 400 naming it."""
    from fastapi.testclient import TestClient

    from infokv_rag.service.app import create_app

    settings = Settings(allow_anonymous=True, data_dir=tmp_path, model="random", warmup=False)
    with TestClient(create_app(settings, engine=random_engine)) as client:
        doc_id = _ready_terms(client)
        chat = {
            "model": "random",
            "document_id": doc_id,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "When?"}],
        }

        def chunks(**options: Any) -> list[dict[str, Any]]:
            with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True, **options}) as response:
                assert response.status_code == 200
                data = [payload for _, payload in read_sse(response.iter_lines())]
            assert data[-1] == "[DONE]"
            return [json.loads(payload) for payload in data[:-1]]

        *answer, last = chunks(stream_options={"include_usage": True})
        assert answer and all(chunk["usage"] is None and chunk["choices"] for chunk in answer)
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        assert all("usage" not in chunk for chunk in chunks())
        refused = client.post("/v1/chat/completions", json={**chat, "stream_options": {"include_usage": True}})
        assert refused.status_code == 400, refused.text
        assert (refused.json()["error"]["code"], refused.json()["error"]["param"]) == (
            "invalid_request",
            "stream_options",
        )
        assert client.post("/v1/chat/completions", json={**chat, "stream_options": None}).status_code == 200


def test_an_upload_arriving_as_the_server_stops_is_refused_whenever_the_stop_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """503 `cancelled` however the stop meets the body: before it, while a chunk is held, as its last read ends,
    after it; no task is left, and no read that ended is logged as an exception nobody retrieved."""
    timing = Settings.__new__(Settings)
    object.__setattr__(timing, "upload_idle_seconds", 5.0)
    object.__setattr__(timing, "max_upload_seconds", 10.0)

    async def body(stop: Callable[[], None], stop_at: int | None) -> AsyncGenerator[bytes, None]:
        for index in range(3):
            if index == stop_at:
                stop()
            yield b"x"
        if stop_at == 3:
            stop()  # inside the read that ends the body

    async def read(stop_at: int | None, held_at: int | None) -> tuple[str, int]:
        stopping = asyncio.Event()
        got = 0
        try:
            async for _ in _arriving(body(stopping.set, stop_at), timing, stopping):
                got += 1
                if got == held_at:
                    stopping.set()
        except ServiceError as exc:
            return exc.code, got
        return "whole", got

    async def every_case() -> list[tuple[str, int]]:
        outcomes = [await read(stop_at, None) for stop_at in (0, 1, 3)] + [await read(None, 2), await read(None, 3)]
        outcomes.append(await read(None, None))
        gc.collect()
        await asyncio.sleep(0.01)
        assert [task for task in asyncio.all_tasks() if task is not asyncio.current_task()] == []
        return outcomes

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        outcomes = asyncio.run(every_case())
    assert outcomes[:-1] == [("cancelled", 0), ("cancelled", 1), ("cancelled", 3), ("cancelled", 2), ("cancelled", 3)]
    assert outcomes[-1] == ("whole", 3) and "never retrieved" not in caplog.text
