"""The service's reliability suite (loopback only, bounded in time):

- a fuzz corpus of ~330 damaged, hostile and mislabelled uploads, in-process on a random model: every
  case is accepted (and then settles as ready, or failed with a typed reason) or refused with a typed
  4xx, and the server stays healthy;
- schemathesis against a live server's OpenAPI (tiny model) with two tenants' keys: no 5xx, every
  response as documented, and no tenant ever reads, changes or deletes the other's documents;
- SIGKILL during an upload, an ingestion, a cache save and an SSE answer, each followed by a restart on
  the same data directory: nothing lost, nothing half-written, interrupted documents read to ready.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

import hypothesis  # noqa: E402
import schemathesis  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.result import Err, Ok  # noqa: E402
from schemathesis.errors import InvalidSchema  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from infokv_rag.evaluation import make_fact_document  # noqa: E402
from infokv_rag.service.app import create_app  # noqa: E402
from infokv_rag.service.launcher import ServerProcess, read_sse  # noqa: E402
from infokv_rag.service.settings import Settings  # noqa: E402

from .fuzz_corpus import corpus  # noqa: E402
from .service_helpers import (  # noqa: E402
    ADMIN_ENTRY,
    bearer,
    send_part_of_an_upload,
    server_counters,
    upload,
    upload_ready,
    wait_settled,
)

KEY_A, KEY_B = "reliability-key-tenant-a", "reliability-key-tenant-b"
A, B = bearer(KEY_A), bearer(KEY_B)
FAULTS = Path(__file__).resolve().parent / "faults"

# What a client may be told about an upload it sent, by status.
TYPED_REFUSALS = {
    400: {"bad_request"},
    413: {
        "request_too_large",
        "file_too_large",
        "too_many_pages",
        "too_much_content",
        "too_many_characters",
        "document_too_long",
    },
    415: {"unsupported_format"},
    422: {"encrypted_pdf", "no_text", "empty_document", "corrupt_pdf", "unreadable_document", "invalid_option"},
}
TYPED_FAILURES = set().union(*TYPED_REFUSALS.values()) | {"context_length_exceeded"}


# Fuzz corpus -------------------------------------------------------------------------------------


def test_fuzzed_uploads_get_typed_answers_and_the_server_stays_healthy(random_engine: Any, tmp_path: Path) -> None:
    cases = corpus(tmp_path)
    assert len(cases) >= 300
    settings = Settings(
        api_keys=(f"tenantA:{KEY_A}",),
        data_dir=tmp_path / "data",
        model="random",
        warmup=False,
        max_pages=20,
        max_upload_bytes=4 << 20,
        max_queued_uploads=len(cases),  # one tenant sends them all, as fast as it can: no queue may refuse one
        max_queued_uploads_per_tenant=len(cases),
        default_method="snapkv",
        max_new_tokens=4,
        default_max_tokens=2,
    )
    outcomes: Counter[str] = Counter()
    slowest = (0.0, "")
    accepted: list[tuple[str, str]] = []
    with TestClient(create_app(settings, engine=random_engine), raise_server_exceptions=False) as client:
        for index, (label, name, data) in enumerate(cases):
            started = time.perf_counter()
            response = upload(client, A, name, data)
            slowest = max(slowest, (time.perf_counter() - started, label))
            assert response.status_code < 500, (label, response.status_code, response.text)
            body = response.json()
            if response.status_code == 202:
                accepted.append((label, body["id"]))
                outcomes["accepted"] += 1
            else:
                error = body["error"]
                assert error["code"] in TYPED_REFUSALS.get(response.status_code, set()), (label, body)
                assert error["message"] and "Traceback" not in error["message"], (label, body)
                outcomes[f"{response.status_code} {error['code']}"] += 1
            if index % 50 == 0:
                assert client.get("/healthz").json()["status"] == "ok"
        received = time.perf_counter()
        for label, doc_id in accepted:
            info = wait_settled(client, doc_id, A)
            if info["status"] == "failed":
                assert info["reason_code"] in TYPED_FAILURES, (label, info)
                outcomes[f"failed later {info['reason_code']}"] += 1
        # Still healthy and still working: an ordinary document is read and answered.
        assert client.get("/healthz").json()["status"] == "ok"
        good = upload_ready(client, A, "memo.txt", b"The office closes at five on Fridays.")
        answer = client.post(f"/v1/documents/{good}/ask", json={"question": "When?", "max_tokens": 2}, headers=A)
        assert answer.status_code == 200, answer.text
        settled = time.perf_counter() - received
    print(
        f"{len(cases)} fuzzed uploads: {dict(sorted(outcomes.items()))}; slowest {slowest[0]:.2f} s ({slowest[1]}); "
        f"{settled:.1f} s for the accepted ones to settle"
    )
    # The corpus really exercises acceptance and each kind of refusal.
    assert outcomes["accepted"] > 10 and outcomes["415 unsupported_format"] and outcomes["422 no_text"]
    assert outcomes["422 corrupt_pdf"] and outcomes["422 encrypted_pdf"] and outcomes["422 empty_document"]
    assert slowest[0] < 30, slowest


# Schemathesis, two tenants -----------------------------------------------------------------------

SECRETS = {"A": "The vault code of tenant A is 9988776.", "B": "The locker code of tenant B is 5544332."}
LIVE_LIMITS = {
    "max_upload_bytes": 4096,
    "max_pages": 3,
    "max_question_chars": 200,
    "max_new_tokens": 8,
    "default_max_tokens": 4,
    "max_queued_uploads": 4,
    "default_method": "snapkv",
    "warmup": False,
}
EXAMPLES_PER_OPERATION = 12


@pytest.fixture(scope="module")
def two_tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A live tiny-model server with one ready document per tenant."""
    root = tmp_path_factory.mktemp("schemathesis")
    server = ServerProcess(
        "tiny",
        root / "data",
        api_keys=[f"tenantA:{KEY_A}", f"tenantB:{KEY_B}"],
        settings=LIVE_LIMITS,
        log_path=root / "server.log",
    )
    server.start()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        docs = {
            name: upload_ready(client, headers, f"{name}.txt", SECRETS[name].encode())
            for name, headers in (("A", A), ("B", B))
        }
    yield {"server": server, "docs": docs, "turn": iter(range(10**9)), "seen": Counter()}
    server.stop()


def _send_as_a_tenant(case: Any, two_tenants: dict[str, Any]) -> None:
    """Sends a generated request as tenant A or B (alternating), aimed at the caller's own document, the
    other tenant's, or an unknown id: no 5xx, responses as documented, nothing of the other tenant's."""
    turn = next(two_tenants["turn"])
    me, other = ("A", "B") if turn % 2 == 0 else ("B", "A")
    docs = two_tenants["docs"]
    target = None
    if case.meta is None or not case.meta.generation.mode.is_negative:  # negative cases keep their bad values
        # Deleting one's own seed document would leave nothing to probe: only the other's or unknown ids.
        targets = [docs[other], "doc_" + "u" * 22] + ([] if case.method.upper() == "DELETE" else [docs[me]])
        choice = targets[(turn // 2) % len(targets)]
        if case.path_parameters and "document_id" in case.path_parameters:
            case.path_parameters["document_id"] = target = choice
        if isinstance(case.body, dict) and "document_id" in case.body:
            case.body["document_id"] = target = choice
            case.body["model"] = "tiny"
    key = KEY_A if me == "A" else KEY_B
    response = case.call_and_validate(
        headers={"Authorization": f"Bearer {key}", "X-API-Key": key},
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
        timeout=120,
    )
    assert docs[other] not in response.text and SECRETS[other] not in response.text, (me, case.path, response.text)
    aimed = {docs[other]: "others", docs[me]: "own", None: "-"}.get(target, "unknown")
    two_tenants["seen"][f"{case.method.upper()} {case.path} {aimed} -> {response.status_code}"] += 1


def _operation(result: Ok[schemathesis.APIOperation] | Err[InvalidSchema]) -> schemathesis.APIOperation:
    """An operation of the schema; one that schemathesis could not read fails the test."""
    if isinstance(result, Err):
        raise AssertionError(f"schemathesis could not read an operation: {result.err()}")
    return result.ok()


def test_schema_with_two_tenants(two_tenants: dict[str, Any]) -> None:
    """Schemathesis cases (valid and invalid) for every operation of the live server's OpenAPI schema.

    (Driven through `as_strategy` rather than schemathesis' pytest plugin, whose lazy fixture loading does
    not work with pytest 9.)"""
    schema = schemathesis.openapi.from_url(two_tenants["server"].url + "/openapi.json")
    operations = [_operation(result) for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/documents",
        "/v1/documents/{document_id}",
        "/v1/documents/{document_id}/ask",
        "/v1/chat/completions",
    }
    for operation in operations:
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.path.startswith("/v1/") and operation.method.upper() == "POST" or "{" in operation.path:
            modes.append(schemathesis.GenerationMode.NEGATIVE)  # (operations without inputs have no invalid ones)
        strategy = hypothesis.strategies.one_of(*(operation.as_strategy(generation_mode=mode) for mode in modes))

        @hypothesis.given(case=strategy)
        @hypothesis.settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(hypothesis.HealthCheck),
            phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
        )
        def run(case: Any) -> None:
            _send_as_a_tenant(case, two_tenants)

        run()
    seen = two_tenants["seen"]
    print("schemathesis requests:", dict(sorted(seen.items())))
    assert sum(seen.values()) >= 5 * len(operations)
    probes = {key: count for key, count in seen.items() if " others -> " in key}
    # Refused before the document is looked up (400 on OpenAI's route, 422 on the others), or 404 as unknown.
    refusals = {key for key in probes if key.startswith("POST /v1/chat/completions") and key.endswith("-> 400")}
    assert probes and all(key.endswith(("-> 404", "-> 422", "-> 401")) for key in set(probes) - refusals), probes


def test_after_schemathesis_each_tenant_still_owns_exactly_its_documents(two_tenants: dict[str, Any]) -> None:
    docs = two_tenants["docs"]
    with httpx.Client(base_url=two_tenants["server"].url, timeout=60) as client:
        for me, headers in (("A", A), ("B", B)):
            listing = client.get("/v1/documents", headers=headers).json()["data"]
            assert {d["owner"] for d in listing} == {f"tenant{me}"}, listing
            assert docs[me] in {d["id"] for d in listing}  # the other tenant could not delete it
            info = client.get(f"/v1/documents/{docs[me]}", headers=headers).json()
            assert info["status"] == "ready", info
        assert client.get("/healthz").json()["status"] == "ok"


# SIGKILL and restart -----------------------------------------------------------------------------

KILL_LIMITS = {
    "max_new_tokens": 64,
    "default_max_tokens": 8,
    "ingest_chunk_size": 32,
    "default_method": "snapkv",
    "warmup": False,
}
QUESTION = {"question": "What is the code?", "max_tokens": 8}


def _leftovers(data: Path) -> list[str]:
    """Anything a half-done operation can leave: staged uploads, temporary files, cache staging, deletions."""
    found = [str(p.relative_to(data)) for p in (data / "uploads").iterdir()]
    for entry in (data / "documents").iterdir():
        if not entry.name.startswith("doc_"):
            found.append(entry.name)
            continue
        found += [
            f"{entry.name}/{p.name}" for p in entry.iterdir() if p.name not in ("meta.json", "document.json", "cache")
        ]
    return found


def _answer(client: httpx.Client, doc_id: str) -> str:
    response = client.post(f"/v1/documents/{doc_id}/ask", json=QUESTION, headers=A)
    assert response.status_code == 200, response.text
    return str(response.json()["answer"])


def _wait_for(predicate: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_sigkill_at_every_stage_then_restart(tmp_path: Path) -> None:
    """Kill 1 lands while an upload is being received, another is being read (prefill) and an answer is
    streaming; kill 2 inside a cache save (held there by tests/faults/sitecustomize.py). After each restart
    on the same data directory: the ready document answers as before, the interrupted ones are read to
    ready, the half-received upload left nothing, and no temporary or half-written file remains."""
    data = tmp_path / "data"
    marker = tmp_path / "save-started"
    server = ServerProcess(
        "tiny",
        data,
        api_keys=[f"tenantA:{KEY_A}"],
        admin_keys=[ADMIN_ENTRY],
        settings=KILL_LIMITS,
        log_path=tmp_path / "server.log",
        env={"PYTHONPATH": str(FAULTS), "INFOKV_TEST_PAUSE_SAVE": str(marker)},
    )
    long_text = make_fact_document(seed=11, target_words=300).text.encode()  # ~400 tokens: a dozen chunks
    server.start()
    client = httpx.Client(base_url=server.url, timeout=120)
    try:
        base = upload_ready(client, A, "base.txt", SECRETS["A"].encode())
        reference = _answer(client, base)

        def restart() -> dict[str, Any]:
            server.kill()
            server.start()
            client.base_url = httpx.URL(server.url)
            assert _answer(client, base) == reference  # the ready document answers as before, from its saved cache
            return {d["id"]: d for d in client.get("/v1/documents", headers=A).json()["data"]}

        # Kill 1: an upload half received, another being read, an answer streaming.
        created = upload(client, A, "long.txt", long_text)
        assert created.status_code == 202, created.text
        reading = created.json()["id"]
        _wait_for(
            lambda: client.get(f"/v1/documents/{reading}", headers=A).json()["progress"]["tokens_done"] > 0,
            "the prefill to start",
        )
        request = {"question": "Write a long story about the vault.", "max_tokens": 64, "stream": True}
        with client.stream("POST", f"/v1/documents/{base}/ask", json=request, headers=A) as stream:
            events = read_sse(stream.iter_lines())
            assert next(events)[0] == "token"
            with send_part_of_an_upload(server.port, KEY_A, long_text):
                time.sleep(0.3)
                assert client.get(f"/v1/documents/{reading}", headers=A).json()["status"] == "processing"
                documents = restart()
        assert set(documents) == {base, reading}  # nothing of the half-received upload
        assert wait_settled(client, reading, A)["status"] == "ready"
        assert server_counters(client)["prefills"] == 1  # read again, once
        assert _leftovers(data) == [], _leftovers(data)
        _answer(client, reading)

        # Kill 2: inside a cache save, after its tensors and text were written but not its manifest.
        saving = upload(client, A, "saving.txt", b"Memo PAUSE-THIS-SAVE: the archive is on the third floor.")
        saving_id = saving.json()["id"]
        _wait_for(marker.exists, "the cache save to begin")
        marker.unlink()
        server.kill()
        half = [p.name for p in (data / "documents" / saving_id).iterdir()]
        assert any(name.startswith(".cache.saving-") for name in half) and "cache" not in half, half
        server.extra_env.pop("INFOKV_TEST_PAUSE_SAVE")  # the next save of it runs through
        server.start()
        client.base_url = httpx.URL(server.url)
        assert wait_settled(client, saving_id, A)["status"] == "ready"
        assert _leftovers(data) == [], _leftovers(data)
        documents = {d["id"]: d for d in client.get("/v1/documents", headers=A).json()["data"]}
        assert set(documents) == {base, reading, saving_id}
        assert all(d["status"] == "ready" for d in documents.values()), documents
        assert _answer(client, base) == reference
        for doc_id in (reading, saving_id):
            _answer(client, doc_id)
    finally:
        client.close()
        server.stop()
