"""The cold tier through the service (issue 13): upload options, per-question recall on /ask, its SSE stream
and the OpenAI route, sizes in the document's info, a restart, a lost cache and a shared store.

In-process on the random 3-layer model (`create_app(settings, engine=random_engine)` and a TestClient).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from infokv_rag import InfoKVEngine  # noqa: E402
from infokv_rag.service.app import create_app  # noqa: E402

from .conftest import CORPUS  # noqa: E402
from .service_helpers import (  # noqa: E402
    assert_error,
    bearer,
    random_model_settings,
    server_counters,
    upload,
    upload_ready,
    wait_queue,
    wait_settled,
)

KEY = "key-tenant-a-0001"
A = bearer(KEY)
# Long enough that every layer evicts more than the budgets asked for below.
LONG = " ".join(CORPUS * 6).encode()
LAYERS = 3


def running(engine: InfoKVEngine, data_dir: Path, **overrides: Any) -> TestClient:
    return TestClient(create_app(random_model_settings(data_dir, (f"tenantA:{KEY}",), **overrides), engine=engine))


@pytest.fixture
def client(random_engine: InfoKVEngine, tmp_path: Path) -> Iterator[TestClient]:
    with running(random_engine, tmp_path / "data") as http:
        yield http


def ask(client: TestClient, doc_id: str, **body: Any) -> Any:
    return client.post(
        f"/v1/documents/{doc_id}/ask",
        json={"question": "What is the notice period?", "max_tokens": 2, **body},
        headers=A,
    )


def recalled(response: Any) -> int:
    assert response.status_code == 200, response.text
    return int(response.json()["usage"]["recalled_tokens"])


def test_upload_with_recall_then_ask_json_sse_and_chat(client: TestClient) -> None:
    doc_id = upload_ready(client, A, "contract.txt", LONG, recall="0.1")
    info = client.get(f"/v1/documents/{doc_id}", headers=A).json()
    assert info["recall"] == 0.1 and info["cold_bits"] == 8, "left to the engine: 8 bits for its float32 cache"
    assert 0 < info["cache_bytes"] < info["full_cache_bytes"] and info["cold_bytes"] > 0

    by_default = recalled(ask(client, doc_id))  # the upload's recall
    assert by_default > 0
    assert recalled(ask(client, doc_id, recall=16)) == 16 * LAYERS
    assert recalled(ask(client, doc_id, recall=0)) == 0

    with client.stream(
        "POST",
        f"/v1/documents/{doc_id}/ask",
        json={"question": "Q?", "max_tokens": 2, "recall": 8, "stream": True},
        headers=A,
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(lines[-1].removeprefix("data: "))["usage"]["recalled_tokens"] == 8 * LAYERS

    chat = {"model": "random", "messages": [{"role": "user", "content": "Q?"}], "document_id": doc_id, "max_tokens": 2}
    completion = client.post("/v1/chat/completions", json={**chat, "recall": 4}, headers=A)
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["recalled_tokens"] == 4 * LAYERS


@pytest.mark.parametrize("store", [False, True])
def test_a_document_just_read_keeps_its_cold_tier_mapped_not_in_memory(
    random_engine: InfoKVEngine, tmp_path: Path, store: bool
) -> None:
    """The document an upload read stayed in memory as read: its cold tier (most of it) held in the process's
    memory until it left the cache of loaded documents, twice what the README says a recalling document holds. It
    is kept as the saved copy loaded back, its cold tier mapped from a file (a private copy for a shared store)."""
    if store:
        pytest.importorskip("fsspec", reason="the shared store needs the [scale] extra")
    options = {"store": f"file://{tmp_path}/store"} if store else {}
    with running(random_engine, tmp_path / "data", **options) as client:
        doc_id = upload_ready(client, A, "contract.txt", LONG, recall="0.1")
        registry = client.app.state.service.registry  # type: ignore[attr-defined]
        deadline = time.monotonic() + 30
        while (loaded := registry.loaded(doc_id)) is None:  # kept in memory just after it reads ready
            assert time.monotonic() < deadline, "never kept in memory"
            time.sleep(0.01)
        assert loaded.cold_tier is not None and loaded.cold_tier.source is not None
        assert client.get(f"/v1/documents/{doc_id}", headers=A).json()["cache_origin"] == "prefill"
        assert recalled(ask(client, doc_id)) > 0


def test_a_temporary_space_that_refuses_the_cold_tiers_copy_is_a_storage_error_not_a_damaged_cache(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cold tier loaded from a shared store is copied to TMPDIR: a full one was reported as a damaged cache, and
    the document read again (a prefill) over a good cache, each time it left memory."""
    pytest.importorskip("fsspec", reason="the shared store needs the [scale] extra")
    with running(random_engine, tmp_path / "data", store=f"file://{tmp_path}/store") as client:
        doc_id = upload_ready(client, A, "contract.txt", LONG, recall="0.1")
        expected = ask(client, doc_id).json()["answer"]
        registry = client.app.state.service.registry  # type: ignore[attr-defined]
        registry.forget_loaded(doc_id)
        prefills = server_counters(client)["prefills"]
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-directory"))
        refused = ask(client, doc_id)
        assert_error(refused, 507, "storage_error")
        assert "load the document's cache" in refused.json()["error"]["message"]
        monkeypatch.undo()
        assert client.get(f"/v1/documents/{doc_id}", headers=A).json()["status"] == "ready"
        assert ask(client, doc_id).json()["answer"] == expected
        assert server_counters(client)["prefills"] == prefills


def test_bad_recall_options_are_4xx(client: TestClient) -> None:
    # cold_bits 8 is a valid width, but without recall there is no cold tier to code.
    bad_fields = ({"recall": "1.5"}, {"recall": "-3"}, {"recall": "lots"}, {"cold_bits": "3"}, {"cold_bits": "x"})
    for fields in (*bad_fields, {"cold_bits": "8"}):
        assert_error(upload(client, A, "a.txt", LONG, **fields), 422, "invalid_option")
    assert_error(upload(client, A, "a.txt", LONG, method="full", recall="0.1"), 422, "invalid_option")

    plain = upload_ready(client, A, "plain.txt", LONG)
    info = client.get(f"/v1/documents/{plain}", headers=A).json()
    assert info["recall"] == 0 and info["cold_bits"] is None and info["cold_bytes"] == 0
    for bad in (1.5, -1, "lots"):
        assert_error(ask(client, plain, recall=bad), 422, "invalid_request")
    assert_error(ask(client, plain, recall=0.1), 422, "no_cold_tier")
    chat = {"model": "random", "messages": [{"role": "user", "content": "Q?"}], "document_id": plain, "recall": 8}
    assert_error(client.post("/v1/chat/completions", json=chat, headers=A), 400, "no_cold_tier")
    assert recalled(ask(client, plain, recall=0)) == 0


def test_a_restart_and_a_lost_cache_keep_the_cold_tier(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        doc_id = upload_ready(client, A, "contract.txt", LONG, recall="16")
        answer = ask(client, doc_id)
    with running(random_engine, data) as client:
        again = ask(client, doc_id)
        assert recalled(again) == 16 * LAYERS and again.json()["answer"] == answer.json()["answer"]
        health = server_counters(client)
        assert health["prefills"] == 0 and health["cache_loads"] == 1
    # A cache lost on disk is read again with the options of its upload, cold tier included.
    shutil.rmtree(data / "documents" / doc_id / "cache")
    with running(random_engine, data) as client:
        assert_error(ask(client, doc_id), 409, "cache_rebuilding")
        assert wait_settled(client, doc_id, A)["cold_bytes"] > 0
        rebuilt = ask(client, doc_id)
        assert recalled(rebuilt) == 16 * LAYERS and rebuilt.json()["answer"] == answer.json()["answer"]
    with running(random_engine, data) as client:
        assert ask(client, doc_id).json()["answer"] == answer.json()["answer"]  # loaded: its cold tier mapped
        # A cold tier written over in place while it is mapped is not read: the document is read again.
        time.sleep(0.05)  # file times tick coarsely: the change must come after the load's stamp
        with open(data / "documents" / doc_id / "cache" / "cold.safetensors", "r+b") as handle:
            handle.seek(-4096, 2)
            handle.write(bytes(4096))
        assert_error(ask(client, doc_id), 409, "cache_rebuilding")
        assert wait_settled(client, doc_id, A)["status"] == "ready"
        assert ask(client, doc_id).json()["answer"] == answer.json()["answer"]
        assert server_counters(client)["prefills"] == 1


def test_a_cold_tier_changed_while_its_question_waits_is_not_read(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """A question about a document with a cold tier waits behind another answer; meanwhile the cold tier is written
    over in place. When its turn comes, the question gets 409 `cache_rebuilding` (never an answer read through the
    changed map), and the document is read again."""
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        busy = upload_ready(client, A, "other.txt", LONG)
        doc_id = upload_ready(client, A, "contract.txt", LONG, recall="16")
    with running(random_engine, data, max_new_tokens=800, max_active_generations=1) as client:
        expected = ask(client, doc_id).json()["answer"]  # loaded from disk: its cold tier is mapped
        answers: dict[str, Any] = {}

        def ask_in_thread(name: str, doc: str, max_tokens: int) -> None:
            answers[name] = ask(client, doc, max_tokens=max_tokens)

        running_answer = threading.Thread(target=ask_in_thread, args=("busy", busy, 800))
        running_answer.start()
        wait_queue(client, active_generations=1)
        waiting = threading.Thread(target=ask_in_thread, args=("waiting", doc_id, 2))
        waiting.start()
        wait_queue(client, queued_generations=1)
        time.sleep(0.05)  # file times tick coarsely: the change must come after the load's stamp
        with open(data / "documents" / doc_id / "cache" / "cold.safetensors", "r+b") as handle:
            handle.seek(-4096, 2)
            handle.write(bytes(4096))
        assert client.delete(f"/v1/documents/{busy}", headers=A).status_code == 200  # the waiting one's turn
        running_answer.join()
        waiting.join()
        assert_error(answers["waiting"], 409, "cache_rebuilding")
        assert wait_settled(client, doc_id, A)["status"] == "ready"
        assert ask(client, doc_id).json()["answer"] == expected


def test_the_shared_store_publishes_and_loads_the_cold_tier(
    random_engine: InfoKVEngine, random_model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("fsspec", reason="the shared store needs the [scale] extra")
    store = f"file://{tmp_path}/store"
    second_engine = InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu")
    with running(random_engine, tmp_path / "a", store=store) as first:
        doc_id = upload_ready(first, A, "contract.txt", LONG, recall="16", cold_bits="8")
        reference = ask(first, doc_id)
    with running(second_engine, tmp_path / "b", store=store) as second:
        answer = ask(second, doc_id)
        assert recalled(answer) == 16 * LAYERS and answer.json()["answer"] == reference.json()["answer"]
        info = second.get(f"/v1/documents/{doc_id}", headers=A).json()
        assert info["cache_origin"] == "store" and info["cold_bits"] == 8 and info["cold_bytes"] > 0
        assert server_counters(second)["prefills"] == 0
