"""Limits that a mutation review found unpinned: a tenant's document quota and upload share count the uploads still
arriving and the documents that failed, every credential a request presents is checked (the Bearer scheme in any
case), keys are at least 8 characters, and a question of one character over the limit is refused."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402
from starlette.datastructures import Headers  # noqa: E402

from infokv_rag.errors import ConfigError, DocumentError  # noqa: E402
from infokv_rag.service.answers import check_question  # noqa: E402
from infokv_rag.service.app import create_app  # noqa: E402
from infokv_rag.service.dependencies import identify  # noqa: E402
from infokv_rag.service.errors import ServiceError  # noqa: E402
from infokv_rag.service.routers import documents as documents_router  # noqa: E402
from infokv_rag.service.settings import Settings  # noqa: E402

from .service_helpers import assert_error, bearer, random_model_settings, upload, wait_settled  # noqa: E402

KEY = "key-tenant-a-0001"
A = bearer(KEY)


def _with_first_upload_held(client: TestClient, monkeypatch: pytest.MonkeyPatch, then: Callable[[], Any]) -> Any:
    """`then()`'s result, called while a first upload of tenant A is still being received (its body held)."""
    real = documents_router.receive_upload
    inside, release = threading.Event(), threading.Event()
    calls: list[int] = []

    async def held(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            inside.set()
            while not release.is_set():
                await asyncio.sleep(0.02)
        return await real(*args)

    monkeypatch.setattr(documents_router, "receive_upload", held)
    first: list[Any] = []
    arriving = threading.Thread(target=lambda: first.append(upload(client, A, "one.txt", b"First memo. Code 1.")))
    arriving.start()
    try:
        assert inside.wait(30)
        result = then()
    finally:
        release.set()
        arriving.join(60)
    assert first[0].status_code == 202, first[0].text
    return result


def test_an_upload_still_arriving_counts_against_the_quota_and_the_share(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quota = random_model_settings(tmp_path / "quota", (f"tenantA:{KEY}",), max_documents_per_tenant=1)
    with TestClient(create_app(quota, engine=random_engine)) as client:
        second = _with_first_upload_held(client, monkeypatch, lambda: upload(client, A, "two.txt", b"Second memo."))
        assert_error(second, 507, "document_quota_exceeded")
        assert len(client.get("/v1/documents", headers=A).json()["data"]) == 1
    monkeypatch.undo()
    share = random_model_settings(
        tmp_path / "share", (f"tenantA:{KEY}",), max_queued_uploads=3, max_queued_uploads_per_tenant=1
    )
    with TestClient(create_app(share, engine=random_engine)) as client:
        second = _with_first_upload_held(client, monkeypatch, lambda: upload(client, A, "two.txt", b"Second memo."))
        assert second.status_code == 429, second.text


def test_a_failed_document_counts_against_the_quota(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its saved text stays until it is deleted: uploads that fail to read would otherwise fill the disk."""
    settings = random_model_settings(tmp_path / "data", (f"tenantA:{KEY}",), max_documents_per_tenant=1)

    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise DocumentError("cannot be read")

    monkeypatch.setattr(random_engine, "ingest_document", unreadable)
    with TestClient(create_app(settings, engine=random_engine)) as client:
        first = upload(client, A, "one.txt", b"First memo. Code 1.")
        assert wait_settled(client, first.json()["id"], A)["status"] == "failed"
        assert_error(upload(client, A, "two.txt", b"Second memo."), 507, "document_quota_exceeded")


def test_every_key_presented_is_checked_and_the_scheme_is_any_case() -> None:
    settings = Settings(api_keys=(f"tenantA:{KEY}",))
    two = Headers(raw=[(b"x-api-key", KEY.encode()), (b"x-api-key", b"wrong-key-000000")])
    with pytest.raises(ServiceError) as refused:
        identify(settings, two)
    assert refused.value.status == 401
    principal = identify(settings, Headers({"authorization": f"bearer {KEY}"}))  # RFC 7235: case-insensitive
    assert principal is not None and principal.tenant == "tenantA"


def test_keys_of_fewer_than_8_characters_are_refused() -> None:
    with pytest.raises(ConfigError):
        Settings(api_keys=("tenantA:1234567",))
    Settings(api_keys=("tenantA:12345678",))


def test_a_question_one_character_over_the_limit_is_refused() -> None:
    service: Any = SimpleNamespace(settings=SimpleNamespace(max_question_chars=100))
    check_question(service, 100)
    with pytest.raises(ServiceError) as refused:
        check_question(service, 101)
    assert (refused.value.status, refused.value.code) == (413, "question_too_long")
