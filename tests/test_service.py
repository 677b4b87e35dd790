"""Acceptance tests of the HTTP service: the real server (uvicorn in a subprocess) with the tiny model.

One server runs for the module (tiny model, small limits, a tmp data directory); the last test restarts it
on the same data directory and proves that a ready document is answered without a prefill.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from infokv_rag.evaluation import make_fact_document
from infokv_rag.service.launcher import ServerProcess, read_sse

from . import pdf_factory as pdfs
from .service_helpers import (
    ADMIN_ENTRY,
    ADMIN_KEY,
    admin_health,
    assert_answer_cancelled,
    assert_error,
    bearer,
    hang_up_after_first_token,
    server_counters,
    wait_answer_ended,
)

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam

pytestmark = pytest.mark.tiny

KEYS = ("test-key-alpha-0001", "test-key-beta-0002")
KEY = KEYS[0]
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = {
    "max_upload_bytes": 200_000,
    "max_pages": 5,
    "max_pdf_content_bytes": 1_000_000,
    "max_question_chars": 300,
    "max_new_tokens": 64,
    "default_max_tokens": 16,
}
PAGES = [
    "Supply contract between Acme Tools and Beta Logistics.\nThe notice period is ninety days.\n"
    "The penalty for late delivery is 500 euros.",
    "The contract manager is Alice Smith.\nAll disputes are settled in the courts of Lyon.",
]
QUESTION = "What is the notice period?"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)

# Fixtures and helpers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("service")
    process = ServerProcess(
        "tiny", root / "data", api_keys=KEYS, admin_keys=[ADMIN_ENTRY], settings=LIMITS, log_path=root / "server.log"
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        yield http


def upload(
    client: httpx.Client, name: str, data: bytes, headers: dict[str, str] | None = None, **fields: str
) -> httpx.Response:
    return client.post(
        "/v1/documents", files={"file": (name, data)}, data=fields, headers=AUTH if headers is None else headers
    )


def wait_ready(client: httpx.Client, doc_id: str, timeout: float = 120) -> tuple[dict[str, Any], list[str]]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.get(f"/v1/documents/{doc_id}", headers=AUTH).json()
        if not seen or seen[-1] != info["status"]:
            seen.append(info["status"])
        if info["status"] in ("ready", "failed"):
            return info, seen
        time.sleep(0.2)
    raise AssertionError(f"document {doc_id} not ready after {timeout} s (statuses {seen})")


def ask(client: httpx.Client, doc_id: str, question: str = QUESTION, **options: Any) -> httpx.Response:
    return client.post(f"/v1/documents/{doc_id}/ask", json={"question": question, **options}, headers=AUTH)


@pytest.fixture(scope="module")
def contract(client: httpx.Client, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The contract PDF, uploaded and read: its ready status and the statuses seen on the way."""
    path = pdfs.text_pdf(tmp_path_factory.mktemp("pdf") / "contract.pdf", PAGES)
    response = upload(client, "contract.pdf", path.read_bytes(), method="infokv", keep="0.5")
    assert response.status_code == 202, response.text
    created = response.json()
    assert response.headers["location"] == f"/v1/documents/{created['id']}"
    assert created["status"] in ("queued", "processing") and created["pages"] == 2 and created["tokens"] > 0
    info, seen = wait_ready(client, created["id"])
    assert info["status"] == "ready", info
    return {"info": info, "seen": seen, "path": path}


# Open endpoints ----------------------------------------------------------------------------------


def test_a_header_of_a_mebibyte_is_refused_before_it_is_read_whole(server: ServerProcess) -> None:
    """httptools, uvicorn's default where installed, read a header of 128 MiB (30 s of the event loop, every client
    waiting) before any key was checked; h11 refuses what passes 16 KiB unparsed."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        try:
            connection.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
            answer = connection.recv(4096)
        except (ConnectionResetError, BrokenPipeError):  # closed before the whole header was sent
            answer = b""
    assert answer.startswith(b"HTTP/1.1 4") or answer == b"", answer[:200]
    assert httpx.get(server.url + "/healthz", timeout=30).status_code == 200
    # The socket is bound before the model loads, and where it listens is still logged (port 0: the port picked).
    assert f"Uvicorn running on http://127.0.0.1:{server.port}" in server.log_tail(1_000_000)


def test_health_page_and_openapi_are_open(client: httpx.Client) -> None:
    # Liveness for anyone; what the server does (it counts every tenant's work) for an admin key only.
    for headers in ({}, AUTH):
        body = client.get("/healthz", headers=headers).json()
        assert body["status"] == "ok" and body["model"] == "tiny" and body["uptime_seconds"] > 0
        assert not {"documents", "queue", "counters"} & set(body), body
    assert_error(client.get("/healthz", headers=bearer("not-a-key-0000000")), 401, "invalid_api_key")
    admin = client.get("/healthz", headers=bearer(ADMIN_KEY)).json()
    assert {"documents", "queue", "counters"} <= set(admin) and "prefills" in admin["counters"]
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    # The answer length starts at this server's default, within its limit: a first Ask is never refused for it.
    assert 'max="64" value="16"' in page.text
    assert "script-src 'sha256-" in page.headers["content-security-policy"]
    schema = client.get("/openapi.json").json()
    expected = {
        ("/v1/documents", "post"),
        ("/v1/documents", "get"),
        ("/v1/documents/{document_id}", "get"),
        ("/v1/documents/{document_id}", "delete"),
        ("/v1/documents/{document_id}/ask", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/healthz", "get"),
        ("/", "get"),
    }
    documented = {(path, method) for path, item in schema["paths"].items() for method in item}
    assert expected <= documented
    for path, method in expected:
        assert schema["paths"][path][method].get("summary"), (path, method)
    upload_body = schema["paths"]["/v1/documents"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert {"file", "method", "keep"} <= set(upload_body["schema"]["properties"])
    limits = upload_body["schema"]["properties"]["file"]["description"]
    assert "200000 bytes, 5 pages, 1000000 bytes of decoded page content" in limits  # this server's own (LIMITS)
    assert {"HTTPBearer", "APIKeyHeader"} <= set(schema["components"]["securitySchemes"])


# API keys ----------------------------------------------------------------------------------------


def test_api_keys(client: httpx.Client) -> None:
    listing = "/v1/documents"
    missing = assert_error(client.get(listing), 401, "missing_api_key")
    assert "X-API-Key" in missing["message"]
    assert_error(client.get(listing, headers={"Authorization": "Bearer wrong-key-0000000"}), 401, "invalid_api_key")
    assert_error(client.get(listing, headers={"X-API-Key": KEY + "x"}), 401, "invalid_api_key")
    assert_error(client.get(listing, headers={"X-API-Key": KEY[:-1]}), 401, "invalid_api_key")
    assert_error(client.get(listing, headers={"Authorization": f"Basic {KEY}"}), 401, "invalid_api_key")
    assert client.get(listing, headers={"Authorization": f"Bearer {KEYS[1]}"}).status_code == 200
    assert client.get(listing, headers={"X-API-Key": KEY}).status_code == 200
    response = client.get(listing)
    assert response.headers["www-authenticate"].startswith("Bearer")
    # Every /v1 endpoint is protected, uploads before their body is read.
    assert_error(upload(client, "a.txt", b"hello", headers={}), 401, "missing_api_key")
    assert_error(client.post("/v1/chat/completions", json={}), 401, "missing_api_key")
    assert_error(client.get("/v1/models"), 401, "missing_api_key")
    assert_error(client.delete("/v1/documents/doc_aaaaaaaaaaaaaaaaaaaaaa"), 401, "missing_api_key")


# Bad uploads and limits --------------------------------------------------------------------------


def test_bad_uploads_get_clear_errors(client: httpx.Client, tmp_path: Path) -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    error = assert_error(upload(client, "scan.pdf", png), 415, "unsupported_format")
    assert "scan.pdf" in error["message"] and "PNG" in error["message"]
    assert_error(upload(client, "report.docx", b"PK\x03\x04" + bytes(300)), 415, "unsupported_format")
    encrypted = pdfs.encrypted_pdf(tmp_path / "locked.pdf", PAGES, user_password="s3cret")
    error = assert_error(upload(client, "locked.pdf", encrypted.read_bytes()), 422, "encrypted_pdf")
    assert "password" in error["message"]
    assert_error(upload(client, "locked.pdf", encrypted.read_bytes(), password="nope"), 422, "encrypted_pdf")
    scanned = pdfs.image_only_pdf(tmp_path / "scanned.pdf")
    error = assert_error(upload(client, "scanned.pdf", scanned.read_bytes()), 422, "no_text")
    assert "OCR" in error["message"]
    assert_error(upload(client, "empty.pdf", b""), 422, "empty_document")
    assert_error(upload(client, "blank.txt", b" \n\t \n"), 422, "empty_document")
    truncated = pdfs.truncated_pdf(tmp_path / "cut.pdf", PAGES)
    assert_error(upload(client, "cut.pdf", truncated.read_bytes()), 422, "corrupt_pdf")
    assert_error(upload(client, "a.txt", b"Some text.", method="magic"), 422, "invalid_option")
    assert_error(upload(client, "a.txt", b"Some text.", keep="2.5"), 422, "invalid_option")
    assert_error(upload(client, "a.txt", b"Some text.", keep="lots"), 422, "invalid_option")
    no_file = client.post("/v1/documents", data={"method": "infokv"}, files={"other": ("x", b"y")}, headers=AUTH)
    assert_error(no_file, 422, "missing_file")
    assert_error(client.post("/v1/documents", json={"file": "x"}, headers=AUTH), 415, "multipart_required")
    body, sent_as = httpx.Request("POST", "/", files={"file": ("a.txt", b"Some text.")}), "multipart/form-data"
    for media_type in ("multipart/form-dataX", "multipart/form-data-v2", "MULTIPART/FORM-DATA;"):
        headers = {**AUTH, "content-type": body.headers["content-type"].replace(sent_as, media_type, 1)}
        response = client.post("/v1/documents", content=body.read(), headers=headers)
        if media_type.startswith("MULTIPART"):  # another case, a parameter list: the same type
            assert response.status_code == 202, response.text
            client.delete(f"/v1/documents/{response.json()['id']}", headers=AUTH)
        else:
            assert_error(response, 415, "multipart_required")
    # Nothing was kept of any refused upload.
    assert client.get("/v1/documents", headers=AUTH).json()["data"] == []


def test_upload_limits_are_413(client: httpx.Client, tmp_path: Path) -> None:
    error = assert_error(upload(client, "big.txt", b"word " * 50_000), 413, "file_too_large")  # 250 KB > 200 KB
    assert "limit" in error["message"]
    huge = b"word " * 200_000  # 1 MB: refused from its Content-Length, before the body is read
    assert_error(upload(client, "huge.txt", huge), 413, "request_too_large")
    six_pages = pdfs.text_pdf(tmp_path / "long.pdf", [f"Page {i} text." for i in range(6)])
    error = assert_error(upload(client, "long.pdf", six_pages.read_bytes()), 413, "too_many_pages")
    assert "6 pages" in error["message"] and "5" in error["message"]
    heavy = pdfs.heavy_content_pdf(tmp_path / "heavy.pdf", 2, 600_000)  # 2 pages of 600 KB content: 2 KB
    error = assert_error(upload(client, "heavy.pdf", heavy.read_bytes()), 413, "too_much_content")
    assert "1,000,000 bytes" in error["message"] and str(tmp_path) not in error["message"]
    long_text = make_fact_document(seed=3, target_words=9000).text.encode()[:190_000]  # > 8K tokens
    error = assert_error(upload(client, "novel.txt", long_text), 413, "document_too_long")
    assert "context window" in error["message"]


# The happy path ----------------------------------------------------------------------------------


def test_upload_polls_to_ready_with_sizes(client: httpx.Client, contract: dict[str, Any]) -> None:
    info = contract["info"]
    assert contract["seen"][-1] == "ready" and set(contract["seen"]) <= {"queued", "processing", "ready"}
    assert info["filename"] == "contract.pdf" and info["pages"] == 2 and info["skipped_pages"] == []
    assert info["method"] == "infokv" and info["keep"] == 0.5
    assert info["tokens"] > 50 and info["kept_tokens"] > 0
    assert 0 < info["cache_bytes"] < info["full_cache_bytes"]
    assert info["progress"]["fraction"] == 1.0 and info["cache_origin"] == "prefill"
    assert info["reason"] is None
    listing = client.get("/v1/documents", headers=AUTH).json()
    assert [d["id"] for d in listing["data"]] == [info["id"]]


def test_ask_json_and_sse_stream_agree(client: httpx.Client, contract: dict[str, Any]) -> None:
    doc_id = contract["info"]["id"]
    response = ask(client, doc_id, max_tokens=12)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["document_id"] == doc_id and body["answer"].strip()
    # (What the tiny model answers depends on the compression; the core's tests judge quality, not these.)
    usage = body["usage"]
    assert usage["cached_tokens"] == contract["info"]["tokens"] and 0 < usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["cached_tokens"] + usage["completion_tokens"]
    assert body["finish_reason"] in ("stop", "length")
    assert body["timings"]["total_seconds"] > 0 and body["timings"]["time_to_first_token"] > 0

    request = {"question": QUESTION, "max_tokens": 12, "stream": True}
    with client.stream("POST", f"/v1/documents/{doc_id}/ask", json=request, headers=AUTH) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = list(read_sse(stream.iter_lines()))
    names = [name for name, _ in events]
    assert names.count("done") == 1 and names[-1] == "done" and set(names) == {"token", "done"}
    assert names.count("token") >= 2  # token by token
    streamed = "".join(json.loads(data)["text"] for name, data in events if name == "token")
    done = json.loads(events[-1][1])
    assert streamed == done["answer"] == body["answer"]  # greedy: the same answer either way
    assert done["usage"] == usage


def test_ask_errors(client: httpx.Client, contract: dict[str, Any]) -> None:
    doc_id = contract["info"]["id"]
    error = assert_error(ask(client, doc_id, "why? " * 100), 413, "question_too_long")
    assert "300" in error["message"] and error["param"] == "question"
    assert_error(ask(client, doc_id, max_tokens=65), 422, "max_tokens_too_large")
    assert_error(ask(client, doc_id, max_tokens=0), 422, "invalid_request")
    assert assert_error(ask(client, doc_id, ""), 422, "empty_message")["param"] == "question"
    assert_error(ask(client, doc_id, temperature=-1), 422, "invalid_request")
    assert_error(ask(client, doc_id, stop=["a"] * 5), 422, "invalid_request")
    assert_error(ask(client, doc_id, colour="blue"), 422, "invalid_request")
    no_json = client.post(f"/v1/documents/{doc_id}/ask", content=b"{nope", headers=AUTH)  # no content-type: not read
    error = assert_error(no_json, 422, "invalid_request")
    assert "no content-type" in error["message"] and "application/json" in error["message"], error
    as_text = client.post(
        f"/v1/documents/{doc_id}/ask", content=b'{"question": "Who?"}', headers={**AUTH, "content-type": "text/plain"}
    )
    assert "content-type 'text/plain'" in assert_error(as_text, 422, "invalid_request")["message"]
    json_headers = {**AUTH, "content-type": "application/json"}
    bad_json = client.post(f"/v1/documents/{doc_id}/ask", content=b"{nope", headers=json_headers)
    error = assert_error(bad_json, 400, "invalid_json")
    assert error["param"] is None and "line 1, column 2" in error["message"], error
    assert_error(ask(client, "doc_" + "a" * 22), 404, "document_not_found")
    for bad_id in ("..", "doc_..%2F..%2Fetc", "%2e%2e", "doc_" + "a" * 200):
        response = client.get(f"/v1/documents/{bad_id}", headers=AUTH)
        assert response.status_code == 404, (bad_id, response.text)
        assert response.headers["content-type"].startswith("application/json")
    assert_error(client.delete("/v1/documents/doc_" + "b" * 22, headers=AUTH), 404, "document_not_found")
    assert_error(
        client.post(f"/v1/documents/{doc_id}/ask", content=b"x" * 2_000_000, headers=AUTH), 413, "request_too_large"
    )


# OpenAI compatibility ----------------------------------------------------------------------------


def test_openai_client_chat_completions(server: ServerProcess, contract: dict[str, Any]) -> None:
    import openai

    doc_id = contract["info"]["id"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Who is the contract manager?"},
    ]
    completion = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"document_id": doc_id},
    )
    text = completion.choices[0].message.content
    assert text and text.strip() and completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == contract["info"]["tokens"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"document_id": doc_id},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2 and "".join(pieces) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == completion.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == usage.completion_tokens

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-key-000000", max_retries=0).models.list()
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as missing:  # no document_id
        client.chat.completions.create(model="tiny", messages=messages)
    assert missing.value.param == "document_id"
    # What this server cannot do is refused, not ignored: a client would rely on a tool call, JSON or logprobs.
    unsupported: list[dict[str, Any]] = [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"},
        {"response_format": {"type": "json_object"}},
        {"logprobs": True, "top_logprobs": 2},
    ]
    for extra in unsupported:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=messages, extra_body={"document_id": doc_id, **extra})
        assert refused.value.code == "unsupported_parameter" and refused.value.param in extra
    with pytest.raises(openai.BadRequestError):  # the server's own limit on max_tokens
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=100_000, extra_body={"document_id": doc_id}
        )
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"document_id": "doc_" + "z" * 22})
    assert "no document" in str(unknown.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=messages, extra_body={"document_id": doc_id})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "assistant", "content": "Hi"}], extra_body={"document_id": doc_id}
        )


# Scheduling --------------------------------------------------------------------------------------


def test_client_disconnect_cancels_generation(client: httpx.Client, contract: dict[str, Any]) -> None:
    before = server_counters(client)
    request = {"question": "Write a very long story about this contract.", "max_tokens": 64, "stream": True}
    with client.stream("POST", f"/v1/documents/{contract['info']['id']}/ask", json=request, headers=AUTH) as stream:
        hang_up_after_first_token(stream)
    assert_answer_cancelled(wait_answer_ended(lambda: admin_health(client), before), before)


def test_prefill_does_not_block_answers_and_delete_cancels_it(
    server: ServerProcess, client: httpx.Client, contract: dict[str, Any]
) -> None:
    before = server_counters(client)
    long_text = make_fact_document(seed=5, target_words=1100).text.encode()
    created = upload(client, "long.txt", long_text, method="snapkv", keep="256")
    assert created.status_code == 202, created.text
    long_id = created.json()["id"]
    assert created.json()["tokens"] > 1200  # several prefill chunks of 256 tokens
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        info = client.get(f"/v1/documents/{long_id}", headers=AUTH).json()
        if info["status"] == "processing" and info["progress"]["tokens_done"] > 0:
            break
        time.sleep(0.05)
    assert info["status"] == "processing" and 0 < info["progress"]["fraction"] < 1, info
    # An answer about the ready document is served while the upload is read, chunk by chunk.
    answer = ask(client, contract["info"]["id"], max_tokens=8)
    assert answer.status_code == 200 and answer.json()["answer"].strip()
    info = client.get(f"/v1/documents/{long_id}", headers=AUTH).json()
    assert info["status"] == "processing", info
    # Deleting it stops the prefill and removes its files.
    deleted = client.delete(f"/v1/documents/{long_id}", headers=AUTH)
    assert deleted.status_code == 200
    assert deleted.json() == {"id": long_id, "object": "document.deleted", "deleted": True}
    assert_error(client.get(f"/v1/documents/{long_id}", headers=AUTH), 404, "document_not_found")
    assert not (server.data_dir / "documents" / long_id).exists()
    deadline = time.monotonic() + 60
    while server_counters(client)["prefills_cancelled"] == before["prefills_cancelled"]:
        assert time.monotonic() < deadline, "the prefill of the deleted document did not stop"
        time.sleep(0.2)
    assert server_counters(client)["prefills"] == before["prefills"]
    assert not (server.data_dir / "documents" / long_id).exists()


# The page in a real browser ----------------------------------------------------------------------


def test_page_uploads_and_streams_an_answer(server: ServerProcess, client: httpx.Client, tmp_path: Path) -> None:
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("Debian chromium and chromium-driver are not installed (`make browser` installs them)")
    selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install -e '.[dev]')")
    del selenium
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    path = pdfs.text_pdf(
        tmp_path / "lease.pdf",
        ["Lease of the harbour warehouse.\nThe monthly rent is 900 euros.", "The tenant is Bob Jones."],
    )
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        driver.set_page_load_timeout(60)
        driver.get(server.url + "/")
        driver.find_element(By.ID, "apikey").send_keys(KEY)
        driver.find_element(By.ID, "file").send_keys(str(path))
        driver.find_element(By.ID, "upload").click()
        status = driver.find_element(By.ID, "doc-status")
        WebDriverWait(driver, 120, 0.2).until(lambda d: status.get_attribute("data-status") == "ready")
        doc_id = driver.find_element(By.ID, "document").get_attribute("value")
        assert doc_id is not None and doc_id.startswith("doc_")
        driver.find_element(By.ID, "question").send_keys("What is the monthly rent?")
        tokens = driver.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys("12")
        driver.find_element(By.ID, "ask").click()
        answer = driver.find_element(By.ID, "answer")
        WebDriverWait(driver, 120, 0.1).until(lambda d: answer.get_attribute("data-state") in ("done", "error"))
        assert answer.get_attribute("data-state") == "done", driver.find_element(By.ID, "usage").text
        shown = answer.text
        assert shown.strip()
        assert "tokens" in driver.find_element(By.ID, "usage").text
    finally:
        driver.quit()
    # The page showed what the API answers for the same question (greedy).
    expected = ask(client, doc_id, "What is the monthly rent?", max_tokens=12).json()["answer"]
    assert shown.strip() == expected.strip()


# Persistence -------------------------------------------------------------------------------------


def test_restart_answers_from_disk_without_prefill(
    server: ServerProcess, client: httpx.Client, contract: dict[str, Any]
) -> None:
    doc_id = contract["info"]["id"]
    before = ask(client, doc_id, max_tokens=12).json()["answer"]
    memo = upload(client, "memo.txt", b"Memo: the office closes at five on Fridays.").json()["id"]
    assert wait_ready(client, memo)[0]["status"] == "ready"
    ids = {d["id"] for d in client.get("/v1/documents", headers=AUTH).json()["data"]}
    server.stop()
    server.start()
    client.base_url = httpx.URL(server.url)  # a new process on a new port, the same data directory
    counters = server_counters(client)
    assert counters["prefills"] == 0 and counters["cache_loads"] == 0
    listing = client.get("/v1/documents", headers=AUTH).json()["data"]
    assert {d["id"] for d in listing} == ids and all(d["status"] == "ready" for d in listing)
    info = client.get(f"/v1/documents/{doc_id}", headers=AUTH).json()
    assert info["cache_origin"] is None and info["tokens"] == contract["info"]["tokens"]
    assert info["progress"] == contract["info"]["progress"] and info["progress"]["fraction"] == 1.0
    assert info["cache_bytes"] == contract["info"]["cache_bytes"]
    after = ask(client, doc_id, max_tokens=12)
    assert after.status_code == 200 and after.json()["answer"] == before
    counters = server_counters(client)
    assert counters["prefills"] == 0 and counters["prefill_tokens"] == 0  # no document was read again
    assert counters["cache_loads"] == 1
    assert client.get(f"/v1/documents/{doc_id}", headers=AUTH).json()["cache_origin"] == "disk"
    # A damaged cache is refused (it is verified on load) and the document is read again from its saved text.
    tensors = server.data_dir / "documents" / memo / "cache" / "tensors.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-10] ^= 0xFF
    tensors.write_bytes(bytes(data))
    assert_error(ask(client, memo, max_tokens=4), 409, "cache_rebuilding")
    info, _ = wait_ready(client, memo)
    assert info["status"] == "ready" and info["cache_origin"] == "prefill"
    assert ask(client, memo, max_tokens=4).status_code == 200
    assert server_counters(client)["prefills"] == 1


def test_refuses_to_start_without_keys(tmp_path: Path) -> None:
    process = ServerProcess("tiny", tmp_path / "data", log_path=tmp_path / "server.log")
    with pytest.raises(RuntimeError) as failure:
        process.start(timeout=60)
    assert "refusing to start without API keys" in str(failure.value)
