"""Tenants, bounds, credentials and storage truth of the service, in-process on a random 3-layer model.

Each test builds the app with `create_app(settings, engine=random_engine)` and drives it with Starlette's
TestClient (the lifespan runs: the model worker reads uploads for real, only the model is tiny).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from infokv_rag import scorers  # noqa: E402
from infokv_rag.errors import ConfigError  # noqa: E402
from infokv_rag.service import uploads  # noqa: E402
from infokv_rag.service.app import create_app  # noqa: E402
from infokv_rag.service.registry import Registry  # noqa: E402
from infokv_rag.service.settings import Settings  # noqa: E402

from . import pdf_factory as pdfs  # noqa: E402
from .service_helpers import (  # noqa: E402
    ADMIN_KEY,
    LEAKS,
    assert_error,
    bearer,
    random_model_settings,
    read_only,
    set_read_only,
    upload,
    upload_ready,
    wait_settled,
)

KEY_A1, KEY_A2, KEY_B = "key-tenant-a-0001", "key-tenant-a-0002", "key-tenant-b-0001"
KEY_BARE = "key-bare-tenant-01"
A1, A2, B, BARE, ADMIN = (bearer(k) for k in (KEY_A1, KEY_A2, KEY_B, KEY_BARE, ADMIN_KEY))
SECRET = b"Memo for tenant A. The vault code is 9988776. The office closes at five."
OTHER = b"Memo for tenant B. The parking lot opens at seven. Visitors sign in at the desk."
UNKNOWN = "doc_" + "z" * 22
ROOT = Path(__file__).resolve().parents[1]


def settings_for(data_dir: Path, **overrides: Any) -> Settings:
    keys = (f"tenantA:{KEY_A1}", f"tenantA:{KEY_A2}", f"tenantB:{KEY_B}", KEY_BARE)
    return random_model_settings(data_dir, keys, **overrides)  # with the helpers' admin key


@contextlib.contextmanager
def running(engine: Any, data_dir: Path, **overrides: Any) -> Iterator[TestClient]:
    with TestClient(create_app(settings_for(data_dir, **overrides), engine=engine)) as client:
        yield client


@pytest.fixture
def client(random_engine: Any, tmp_path: Path) -> Iterator[TestClient]:
    with running(random_engine, tmp_path / "data") as http:
        yield http


def ask(client: TestClient, headers: dict[str, str], doc_id: str, **body: Any) -> Any:
    return client.post(
        f"/v1/documents/{doc_id}/ask", json={"question": "What is the code?", "max_tokens": 2, **body}, headers=headers
    )


def ids(client: TestClient, headers: dict[str, str]) -> set[str]:
    response = client.get("/v1/documents", headers=headers)
    assert response.status_code == 200, response.text
    return {d["id"] for d in response.json()["data"]}


def _same_answer(first: Any, second: Any) -> None:
    """Two responses a client cannot tell apart (status, headers that matter, body)."""
    assert first.status_code == second.status_code
    assert first.json() == second.json()
    assert first.headers.get("content-type") == second.headers.get("content-type")


# Tenants -----------------------------------------------------------------------------------------


def test_tenants_see_only_their_own_documents(client: TestClient) -> None:
    doc_a = upload_ready(client, A1, "vault.txt", SECRET)
    doc_b = upload_ready(client, B, "parking.txt", OTHER)
    assert client.get(f"/v1/documents/{doc_a}", headers=A1).json()["owner"] == "tenantA"
    assert ids(client, A1) == ids(client, A2) == {doc_a}  # two keys of one tenant
    assert ids(client, B) == {doc_b}
    assert ids(client, BARE) == set()  # a bare key is its own tenant
    assert ids(client, ADMIN) == {doc_a, doc_b}  # an admin key sees every tenant's documents
    assert client.get(f"/v1/documents/{doc_b}", headers=ADMIN).json()["owner"] == "tenantB"
    assert ask(client, A2, doc_a).status_code == 200

    # Another tenant's id answers exactly like an unknown id, on every route.
    chat = {"model": "random", "messages": [{"role": "user", "content": "The code?"}], "max_tokens": 2}
    for headers in (B, BARE):
        _same_answer(
            client.get(f"/v1/documents/{doc_a}", headers=headers),
            client.get(f"/v1/documents/{UNKNOWN}", headers=headers),
        )
        _same_answer(ask(client, headers, doc_a), ask(client, headers, UNKNOWN))
        _same_answer(
            client.post("/v1/chat/completions", json={**chat, "document_id": doc_a}, headers=headers),
            client.post("/v1/chat/completions", json={**chat, "document_id": UNKNOWN}, headers=headers),
        )
        _same_answer(  # an id that cannot exist, on the route that takes it in the body
            client.post("/v1/chat/completions", json={**chat, "document_id": "doc_" + "z" * 80}, headers=headers),
            client.post("/v1/chat/completions", json={**chat, "document_id": UNKNOWN}, headers=headers),
        )
        _same_answer(
            client.delete(f"/v1/documents/{doc_a}", headers=headers),
            client.delete(f"/v1/documents/{UNKNOWN}", headers=headers),
        )
        assert_error(client.get(f"/v1/documents/{doc_a}", headers=headers), 404, "document_not_found")
        listing = client.get("/v1/documents", headers=headers).text
        assert doc_a not in listing and "9988776" not in listing
    # The refused deletes changed nothing; the owner deletes it.
    assert ids(client, A1) == {doc_a} and ask(client, A1, doc_a).status_code == 200
    assert client.delete(f"/v1/documents/{doc_a}", headers=A2).status_code == 200
    assert ids(client, ADMIN) == {doc_b}


def test_documents_from_before_tenants_belong_to_no_tenant(random_engine: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        legacy = upload_ready(client, A1, "old.txt", SECRET)
    # What a version without tenants wrote: meta.json has no "owner" (nor "sha256").
    meta_path = data / "documents" / legacy / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("owner"), meta.pop("sha256")
    meta_path.write_text(json.dumps(meta))
    with running(random_engine, data) as client:
        for headers in (A1, B, BARE):
            assert ids(client, headers) == set()
            assert_error(client.get(f"/v1/documents/{legacy}", headers=headers), 404, "document_not_found")
        info = client.get(f"/v1/documents/{legacy}", headers=ADMIN).json()
        assert info["owner"] is None and info["status"] == "ready"
        assert ask(client, ADMIN, legacy).status_code == 200
        assert client.delete(f"/v1/documents/{legacy}", headers=ADMIN).status_code == 200
    assert not (data / "documents" / legacy).exists()


def test_an_open_service_over_tenants_documents_shows_none_of_them(
    random_engine: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A data directory that a service with keys wrote, opened without them (INFOKV_ALLOW_ANONYMOUS, its keys
    variable lost in a redeploy): anyone could list, ask about and delete every tenant's documents. The open
    service's caller sees the documents of no tenant only, and the start says the others are there."""
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        secret = upload_ready(client, A1, "vault.txt", SECRET)
    settings = random_model_settings(data, (), admin_keys=(), allow_anonymous=True)
    with caplog.at_level(logging.WARNING), TestClient(create_app(settings, engine=random_engine)) as client:
        assert "the documents of 1 tenant(s) (tenantA)" in caplog.text
        assert ids(client, {}) == set()
        for response in (
            client.get(f"/v1/documents/{secret}"),
            ask(client, {}, secret),
            client.delete(f"/v1/documents/{secret}"),
        ):
            assert_error(response, 404, "document_not_found")
        own = upload_ready(client, {}, "open.txt", OTHER)
        assert ids(client, {}) == {own} and ask(client, {}, own).status_code == 200
    with running(random_engine, data) as client:
        assert ids(client, A1) == {secret} and ask(client, A1, secret).status_code == 200


def test_a_documents_info_does_not_change_with_other_tenants_documents(random_engine: Any, tmp_path: Path) -> None:
    """`cache_origin` went to None when the cache left memory for room, which other tenants' uploads and
    questions decide: a tenant could watch it to learn how much others read (what /healthz hides from them)."""
    with running(random_engine, tmp_path / "data", loaded_documents=2) as client:
        doc_b = upload_ready(client, B, "parking.txt", OTHER)
        before = client.get(f"/v1/documents/{doc_b}", headers=B).json()
        assert before["cache_origin"] == "prefill"
        for number in range(3):
            upload_ready(client, A1, f"memo-{number}.txt", SECRET + str(number).encode())
        assert client.get(f"/v1/documents/{doc_b}", headers=B).json() == before
        assert ask(client, B, doc_b).status_code == 200  # loaded back from disk, dropped for A's documents
        assert client.get(f"/v1/documents/{doc_b}", headers=B).json() == before


def test_a_tenant_keeps_at_most_its_quota_of_documents(random_engine: Any, tmp_path: Path) -> None:
    """One tenant could upload until the disk was full, every other tenant's upload failing after its 202. Past
    `max_documents_per_tenant` (2 here) its uploads are refused before they are received; others' are not."""
    data = tmp_path / "data"
    with running(random_engine, data, max_documents_per_tenant=2) as client:
        first = upload_ready(client, A1, "one.txt", SECRET)
        upload_ready(client, A2, "two.txt", SECRET + b" Two.")  # another key of the same tenant
        refused = upload(client, A1, "three.txt", SECRET + b" Three.")
        assert_error(refused, 507, "document_quota_exceeded")
        assert "keeps 2 documents" in refused.json()["error"]["message"] and "Retry-After" not in refused.headers
        assert list((data / "uploads").iterdir()) == [] and len(ids(client, A1)) == 2
        upload_ready(client, B, "parking.txt", OTHER)
        assert client.delete(f"/v1/documents/{first}", headers=A1).status_code == 200
        upload_ready(client, A1, "three.txt", SECRET + b" Three.")


def _tensors(data: Path, doc_id: str) -> Path:
    return data / "documents" / doc_id / "cache" / "tensors.safetensors"


def _forget_saved_text_sha256(data: Path, doc_id: str) -> None:
    """Makes the document's record one that a release before the check of its saved text wrote."""
    meta = data / "documents" / doc_id / "meta.json"
    record = json.loads(meta.read_text())
    del record["saved_text_sha256"]
    meta.write_text(json.dumps(record))


@pytest.mark.parametrize("share", [False, True])
def test_same_file_from_two_tenants_shares_a_cache_only_when_configured(
    random_engine: Any, tmp_path: Path, share: bool
) -> None:
    data = tmp_path / "data"
    with running(random_engine, data, share_caches=share) as client:
        doc_a = upload_ready(client, A1, "same.txt", SECRET)
        doc_b = upload_ready(client, B, "same.txt", SECRET)
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert doc_a != doc_b
        linked = os.path.samefile(_tensors(data, doc_a), _tensors(data, doc_b))
        if share:
            assert (counters["prefills"], counters["cache_shares"], linked) == (1, 1, True)
        else:
            assert (counters["prefills"], counters["cache_shares"], linked) == (2, 0, False)
        info_b = client.get(f"/v1/documents/{doc_b}", headers=B).json()
        assert info_b["owner"] == "tenantB" and info_b["tokens"] > 0 and info_b["cache_bytes"] > 0
        # Each copy is its tenant's alone: deleting one leaves the other answering.
        assert client.delete(f"/v1/documents/{doc_a}", headers=A1).status_code == 200
        assert ask(client, B, doc_b).status_code == 200
        assert ids(client, A1) == set() and ids(client, B) == {doc_b}


def _budgets_read(client: TestClient, headers: dict[str, str], doc_id: str) -> tuple[int, dict[str, int]]:
    """What a document's budgets change: the tokens it keeps, and a question's usage (the tokens it recalls)."""
    kept = client.get(f"/v1/documents/{doc_id}", headers=headers).json()["kept_tokens"]
    return kept, ask(client, headers, doc_id).json()["usage"]


@pytest.mark.parametrize("option", ["recall"])  # the form refuses keep "1" (`test_numeric_fields_out_of_range...`)
def test_a_token_count_and_a_ratio_of_the_same_number_share_no_cache(
    random_engine: Any, tmp_path: Path, option: str
) -> None:
    """`1` is one token and `1.0` a ratio (every token): equal numbers, other budgets. The same file uploaded with
    each is read twice, and neither document answers from the other's cache put in its place (as a release that
    shared them left it): it is read again, and answers as it did."""
    data = tmp_path / "data"
    memo = b" ".join([SECRET] * 8)  # long enough for one token and every token to differ, kept or recalled
    with running(random_engine, data, share_caches=True) as client:
        count = upload_ready(client, A1, "same.txt", memo, **{option: "1"})
        ratio = upload_ready(client, B, "same.txt", memo, **{option: "1.0"})
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (2, 0)
        own = _budgets_read(client, B, ratio)
        assert own != _budgets_read(client, A1, count)
    cache = data / "documents" / ratio / "cache"
    shutil.rmtree(cache)
    shutil.copytree(data / "documents" / count / "cache", cache)
    with running(random_engine, data, share_caches=True) as client:
        assert_error(ask(client, B, ratio), 409, "cache_rebuilding")
        assert wait_settled(client, ratio, B)["status"] == "ready"
        assert _budgets_read(client, B, ratio) == own
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (1, 0)


def test_a_copy_that_fails_its_check_in_any_way_leaves_the_upload_to_be_read(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the twin's copy can fail otherwise than a damaged cache does (torch's OutOfMemoryError moving its
    tensors onto a full GPU): the upload stayed "queued" for good, though it had been told 202, and a ready
    document read again after losing its cache did the same. Sharing only saves a prefill: the upload is read."""
    load = random_engine.load

    def out_of_memory_on_a_shared_copy(directory: Path) -> Any:
        if ".cache.sharing-" in str(directory):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return load(directory)

    with running(random_engine, tmp_path / "data", share_caches=True) as client:
        upload_ready(client, A1, "same.txt", SECRET)
        monkeypatch.setattr(random_engine, "load", out_of_memory_on_a_shared_copy)
        twin = upload_ready(client, B, "same.txt", SECRET)
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (2, 0)
        assert ask(client, B, twin).status_code == 200

        # Whatever else goes wrong before the prefill settles the upload failed, never left queued.
        def broken(*args: Any) -> bool:
            raise RuntimeError("a bug")

        monkeypatch.setattr(Registry, "share", broken)
        created = upload(client, A1, "same.txt", SECRET)
        assert created.status_code == 202
        settled = wait_settled(client, created.json()["id"], A1)
        assert (settled["status"], settled["reason_code"]) == ("failed", "internal_error")


def test_the_same_file_read_into_other_text_by_an_older_release_shares_no_cache(
    random_engine: Any, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    with running(random_engine, data, share_caches=True) as client:
        doc_a = upload_ready(client, A1, "same.txt", SECRET)
    # What a release that read the file otherwise saved for A: the same sha256, other text (and no sha256 of that
    # text in the record: read unchecked).
    saved = data / "documents" / doc_a / "document.json"
    document = json.loads(saved.read_text())
    document["text"] += "\nPage 1"
    document["pages"][0]["chars"] += len("\nPage 1")
    saved.write_text(json.dumps(document))
    _forget_saved_text_sha256(data, doc_a)
    with running(random_engine, data, share_caches=True) as client:
        doc_b = upload_ready(client, B, "same.txt", SECRET)
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (1, 0)
        assert not os.path.samefile(_tensors(data, doc_a), _tensors(data, doc_b))
        assert ask(client, B, doc_b).status_code == 200


@pytest.mark.parametrize("made_by", ["an older revision", "a release that kept no revision"])
def test_a_cache_made_before_its_method_changed_is_shared_with_no_new_upload(
    random_engine: Any, tmp_path: Path, made_by: str
) -> None:
    """A's cache was made before a release changed what the method keeps (`Method.revision`): B's upload of the
    same file is read again, not handed the old selection; a cache made by this release is then shared."""
    data = tmp_path / "data"
    with running(random_engine, data, share_caches=True) as client:
        doc_a = upload_ready(client, A1, "same.txt", SECRET)
    meta = data / "documents" / doc_a / "meta.json"
    record = json.loads(meta.read_text())
    assert record["method_revision"] == scorers.method(record["method"]).revision
    if made_by == "an older revision":
        record["method_revision"] -= 1
    else:
        del record["method_revision"]
    meta.write_text(json.dumps(record))
    with running(random_engine, data, share_caches=True) as client:
        doc_b = upload_ready(client, B, "same.txt", SECRET)
        doc_c = upload_ready(client, A1, "same.txt", SECRET)
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (1, 1)
        assert not os.path.samefile(_tensors(data, doc_a), _tensors(data, doc_b))
        assert os.path.samefile(_tensors(data, doc_b), _tensors(data, doc_c))
        assert ask(client, A1, doc_a).status_code == 200  # A keeps the cache it was read into


def test_a_shared_cache_read_again_replaces_the_lost_one(random_engine: Any, tmp_path: Path) -> None:
    """B's cache, shared from A's, loses a file: B is read again, and its identical twin's cache replaces what is
    left of the lost one (a verified copy, no prefill); a restart after a kill in the middle reads it again too."""
    data = tmp_path / "data"
    with running(random_engine, data, share_caches=True) as client:
        upload_ready(client, A1, "same.txt", SECRET)
        doc_b = upload_ready(client, B, "same.txt", SECRET)
        answer = ask(client, B, doc_b).json()["answer"]
    os.unlink(_tensors(data, doc_b))  # B's own link only: A's files are whole
    with running(random_engine, data, share_caches=True) as client:
        assert_error(ask(client, B, doc_b), 409, "cache_rebuilding")
        info = wait_settled(client, doc_b, B)
        assert (info["status"], info["prefill_seconds"]) == ("ready", 0.0)
        assert ask(client, B, doc_b).json()["answer"] == answer
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (0, 1)
    # Killed after the shared cache was in place but before B's record said ready: read again at the restart.
    meta = data / "documents" / doc_b / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "status": "queued"}))
    with running(random_engine, data, share_caches=True) as client:
        assert wait_settled(client, doc_b, B)["status"] == "ready"
        assert ask(client, B, doc_b).json()["answer"] == answer


@pytest.mark.parametrize("damage", ["lost", "damaged"])
def test_a_twin_whose_cache_cannot_be_used_shares_nothing(random_engine: Any, tmp_path: Path, damage: str) -> None:
    """A's listed cache is gone or damaged: B's upload of the same file is read as any other (never ready on a
    copy that cannot answer, never failed for A's sake), and A is read again when next asked."""
    data = tmp_path / "data"
    with running(random_engine, data, share_caches=True) as client:
        doc_a = upload_ready(client, A1, "same.txt", SECRET)
        expected = ask(client, A1, doc_a).json()["answer"]
    if damage == "lost":
        shutil.rmtree(data / "documents" / doc_a / "cache")
    else:
        _tensors(data, doc_a).unlink()
    with running(random_engine, data, share_caches=True) as client:
        doc_b = upload_ready(client, B, "same.txt", SECRET)
        counters = client.get("/healthz", headers=ADMIN).json()["counters"]
        assert (counters["prefills"], counters["cache_shares"]) == (1, 0)
        assert ask(client, B, doc_b).json()["answer"] == expected
        assert_error(ask(client, A1, doc_a), 409, "cache_rebuilding")
        assert wait_settled(client, doc_a, A1)["status"] == "ready"
        assert ask(client, A1, doc_a).json()["answer"] == expected


def test_a_cache_moved_under_another_document_is_never_answered_from(random_engine: Any, tmp_path: Path) -> None:
    """A whole, verified cache of tenant B's document (or of the same file read with other options) put in
    place of A's by hand: A's document is read again from its own text, never answered from B's cache."""
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        doc_a = upload_ready(client, A1, "memo.txt", SECRET)
        doc_b = upload_ready(client, B, "other.txt", OTHER)
        half = upload_ready(client, A1, "memo.txt", SECRET, keep="0.5")
        own = ask(client, A1, doc_a).json()["answer"]
    for planted in (doc_b, half):
        cache_a = data / "documents" / doc_a / "cache"
        shutil.rmtree(cache_a)
        shutil.copytree(data / "documents" / planted / "cache", cache_a)
        with running(random_engine, data) as client:  # nothing in memory: the cache is loaded from disk
            assert_error(ask(client, A1, doc_a), 409, "cache_rebuilding")
            assert wait_settled(client, doc_a, A1)["status"] == "ready"
            assert ask(client, A1, doc_a).json()["answer"] == own
            assert client.get("/healthz", headers=ADMIN).json()["counters"]["prefills"] == 1


def test_keys_and_tenants_are_validated() -> None:
    tenants = {c.tenant for c in settings_for(Path("/nonexistent")).keyring.credentials}
    bare = next(t for t in tenants if t.startswith("key-"))
    assert tenants == {"tenantA", "tenantB", "ops", bare}
    assert KEY_BARE not in bare and re.fullmatch(r"key-[0-9a-f]{12}", bare)
    with pytest.raises(ConfigError, match="tenant 'tenantA' is shorter than 8"):
        Settings(api_keys=("tenantA:short",))
    with pytest.raises(ConfigError, match="tenant name") as refused:
        Settings(api_keys=("s3cr3t!%:long-enough-key",))
    assert "s3cr3t" not in str(refused.value)  # it may be part of a bare key that holds a colon
    # A key that HTTP headers do not carry as configured could never authenticate: refused at start, never echoed.
    for entry in ("tenantC:clé-secrète-0001", "tenantC:tab\tinside-0001"):
        with pytest.raises(ConfigError, match="tenant 'tenantC' holds a character that is not printable ASCII") as bad:
            Settings(api_keys=(entry,))
        assert "clé" not in str(bad.value) and "inside" not in str(bad.value)
    # Bytes that are not UTF-8 in the environment (read as surrogates) too, in a bare key named by its digest.
    with pytest.raises(ConfigError, match="tenant 'key-[0-9a-f]{12}' holds a character that is not printable ASCII"):
        Settings.from_env({"INFOKV_API_KEYS": "key-\udcff-long-enough"})
    # In the environment, '#' is part of a key (comments are for keys files); and no key is shown by a repr.
    hashed = Settings.from_env({"INFOKV_API_KEYS": "tenantA:Pa55word#2024-long"})
    assert hashed.keyring.find("Pa55word#2024-long") is not None and hashed.keyring.find("Pa55word") is None
    assert "Pa55word" not in repr(hashed) and ADMIN_KEY not in repr(settings_for(Path("/nonexistent")))
    with pytest.raises(ConfigError, match="the same API key"):
        Settings(api_keys=(f"tenantA:{KEY_A1}", f"tenantB:{KEY_A1}"))
    with pytest.raises(ConfigError, match="the same API key"):
        Settings(api_keys=(f"tenantA:{KEY_A1}",), admin_keys=(f"tenantA:{KEY_A1}",))


def test_keys_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# tenants\ntenantA:{KEY_A1}\n\ntenantB:{KEY_B}   # B's key\nops:{ADMIN_KEY} admin\n")
    env = {"INFOKV_KEYS_FILE": str(keys), "INFOKV_API_KEYS": KEY_BARE}
    ring = Settings.from_env(env).keyring
    assert {(c.tenant, c.admin) for c in ring.credentials if not c.tenant.startswith("key-")} == {
        ("tenantA", False),
        ("tenantB", False),
        ("ops", True),
    }
    admin, tenant_b = ring.find(ADMIN_KEY), ring.find(KEY_B)
    assert admin is not None and tenant_b is not None
    assert admin.admin and not tenant_b.admin and ring.find(KEY_BARE)
    keys.write_text(f"tenantA:{KEY_A1} superuser\n")
    with pytest.raises(ConfigError, match="line 1"):
        Settings(keys_file=keys)
    with pytest.raises(ConfigError, match="cannot read the keys file"):
        Settings(keys_file=tmp_path / "missing")


def test_readme_example_keys_start_a_server() -> None:
    """Every INFOKV_*KEYS=... in the README is a configuration the server accepts."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.findall(r"INFOKV_(API_KEYS|ADMIN_KEYS)=(\S+)", readme)
    assert found, "the README shows no example keys"
    for name, value in found:
        Settings.from_env({f"INFOKV_{name}": value}).check_startable()


# Credentials -------------------------------------------------------------------------------------


def test_every_credential_presented_must_be_valid(client: TestClient) -> None:
    listing = "/v1/documents"
    assert client.get(listing, headers={"X-API-Key": KEY_A1}).status_code == 200
    assert client.get(listing, headers={**A1, "X-API-Key": KEY_A2}).status_code == 200  # one tenant, two keys
    cases = {
        "valid X-API-Key, invalid Bearer": (
            {"X-API-Key": KEY_A1, "Authorization": "Bearer wrong-key-000000"},
            "invalid_api_key",
        ),
        "valid Bearer, invalid X-API-Key": ({**A1, "X-API-Key": "wrong-key-000000"}, "invalid_api_key"),
        "valid X-API-Key, Basic scheme": ({"X-API-Key": KEY_A1, "Authorization": f"Basic {KEY_A1}"}, "invalid_api_key"),
        "empty Bearer": ({"Authorization": "Bearer "}, "invalid_api_key"),
        "empty X-API-Key": ({"X-API-Key": ""}, "invalid_api_key"),
        "two tenants' keys": ({**A1, "X-API-Key": KEY_B}, "conflicting_api_keys"),
        "a tenant's and an admin's key": ({**A1, "X-API-Key": ADMIN_KEY}, "conflicting_api_keys"),
        "no key": ({}, "missing_api_key"),
    }
    for name, (headers, code) in cases.items():
        response = client.get(listing, headers=headers)
        assert response.status_code == 401, name
        assert_error(response, 401, code)
        assert response.headers["www-authenticate"].startswith("Bearer")
    # Every Authorization header is checked, not the first alone (a proxy may add its own).
    for second, code in (
        ("Bearer wrong-key-000000", "invalid_api_key"),
        (f"Basic {KEY_A1}", "invalid_api_key"),
        (f"Bearer {KEY_B}", "conflicting_api_keys"),
    ):
        response = client.get(listing, headers=[("Authorization", f"Bearer {KEY_A1}"), ("Authorization", second)])
        assert_error(response, 401, code)


# Bounds ------------------------------------------------------------------------------------------


def test_numeric_fields_out_of_range_are_422_not_500(client: TestClient) -> None:
    doc = upload_ready(client, A1, "vault.txt", SECRET)
    for bad in (
        {"seed": 2**70},
        {"seed": -(2**70)},
        {"max_tokens": 10**12},
        {"max_tokens": 0},
        {"temperature": 2.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"stop": ["a"] * 5},
        {"stop": "x" * 65},
        # No number in JSON: true read as 1 would cut the answer to one token, or recall the whole cold tier.
        {"max_tokens": True},
        {"seed": True},
        {"temperature": True},
        {"recall": True},
        {"max_tokens": "3"},
        {"recall": "0.5"},
        # No flag but true or false: "yes" or 1 would start a stream the client did not ask for.
        {"stream": "yes"},
        {"stream": 1},
    ):
        assert_error(ask(client, A1, doc, **bad), 422, "invalid_request")
    # A question that is not text (a lone surrogate, which JSON can carry) is refused naming the field.
    raw = b'{"question": "code \\ud800?"}'
    response = client.post(f"/v1/documents/{doc}/ask", content=raw, headers={**A1, "content-type": "application/json"})
    error = assert_error(response, 422, "invalid_request")
    assert error["param"] == "question" and "lone surrogate" in error["message"], error
    too_many = assert_error(ask(client, A1, doc, max_tokens=9), 422, "max_tokens_too_large")  # the server's limit
    assert too_many["param"] == "max_tokens", too_many
    for literal in ("NaN", "Infinity", "-Infinity"):  # Python's JSON reader accepts these
        raw = f'{{"question": "q", "temperature": {literal}}}'.encode()
        response = client.post(
            f"/v1/documents/{doc}/ask", content=raw, headers={**A1, "content-type": "application/json"}
        )
        assert_error(response, 422, "invalid_request")
    assert ask(client, A1, doc, seed=2**64 - 1, temperature=0.5).status_code == 200  # as the core takes it
    assert ask(client, A1, doc, seed=-(2**63), temperature=0.5).status_code == 200
    chat = {"model": "random", "messages": [{"role": "user", "content": "q"}], "document_id": doc}
    # OpenAI's route answers 400 (its clients raise BadRequestError for that status), naming the field.
    for wrong in (
        {"seed": 2**64},
        {"max_tokens": 2**40},
        {"max_completion_tokens": -1},
        {"temperature": -0.1},
        {"n": 2},
        {"max_tokens": True},
        {"top_p": True},
        {"recall": True},
        {"n": True},
        {"stream": 1},
        {"logprobs": "false"},
        {"stream_options": {"include_usage": "yes"}, "stream": True},
    ):
        response = client.post("/v1/chat/completions", json={**chat, **wrong}, headers=A1)
        error = assert_error(response, 400, "invalid_request")
        assert error["param"].split(".")[0] == next(iter(wrong)), error  # dotted down to the field within
    for keep in ("inf", "nan", "-1", "1e400", "0"):
        assert_error(upload(client, A1, "a.txt", SECRET, keep=keep), 422, "invalid_option")
    # The form is held to the bounds its schema shows (the form is read by hand, not by FastAPI's validation).
    upload_schema = client.get("/openapi.json").json()["paths"]["/v1/documents"]["post"]["requestBody"]
    keep_count = upload_schema["content"]["multipart/form-data"]["schema"]["properties"]["keep"]["anyOf"][1]
    assert keep_count["type"] == "integer" and keep_count["minimum"] == 2, keep_count
    # "1" would read as the whole document (a JavaScript client sends 1.0 as 1), but it is a count of one token.
    error = assert_error(upload(client, A1, "a.txt", SECRET, keep="1"), 422, "invalid_option")
    assert error["param"] == "keep" and "write 1.0 to keep every token" in error["message"], error
    for field, value in (
        ("keep", str(int(keep_count["maximum"]) + 1)),
        ("keep", "100000000000"),
        ("keep", "1.5"),
        ("recall", "100000000000"),
        ("cold_bits", "9"),
        ("stored_bits", "2"),
        ("password", "p" * 1025),
    ):
        error = assert_error(upload(client, A1, "a.txt", SECRET, **{field: value}), 422, "invalid_option")
        assert error["param"] == field and f"'{field}' is out of bounds" in error["message"], error
        assert value not in error["message"], error  # what was sent is not echoed back
    assert_error(upload(client, A1, "a.txt", SECRET, colour="blue"), 422, "unknown_field")
    twice = client.post("/v1/documents", files={"file": ("a.txt", SECRET)}, data={"keep": ["0.5", "0.25"]}, headers=A1)
    assert_error(twice, 422, "repeated_field")
    two_files = [("file", ("a.txt", SECRET)), ("file", ("b.txt", SECRET))]
    assert_error(client.post("/v1/documents", files=two_files, headers=A1), 422, "repeated_field")
    many_files = [
        ("file", (f"{n}.txt", SECRET)) for n in range(8)
    ]  # a file and every option's field as files, and more
    assert_error(client.post("/v1/documents", files=many_files, headers=A1), 400, "bad_request")  # the parser's limit


def test_chat_refusals_about_one_field_name_it_in_param(random_engine: Any, tmp_path: Path) -> None:
    """OpenAI's route names the field a refusal is about in `param` (its clients show it), as its validation
    errors do: dotted, down to the message (`messages.0.role`), or `messages` for the conversation as a whole."""
    with running(random_engine, tmp_path / "data", max_question_chars=20_000) as client:
        doc = upload_ready(client, A1, "vault.txt", SECRET)  # without a cold tier
        chat = {"model": "random", "messages": [{"role": "user", "content": "q"}], "document_id": doc}
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
        blank = {"role": "user", "content": "  "}  # as empty as "" (the core's check)
        over_window = "w " * 9_000  # under the question limit, over the context window of 4096 tokens
        for changes, code, param in (
            ({"max_tokens": 9}, "max_tokens_too_large", "max_tokens"),
            ({"max_completion_tokens": 9, "max_tokens": 2}, "max_tokens_too_large", "max_completion_tokens"),
            ({"recall": 8}, "no_cold_tier", "recall"),
            (
                {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]},
                "unsupported_role",
                "messages.1.role",
            ),
            ({"messages": [{"role": "user", "content": [image]}]}, "unsupported_content", "messages.0.content"),
            ({"messages": [{"role": "user", "content": ""}]}, "empty_message", "messages.0.content"),
            (
                {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, blank]},
                "empty_message",
                "messages.2.content",
            ),
            ({"messages": [{"role": "user", "content": over_window}]}, "context_length_exceeded", "messages"),
        ):
            response = client.post("/v1/chat/completions", json={**chat, **changes}, headers=A1)
            error = assert_error(response, 400, code)
            assert error["param"] == param, error
            if code == "max_tokens_too_large":
                assert error["message"].startswith(f"{param} is 9"), error
        # /ask names its own fields.
        error = assert_error(ask(client, A1, doc, recall=8), 422, "no_cold_tier")
        assert error["param"] == "recall", error
        error = assert_error(ask(client, A1, doc, question=over_window), 400, "context_length_exceeded")
        assert error["param"] == "question", error
        # The advice names the field that held the answer's length (not the core's max_new_tokens).
        assert "lower max_tokens" in error["message"] and "max_new_tokens" not in error["message"], error
        too_long = {**chat, "messages": [{"role": "user", "content": over_window}], "max_completion_tokens": 5}
        error = assert_error(
            client.post("/v1/chat/completions", json=too_long, headers=A1), 400, "context_length_exceeded"
        )
        assert "lower max_completion_tokens" in error["message"] and "max_new_tokens" not in error["message"], error


def test_the_default_answer_length_is_cut_to_the_room_a_long_document_leaves(
    random_engine: Any, tmp_path: Path
) -> None:
    """An operator's default length above the library's (which the upload check reserves) refused every question
    that named no length about a long document, telling the client to lower a max_tokens it never sent."""
    text = "w " * 2000
    while random_engine.count_document_tokens(text) < random_engine.max_document_tokens - 20:
        text += "w " * 20
    with running(random_engine, tmp_path / "data", max_new_tokens=1024, default_max_tokens=1024) as client:
        doc = upload_ready(client, A1, "long.txt", text.encode())
        tokens = random_engine.count_document_tokens(text)
        chat = {"model": "random", "messages": [{"role": "user", "content": "What?"}], "document_id": doc}
        room = random_engine.context_window - tokens - len(random_engine.prompt.conversation_ids([("user", "What?")]))
        assert 1 <= room < 1024
        for response in (
            client.post("/v1/chat/completions", json=chat, headers=A1),
            ask(client, A1, doc, max_tokens=None),
        ):
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] <= room
        # A length the request names is its own: refused when it does not fit, naming it.
        error = assert_error(ask(client, A1, doc, max_tokens=1024), 400, "context_length_exceeded")
        assert "lower max_tokens" in error["message"], error


def test_the_chat_route_schema_lists_the_statuses_it_answers(client: TestClient) -> None:
    """OpenAI's route answers 400 where the others answer 413 or 422: its schema lists 400 for them, not 413/422."""
    schema = client.get("/openapi.json").json()  # the app's `openapi()`
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "413" not in chat and "422" not in chat, sorted(chat)
    assert "400" in chat and "413" in chat["400"]["description"] and "422" in chat["400"]["description"]
    asked = schema["paths"]["/v1/documents/{document_id}/ask"]["post"]["responses"]
    assert {"400", "413", "422"} <= set(asked) and "413" not in asked["400"]["description"]
    # Routes whose only parameters are path strings never answer 422 (FastAPI listed its own, in a shape the
    # service never sends); every 422 listed is an ErrorResponse.
    for path, method in (("/v1/documents/{document_id}", "get"), ("/v1/documents/{document_id}", "delete")):
        assert "422" not in schema["paths"][path][method]["responses"], (path, method)
    assert "422" not in schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "HTTPValidationError" not in json.dumps(schema)


def _numeric_properties(schema: dict[str, Any], node: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            yield from _numeric_properties(schema, schema["components"]["schemas"][name], f"{path}->{name}")
            return
        if node.get("type") in ("integer", "number"):
            yield path, node
        for key, value in node.items():
            yield from _numeric_properties(schema, value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _numeric_properties(schema, value, f"{path}[{index}]")


def test_every_numeric_request_field_is_bounded_in_the_schema(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    found = []
    for route, item in schema["paths"].items():
        for method, operation in item.items():
            body = operation.get("requestBody", {}).get("content", {})
            for content in body.values():
                for where, prop in _numeric_properties(schema, content["schema"], f"{method} {route}"):
                    found.append(where)
                    assert "minimum" in prop or "exclusiveMinimum" in prop, where
                    assert "maximum" in prop or "exclusiveMaximum" in prop, where
    assert any("seed" in f for f in found) and any("keep" in f for f in found) and any("top_p" in f for f in found)
    ask_body = schema["components"]["schemas"]["AskRequest"]["properties"]
    assert ask_body["max_tokens"]["anyOf"][0]["maximum"] == 8  # the server's max_new_tokens
    assert ask_body["seed"]["anyOf"][0]["maximum"] == 2**64 - 1  # exact, not rounded through a float


def test_the_schema_says_what_the_server_does(client: TestClient) -> None:
    """A client made from the schema: liveness needs no key; whole numbers written with a fraction (2.0, what the
    schema's `integer` takes) are taken; an upload's options are not nullable (a form has no null: clients sent the
    text "null"); a 405 names every method of the path; a field sent as a file, or an unknown method, is refused
    naming it."""
    schema = client.get("/openapi.json").json()
    assert {} in schema["paths"]["/healthz"]["get"]["security"] and client.get("/healthz").status_code == 200
    upload_schema = schema["paths"]["/v1/documents"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    assert "null" not in json.dumps(upload_schema)
    doc = upload_ready(client, A1, "vault.txt", SECRET)
    assert ask(client, A1, doc, max_tokens=2.0, seed=7.0, temperature=0.5).status_code == 200
    assert_error(ask(client, A1, doc, max_tokens=2.5), 422, "invalid_request")
    for path, allowed in (("/v1/documents", "GET, POST"), (f"/v1/documents/{doc}", "DELETE, GET")):
        response = client.put(path, headers=A1)
        assert_error(response, 405, "method_not_allowed")
        assert response.headers["allow"] == allowed
    as_file = client.post("/v1/documents", files={"file": ("a.txt", SECRET), "keep": ("keep.txt", b"0.5")}, headers=A1)
    assert_error(as_file, 422, "invalid_field")
    unknown = upload(client, A1, "a.txt", SECRET, method="bogus")
    assert_error(unknown, 422, "invalid_option")
    assert unknown.json()["error"]["param"] == "method"


def test_an_app_served_again_takes_uploads(random_engine: Any, tmp_path: Path) -> None:
    """One app served twice (two event loops, as two TestClient sessions): its stop signal is each run's own, so
    uploads are taken in the second run too (an event bound to the first loop refused them all as a shutdown)."""
    app = create_app(settings_for(tmp_path / "data"), engine=random_engine)
    for _ in range(2):
        with TestClient(app) as client:
            assert upload(client, A1, "memo.txt", SECRET).status_code == 202


def test_a_body_that_is_not_utf8_json_is_one_clear_400_on_every_route(client: TestClient) -> None:
    """Bytes that are not UTF-8 and malformed JSON get the same answer, 400 `invalid_json` (OpenAI's route too, in
    its shape), saying what is wrong and where; `param` is a field or null, never an offset."""
    doc = upload_ready(client, A1, "vault.txt", SECRET)
    headers = {**A1, "content-type": "application/json"}
    chat = {"model": "random", "messages": [{"role": "user", "content": "Le caf\u00e9?"}], "document_id": doc}
    for path, request in (
        (f"/v1/documents/{doc}/ask", {"question": "Le caf\u00e9?", "max_tokens": 2}),
        ("/v1/chat/completions", {**chat, "max_tokens": 2}),
    ):
        text = json.dumps(request, ensure_ascii=False)
        latin1 = text.encode("latin-1")  # the "é" as the one byte 0xe9
        error = assert_error(client.post(path, content=latin1, headers=headers), 400, "invalid_json")
        assert error["param"] is None and error["type"] == "invalid_request_error", error
        assert "not valid UTF-8 JSON" in error["message"] and "0xe9" in error["message"], error
        assert f"byte offset {latin1.index(0xE9)}" in error["message"] and "encoded as UTF-8" in error["message"]
        cut = text.encode("utf-8")[:-1]  # the closing brace missing
        error = assert_error(client.post(path, content=cut, headers=headers), 400, "invalid_json")
        assert error["param"] is None, error
        assert "not valid UTF-8 JSON" in error["message"] and f"line 1, column {len(text)}" in error["message"]
        missing_comma = text.replace(", ", " ", 1).encode("utf-8")
        assert_error(client.post(path, content=missing_comma, headers=headers), 400, "invalid_json")
        error = assert_error(client.post(path, content=b"", headers=headers), 400, "invalid_json")
        assert "the body is empty" in error["message"] and error["param"] is None, error
        too_deep = b"[" * 100_000 + b"]" * 100_000  # Python's JSON reader gives up (RecursionError)
        error = assert_error(client.post(path, content=too_deep, headers=headers), 400, "invalid_json")
        assert "nested too deeply" in error["message"]
        # The same request in UTF-8 is answered: only the encoding was wrong.
        assert client.post(path, content=text.encode("utf-8"), headers=headers).status_code == 200
    # A body of thousands of invalid parts or unknown fields is refused at once with a short message (pydantic
    # refused each apart, on the event loop: seconds for every tenant's requests, a 30 MB message back).
    parts = {**chat, "messages": [{"role": "user", "content": [1] * 300_000}]}
    refused = client.post("/v1/chat/completions", json=parts, headers=A1)
    assert refused.status_code == 400 and len(refused.content) < 1000, len(refused.content)
    assert "256" in refused.json()["error"]["message"], refused.json()
    spread = {**chat, "messages": [{"role": "user", "content": [1, 1]}] * 256}  # 256 per message, 512 in all
    refused = client.post("/v1/chat/completions", json=spread, headers=A1)
    assert refused.status_code == 400 and "512 content parts in all" in refused.json()["error"]["message"]
    unknown = {"question": "Q?", **{f"field{i}": 1 for i in range(50_000)}}
    error = assert_error(client.post(f"/v1/documents/{doc}/ask", json=unknown, headers=A1), 422, "invalid_request")
    assert error["param"] == "field0" and len(error["message"]) < 200, error
    many_errors = {
        "question": 1,
        "max_tokens": "x",
        "temperature": "x",
        "top_p": "x",
        "seed": "x",
        "stop": 1,
        "recall": "x",
    }
    error = assert_error(client.post(f"/v1/documents/{doc}/ask", json=many_errors, headers=A1), 422, "invalid_request")
    assert error["message"].endswith("more"), error


def test_a_file_name_encoded_as_the_multipart_standards_allow_is_read(client: TestClient) -> None:
    """aiohttp percent-encodes a file name (RFC 7578 4.2), which was listed as "E5_90_88_E5_90_8C.txt"; a part that
    names its file only with RFC 5987's `filename*` (urllib3 1.x, some Java clients) was read as a text field, and
    the upload refused as holding no file."""
    multipart = {**A1, "content-type": "multipart/form-data; boundary=B"}
    for disposition, listed in (
        (b'filename="%E5%90%88%E5%90%8C%20Gr%C3%B6%C3%9Fe.txt"', "合同 Größe.txt"),
        (b"filename*=UTF-8''%E5%90%88%E5%90%8C.txt", "合同.txt"),
        (b"filename=\"fallback.txt\"; filename*=utf-8''D%C3%A9lai.txt", "Délai.txt"),
        (b"filename*=iso-8859-1''D%E9lai.txt", "Délai.txt"),
        (b'filename="50%.txt"', "50.txt"),  # no escape: the name as sent, made safe
    ):
        head = b'--B\r\nContent-Disposition: form-data; name="file"; ' + disposition + b"\r\n\r\n"
        sent = client.post("/v1/documents", content=head + SECRET + b"\r\n--B--\r\n", headers=multipart)
        assert sent.status_code == 202, sent.text
        assert sent.json()["filename"] == listed
        assert wait_settled(client, sent.json()["id"], A1)["status"] == "ready"


def test_a_multipart_upload_cut_short_or_malformed_is_400_and_keeps_nothing(client: TestClient, tmp_path: Path) -> None:
    """Starlette takes a multipart body that ends before its closing boundary for a whole one without the part
    it was in (the file: then a 422 `missing_file`), or with it (a file that may be cut). Either is refused as a
    400 `bad_request` that says so, and nothing of it is staged, stored or listed."""
    multipart = {**A1, "content-type": "multipart/form-data; boundary=B"}
    part = b'--B\r\nContent-Disposition: form-data; name="file"; filename="memo.txt"\r\n\r\n' + SECRET
    for body in (part, part + b"\r\n--B", part + b"\r\n--B\r\n", part[:40]):
        error = assert_error(client.post("/v1/documents", content=body, headers=multipart), 400, "bad_request")
        assert "ended before its closing boundary" in error["message"] and "cut short" in error["message"], error
        assert error["param"] is None
    garbled = b"--B\r\nContent-Disposition form-data\r\n\r\nx\r\n--B--\r\n"  # a header line without its colon
    error = assert_error(client.post("/v1/documents", content=garbled, headers=multipart), 400, "bad_request")
    assert "malformed" in error["message"] and "multipart/form-data" in error["message"], error
    data = tmp_path / "data"
    assert ids(client, A1) == set() and list((data / "documents").iterdir()) == []
    assert not (data / "uploads").exists() or list((data / "uploads").iterdir()) == []
    # The same body with its closing boundary (and an epilogue, which is allowed) is an upload.
    whole = client.post("/v1/documents", content=part + b"\r\n--B--\r\nepilogue", headers=multipart)
    assert whole.status_code == 202, whole.text
    assert wait_settled(client, whole.json()["id"], A1)["status"] == "ready"
    # A media type is case-insensitive (RFC 9110): the same upload in capitals is one too.
    shouted = {**A1, "content-type": "Multipart/Form-Data; boundary=B"}
    upper = client.post("/v1/documents", content=part + b"\r\n--B--\r\n", headers=shouted)
    assert upper.status_code == 202, upper.text
    assert wait_settled(client, upper.json()["id"], A1)["status"] == "ready"


# Bounded work ------------------------------------------------------------------------------------


class CountingTokenizer:
    """Wraps the engine's tokenizer and counts the characters it was given."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chars = 0

    def __call__(self, text: str, *args: Any, **kwargs: Any) -> Any:
        self.chars += len(text)
        return self.inner(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_over_long_text_is_refused_after_bounded_work(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = CountingTokenizer(random_engine.prompt.tokenizer)
    monkeypatch.setattr(random_engine.prompt, "tokenizer", counting)
    sentence = "The supplier shall deliver the goods within thirty days of the order date. "
    with running(random_engine, tmp_path / "data", max_document_chars=1_500_000) as client:
        # Over the character limit: refused before any tokenization.
        error = assert_error(upload(client, A1, "huge.txt", (sentence * 21_000).encode()), 413, "too_many_characters")
        assert "1500000" in error["message"] and counting.chars == 0
        # Under it but far over the context window (4096 tokens): tokenization stops soon after the window.
        error = assert_error(upload(client, A1, "long.txt", (sentence * 19_000).encode()), 413, "document_too_long")
        assert "context window of 4096" in error["message"]
        assert counting.chars < 40_000, counting.chars  # of 1.4 million characters
        assert ids(client, A1) == set()


def test_an_encrypted_pdf_over_the_page_limit_is_refused_before_its_text_is_read(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its pages are counted once the upload's password opens it (or the empty one, for an owner-only encryption),
    as a plain PDF's are: before any text is extracted. A password that does not open it is told by the loader."""
    pages = [f"Page {number}: the notice period is ninety days." for number in range(5)]
    with running(random_engine, tmp_path / "data", max_pages=3) as client:
        locked = pdfs.encrypted_pdf(tmp_path / "locked.pdf", pages, "pw123").read_bytes()
        error = assert_error(upload(client, A1, "locked.pdf", locked, password="nope"), 422, "encrypted_pdf")
        assert "wrong password" in error["message"], error

        def read_text(staged: Any) -> Any:
            raise AssertionError(f"the text of {staged.name} was read")

        monkeypatch.setattr(uploads, "_load", read_text)
        owner_only = pdfs.encrypted_pdf(tmp_path / "owner.pdf", pages, "", owner_password="owner-secret").read_bytes()
        for name, data, fields in (
            ("locked.pdf", locked, {"password": "pw123"}),
            ("owner.pdf", owner_only, {}),
            ("owner.pdf", owner_only, {"password": "sent-to-every-file"}),  # opens without one, as it loads
        ):
            error = assert_error(upload(client, A1, name, data, **fields), 413, "too_many_pages")
            assert "has 5 pages" in error["message"], error


def test_a_pdf_over_the_page_limit_is_refused_before_its_text_is_read_whatever_pads_its_end(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pages are counted as the loader reads the file: after the NULs or blank lines that a transfer left past
    its %%EOF (the count looked for the marker in the raw last 1024 bytes, so padding made every page be read)."""
    pages = [f"Page {number}: the notice period is ninety days." for number in range(5)]
    data = pdfs.text_pdf(tmp_path / "long.pdf", pages).read_bytes()

    def read_text(staged: Any) -> Any:
        raise AssertionError(f"the text of {staged.name} was read")

    monkeypatch.setattr(uploads, "_load", read_text)
    with running(random_engine, tmp_path / "data", max_pages=3) as client:
        for padding in (b"", b"\x00" * 2048, b"\n" * 4096):
            error = assert_error(upload(client, A1, "long.pdf", data + padding), 413, "too_many_pages")
            assert "has 5 pages" in error["message"], error


def test_an_upload_named_in_another_script_keeps_its_name_and_suffix(client: TestClient) -> None:
    """A name of Cyrillic or CJK letters is kept (it was reduced to its suffix, "pdf", and staged without one), so
    a PDF with junk before its header, read past only in a file named .pdf, is read as one."""
    data = b"junk before the header\n" + pdfs.text_pdf_bytes(["The notice period is ninety days."])
    for name in ("договор.pdf", "合同.pdf"):
        doc_id = upload_ready(client, A1, name, data)
        info = client.get(f"/v1/documents/{doc_id}", headers=A1).json()
        assert info["filename"] == name and info["status"] == "ready", info


def test_behind_a_path_prefix_each_route_keeps_its_body_limit(random_engine: Any, tmp_path: Path) -> None:
    """Served under a prefix (`--root-path`, behind a proxy), where the server puts the prefix in front of the path:
    an upload still has the upload limit, and any other body the JSON limit."""
    app = create_app(settings_for(tmp_path / "data", max_request_bytes=1024), engine=random_engine)
    memo = b" ".join([SECRET] * 30)  # over the JSON limit, far under the upload limit
    with TestClient(app, base_url="http://testserver/infokv", root_path="/infokv") as client:
        created = upload(client, A1, "located.txt", SECRET)
        assert created.headers["location"] == f"/infokv/v1/documents/{created.json()['id']}"  # where a client finds it
        doc_id = upload_ready(client, A1, "memo.txt", memo)
        assert ask(client, A1, doc_id).status_code == 200
        error = assert_error(ask(client, A1, doc_id, question=memo.decode()), 413, "request_too_large")
        assert "limit of 1024 bytes" in error["message"], error


def test_the_page_calls_the_api_under_the_prefix_it_is_served_under(random_engine: Any, tmp_path: Path) -> None:
    """Behind a proxy serving the API under a prefix (`serve --root-path /kb`), the page's requests go to the
    prefixed routes: the prefix is written into its markup, and every API path in its script starts from it."""
    app = create_app(settings_for(tmp_path / "data"), engine=random_engine)
    for root in ("", "/kb", '/k"b'):
        with TestClient(app, base_url=f"http://testserver{root}", root_path=root) as client:
            page = client.get("/")
            assert page.status_code == 200, page.text
            written = re.search(r'<body data-root="([^"]*)">', page.text)
            assert written is not None and written.group(1) == root.replace('"', "&quot;"), page.text[:400]
    script = page.text.split("<script>")[1]
    calls = [call for call in re.findall(r"(?:api|fetch)\(([^,)]*)", script) if call != "path"]  # api's own
    assert len(calls) == 3 and all(call.startswith('root + "/v1/') for call in calls), calls


def test_an_upload_over_its_tenants_share_or_a_full_queue_is_refused_before_it_is_received(
    random_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload's place in the queue is taken before its body is read: a refused upload is neither received nor
    staged on disk. The place is given back however the upload ends."""
    received: list[str] = []
    read_form = uploads._read_form

    async def recording_read_form(request: Any, *args: Any) -> Any:
        received.append(request.url.path)
        return await read_form(request, *args)

    monkeypatch.setattr(uploads, "_read_form", recording_read_form)
    data = tmp_path / "data"
    app = create_app(settings_for(data, max_queued_uploads=2), engine=random_engine)  # each tenant's share: 1 place
    with TestClient(app) as client:
        worker = app.state.service.worker
        with worker.upload_slot("tenantA"):  # an upload of tenant A being received
            response = upload(client, A1, "memo.txt", SECRET)
            assert_error(response, 429, "tenant_queue_full")
            with worker.upload_slot("tenantB"):  # the queue's last place
                assert_error(upload(client, BARE, "memo.txt", SECRET), 503, "busy")
        assert received == [] and list((data / "uploads").iterdir()) == []
        # Uploads that fail once received give their place back: tenant A's one place is free for the next.
        assert_error(upload(client, A1, "memo.txt", SECRET, keep="lots"), 422, "invalid_option")
        assert_error(upload(client, A1, "broken.pdf", b"%PDF-1.7 not really"), 422, "corrupt_pdf")
        not_multipart = client.post("/v1/documents", content=SECRET, headers={**A1, "content-type": "text/plain"})
        assert_error(not_multipart, 415, "multipart_required")
        assert upload_ready(client, A1, "memo.txt", SECRET)
        assert len(received) == 3 and list((data / "uploads").iterdir()) == []


# Storage truth -----------------------------------------------------------------------------------


def test_refuses_to_start_on_a_data_directory_it_cannot_use(random_engine: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError) as failure:
        create_app(settings_for(blocker / "data"), engine=random_engine)
    assert str(blocker / "data") in str(failure.value) and "Not a directory" in str(failure.value)

    read_only_dir = tmp_path / "read-only"
    read_only_dir.mkdir()
    with read_only(read_only_dir), pytest.raises(ConfigError) as failure:
        create_app(settings_for(read_only_dir), engine=random_engine)
    assert str(read_only_dir) in str(failure.value)
    assert re.search(r"Permission denied|Operation not permitted|Read-only", str(failure.value)), failure.value

    with (
        running(random_engine, tmp_path / "shared"),
        pytest.raises(ConfigError, match="another server process is using it\\); stop that server"),
    ):
        create_app(settings_for(tmp_path / "shared"), engine=random_engine)
    with running(random_engine, tmp_path / "shared") as client:  # the lock is released at shutdown
        assert client.get("/healthz").status_code == 200


def test_write_failures_are_507_and_keep_nothing(client: TestClient, tmp_path: Path) -> None:
    documents = tmp_path / "data" / "documents"
    with read_only(documents):
        error = assert_error(upload(client, A1, "memo.txt", SECRET), 507, "storage_error")
        assert "could not save the upload" in error["message"] and "nothing was kept" in error["message"]
    with read_only(tmp_path / "data" / "uploads"):
        assert_error(upload(client, A1, "memo.txt", SECRET), 507, "storage_error")
    assert ids(client, A1) == set() and list(documents.iterdir()) == []
    assert list((tmp_path / "data" / "uploads").iterdir()) == []
    assert upload_ready(client, A1, "memo.txt", SECRET)  # and it works again once the disk does


def test_a_ready_status_the_disk_refuses_says_the_cache_was_saved(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache was saved, then its ready status could not be: the document failed saying "nothing was kept"."""
    from infokv_rag.service.registry import Registry

    write_meta = Registry._write_meta

    def full_at_ready(registry: Registry, record: Any) -> None:
        if record.status == "ready":
            raise OSError(28, "No space left on device")
        write_meta(registry, record)

    monkeypatch.setattr(Registry, "_write_meta", full_at_ready)
    doc = upload(client, A1, "memo.txt", SECRET).json()["id"]
    settled = wait_settled(client, doc, A1)
    assert (settled["status"], settled["reason_code"]) == ("failed", "storage_error"), settled
    assert "its cache was saved but cannot be marked ready" in settled["reason"]
    assert "nothing was kept" not in settled["reason"]


def test_a_status_the_disk_refuses_is_not_shown_either(random_engine: Any, tmp_path: Path) -> None:
    """A lost cache found while the disk refuses the document's new status: 507, and the document stays as its
    files say (ready); the next question, once the disk allows it, has it read again."""
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        doc = upload_ready(client, A1, "memo.txt", SECRET)
    _tensors(data, doc).unlink()
    with running(random_engine, data) as client:
        with read_only(data / "documents" / doc):
            error = assert_error(ask(client, A1, doc), 507, "storage_error")
            assert "could not save the document's status" in error["message"]
            assert client.get(f"/v1/documents/{doc}", headers=A1).json()["status"] == "ready"
        assert_error(ask(client, A1, doc), 409, "cache_rebuilding")
        assert wait_settled(client, doc, A1)["status"] == "ready"
        assert ask(client, A1, doc).status_code == 200


def test_an_upload_killed_before_it_was_listed_leaves_nothing_after_a_restart(
    random_engine: Any, tmp_path: Path
) -> None:
    """What a kill between an upload's text and its meta file leaves (the text alone) is removed at the restart:
    the upload was never listed nor answered to its uploader, and nobody could see or delete it."""
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        doc = upload_ready(client, A1, "memo.txt", SECRET)
    half_made = data / "documents" / ("doc_" + "h" * 22)
    half_made.mkdir()
    shutil.copy(data / "documents" / doc / "document.json", half_made / "document.json")
    with running(random_engine, data) as client:
        assert ids(client, ADMIN) == {doc}
    assert not half_made.exists() and (data / "documents" / doc / "document.json").exists()


def test_damaged_saved_text_fails_its_document_and_is_never_answered_from(random_engine: Any, tmp_path: Path) -> None:
    """document.json, the text a lost cache is made from again, is checked against the sha256 recorded at upload:
    one digit changed on disk fails the document (`unreadable_document`: upload it again) instead of being read into
    a cache and answered from. A document saved before that sha256 was recorded is read unchecked, as it was."""
    data = tmp_path / "data"
    with running(random_engine, data) as client:
        damaged, unchecked = (upload_ready(client, A1, name, SECRET) for name in ("damaged.txt", "unchecked.txt"))
    for doc in (damaged, unchecked):
        shutil.rmtree(data / "documents" / doc / "cache")  # lost: each must be read again from its saved text
    saved = data / "documents" / damaged / "document.json"
    saved.write_bytes(saved.read_bytes().replace(b"9988776", b"9988771"))
    _forget_saved_text_sha256(data, unchecked)
    with running(random_engine, data) as client:
        for doc in (damaged, unchecked):
            assert_error(ask(client, A1, doc), 409, "cache_rebuilding")
        info = wait_settled(client, damaged, A1)
        assert (info["status"], info["reason_code"]) == ("failed", "unreadable_document"), info
        assert "saved text is damaged" in info["reason"] and "upload it again" in info["reason"], info
        assert_error(ask(client, A1, damaged), 409, "document_failed")
        assert not (data / "documents" / damaged / "cache").exists()
        assert wait_settled(client, unchecked, A1)["status"] == "ready"
        assert ask(client, A1, unchecked).status_code == 200


def test_delete_answers_success_only_when_the_files_are_gone(random_engine: Any, tmp_path: Path) -> None:
    data = tmp_path / "data"
    documents = data / "documents"
    with running(random_engine, data) as client:
        doc = upload_ready(client, A1, "memo.txt", SECRET)
        # The directory cannot be renamed aside: nothing changes, and the document keeps answering.
        with read_only(documents):
            error = assert_error(client.delete(f"/v1/documents/{doc}", headers=A1), 507, "storage_error")
            assert "unchanged" in error["message"]
        assert client.get(f"/v1/documents/{doc}", headers=A1).json()["status"] == "ready"
        assert ask(client, A1, doc).status_code == 200
        # Renamed aside, but its cache files cannot be removed: listed as failed, delete_incomplete.
        set_read_only(documents / doc / "cache")
        try:
            error = assert_error(client.delete(f"/v1/documents/{doc}", headers=A1), 507, "storage_error")
        finally:
            set_read_only(documents / f".deleting-{doc}" / "cache", False)  # the delete renamed it aside
        assert "send DELETE again" in error["message"]
        info = client.get(f"/v1/documents/{doc}", headers=A1).json()
        assert (info["status"], info["reason_code"]) == ("failed", "delete_incomplete")
        assert_error(ask(client, A1, doc), 409, "document_failed")
        assert not (documents / doc).exists() and (documents / f".deleting-{doc}" / "meta.json").exists()
        # Once the disk allows it, DELETE again succeeds, and only then: the files are gone.
        assert client.delete(f"/v1/documents/{doc}", headers=A1).status_code == 200
        assert list(documents.iterdir()) == []
        assert_error(client.get(f"/v1/documents/{doc}", headers=A1), 404, "document_not_found")

        other = upload_ready(client, B, "memo.txt", OTHER)
        set_read_only(documents / other / "cache")
        try:
            assert_error(client.delete(f"/v1/documents/{other}", headers=B), 507, "storage_error")
        except BaseException:
            set_read_only(documents / f".deleting-{other}" / "cache", False)
            raise
    # A restart while the files still cannot be removed shows the document as it is ...
    with read_only(documents / f".deleting-{other}" / "cache", already=True), running(random_engine, data) as client:
        info = client.get(f"/v1/documents/{other}", headers=B).json()
        assert (info["status"], info["reason_code"]) == ("failed", "delete_incomplete")
    # ... and the first restart that can remove them finishes the delete.
    with running(random_engine, data) as client:
        assert_error(client.get(f"/v1/documents/{other}", headers=B), 404, "document_not_found")
    assert list(documents.iterdir()) == []


def test_a_refused_delete_leaves_a_document_being_read_to_be_read(random_engine: Any, tmp_path: Path) -> None:
    """A DELETE answered 507 "the document is unchanged" while the document is read, or queued to be, stops
    nothing: both are read to ready, never left listed as being read with no one reading them."""
    data = tmp_path / "data"
    documents = data / "documents"
    with running(random_engine, data) as client:
        with random_engine.lock:  # the worker waits at the first document's first chunk
            reading = upload(client, A1, "memo.txt", SECRET).json()["id"]
            queued = upload(client, A1, "other.txt", OTHER).json()["id"]
            with read_only(documents):
                for doc in (reading, queued):
                    error = assert_error(client.delete(f"/v1/documents/{doc}", headers=A1), 507, "storage_error")
                    assert "unchanged" in error["message"]
        for doc in (reading, queued):
            assert wait_settled(client, doc, A1, timeout=30)["status"] == "ready"
            assert ask(client, A1, doc).status_code == 200


def test_text_encodings_are_stored_as_written(client: TestClient, tmp_path: Path) -> None:
    text = "合同：通知期限为九十天。如果供应商延迟交货，每天罚款五百欧元。"
    doc = upload_ready(client, A1, "gb.txt", text.encode("gb18030"))
    saved = json.loads((tmp_path / "data" / "documents" / doc / "document.json").read_text(encoding="utf-8"))
    assert saved["text"] == text
    mystery = b"Notice: " + bytes([0xC3, 0x80, 0xFE, 0xA1, 0x81, 0x30, 0xE9, 0xFF]) * 3
    error = assert_error(upload(client, A1, "mystery.txt", mystery), 415, "unsupported_format")
    assert "UTF-8" in error["message"]
    assert wait_settled(client, doc, A1)["status"] == "ready"


# The UTF-8 text of a contract, multi-byte characters throughout (a file of mostly ASCII with one stray byte would
# be read as Windows-1252 whole, without a warning).
CLAUSE = "Clause 4.2 \u2014 the fee is 1 200 \u20ac a month, payable in Z\u00fcrich; the caf\u00e9\u2019s lease. "


def test_what_reading_an_upload_warned_about_is_told_to_its_uploader(random_engine: Any, tmp_path: Path) -> None:
    """The loader's warnings (stray Windows-1252 bytes in UTF-8 text; pages skipped) are in the document's info, as
    skipped_pages is: in the 202, in every later GET and listing, after a restart, and without server paths."""
    data = tmp_path / "data"
    head = (CLAUSE * 4).encode("utf-8") + b"The Supplier"
    stray = head + b"\x92s notice is ninety days. " + CLAUSE.encode("utf-8")  # a smart quote pasted in cp1252
    scanned = pdfs.mixed_pdf(tmp_path / "scan.pdf", ["The notice period is ninety days.", None])
    with running(random_engine, data) as client, warnings.catch_warnings(record=True) as issued:
        # Told to the uploader, not issued as Python warnings: each names the upload's staging path, so every upload
        # added one to the registry Python keeps of the warnings it issued, for the life of the server.
        warnings.simplefilter("always")
        created = upload(client, A1, "notes.txt", stray)
        assert created.status_code == 202, created.text
        [warning] = created.json()["warnings"]
        assert "notes.txt" in warning and "1 stray byte" in warning and f"byte offset {len(head)}" in warning
        assert "Windows-1252" in warning and "saving the file as UTF-8" in warning
        assert str(data) not in warning and not any(leak in warning for leak in LEAKS), warning
        notes = created.json()["id"]
        assert wait_settled(client, notes, A1)["warnings"] == [warning]
        # The same file again warns again (the process saw the warning once already).
        again = upload(client, A1, "notes.txt", stray)
        assert again.status_code == 202 and again.json()["warnings"] == [warning]
        pdf = upload(client, A1, "scan.pdf", scanned.read_bytes())
        assert pdf.status_code == 202, pdf.text
        [skipped] = pdf.json()["warnings"]
        assert pdf.json()["skipped_pages"] == [2] and "scan.pdf" in skipped and "ocrmypdf" in skipped, skipped
        assert str(data) not in skipped
        assert not [warning for warning in issued if str(data) in str(warning.message)], issued
        clean = upload_ready(client, A1, "memo.txt", SECRET)
        assert client.get(f"/v1/documents/{clean}", headers=A1).json()["warnings"] == []
        listed = {d["id"]: d["warnings"] for d in client.get("/v1/documents", headers=A1).json()["data"]}
        assert listed[notes] == [warning] and listed[clean] == []
    assert json.loads((data / "documents" / notes / "meta.json").read_text())["warnings"] == [warning]
    with running(random_engine, data) as client:  # read back from the record
        assert client.get(f"/v1/documents/{notes}", headers=A1).json()["warnings"] == [warning]
        assert client.get(f"/v1/documents/{clean}", headers=A1).json()["warnings"] == []
