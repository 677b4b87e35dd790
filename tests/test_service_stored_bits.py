"""A cache held in codes through the service: the upload option, the document's info, a restart, and sharing.

In-process on the random 3-layer model (`create_app(settings, engine=random_engine)` and a TestClient).
"""

from __future__ import annotations

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
)

KEY = "key-tenant-a-0001"
A = bearer(KEY)
LONG = " ".join(CORPUS * 6).encode()


def running(engine: InfoKVEngine, data_dir: Path, **overrides: Any) -> TestClient:
    return TestClient(create_app(random_model_settings(data_dir, (f"tenantA:{KEY}",), **overrides), engine=engine))


def answer(client: TestClient, doc_id: str) -> str:
    response = client.post(f"/v1/documents/{doc_id}/ask", json={"question": "Who pays?", "max_tokens": 4}, headers=A)
    assert response.status_code == 200, response.text
    return str(response.json()["answer"])


def test_an_upload_held_in_codes_answers_from_them_after_a_restart(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    data = tmp_path / "data"
    # share_caches: the same file uploaded twice with other options must still be read twice.
    with running(random_engine, data, share_caches=True) as client:
        plain = upload_ready(client, A, "plain.txt", LONG)
        coded = upload_ready(client, A, "coded.txt", LONG, stored_bits="4")
        plain_info = client.get(f"/v1/documents/{plain}", headers=A).json()
        info = client.get(f"/v1/documents/{coded}", headers=A).json()
        assert plain_info["stored_bits"] is None and info["stored_bits"] == 4
        assert info["kept_tokens"] == plain_info["kept_tokens"]
        assert 0 < info["cache_bytes"] < plain_info["cache_bytes"] / 2, (info, plain_info)
        first = answer(client, coded)
        for bad in ("3", "16", "x"):
            assert_error(upload(client, A, "a.txt", LONG, stored_bits=bad), 422, "invalid_option")
    with running(random_engine, data) as client:
        assert answer(client, coded) == first
        counters = server_counters(client)
        assert counters["prefills"] == 0 and counters["cache_loads"] == 1
        assert client.get(f"/v1/documents/{coded}", headers=A).json()["cache_bytes"] == info["cache_bytes"]


def test_the_shared_store_carries_the_codes(
    random_engine: InfoKVEngine, random_model_dir: Path, tmp_path: Path
) -> None:
    pytest.importorskip("fsspec", reason="the shared store needs the [scale] extra")
    store = f"file://{tmp_path}/store"
    with running(random_engine, tmp_path / "a", store=store) as first:
        doc_id = upload_ready(first, A, "coded.txt", LONG, stored_bits="8")
        reference = answer(first, doc_id)
        cache_bytes = first.get(f"/v1/documents/{doc_id}", headers=A).json()["cache_bytes"]
    second_engine = InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu")
    with running(second_engine, tmp_path / "b", store=store) as second:
        assert answer(second, doc_id) == reference
        info = second.get(f"/v1/documents/{doc_id}", headers=A).json()
        assert info["cache_origin"] == "store" and info["stored_bits"] == 8 and info["cache_bytes"] == cache_bytes
        assert server_counters(second)["prefills"] == 0
