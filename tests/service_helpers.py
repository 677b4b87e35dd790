"""What the service tests share: in-process settings, error checks, uploads and polling (in-process
TestClient or a live httpx client: both have the same request methods, `HTTPClient`), and making a directory
read-only for real."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest

from infokv_rag.service.launcher import read_sse
from infokv_rag.service.settings import Settings

ADMIN_KEY = "key-admin-ops-0001"
ADMIN_ENTRY = f"ops:{ADMIN_KEY}"
"""The admin key of every test service: /healthz shows its counters to admin keys only."""


def random_model_settings(data_dir: Path, api_keys: tuple[str, ...], **overrides: Any) -> Settings:
    """An in-process service on the random model (its engine passed to `create_app`) with short answers."""
    base: dict[str, Any] = {
        "api_keys": api_keys,
        "admin_keys": (ADMIN_ENTRY,),
        "data_dir": data_dir,
        "model": "random",
        "warmup": False,
        "max_new_tokens": 8,
        "default_max_tokens": 4,
        "default_method": "snapkv",
    }
    return Settings(**{**base, **overrides})


class HTTPResponse(Protocol):
    """What the helpers read of a response: httpx's (a live server) or the in-process TestClient's (httpx2's)."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def text(self) -> str: ...

    def json(self, **kwargs: Any) -> Any: ...


class HTTPClient(Protocol):
    """The requests the helpers make, as an httpx.Client and the in-process TestClient (an httpx2.Client) take them."""

    def get(self, url: str, *, headers: Mapping[str, str] | None = None) -> HTTPResponse: ...

    def post(
        self,
        url: str,
        *,
        data: Mapping[str, Any] | None = None,
        files: Mapping[str, tuple[str, bytes]] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> HTTPResponse: ...


LEAKS = ("Traceback", 'File "', "/tmp/", "/uploads/", "site-packages")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin_health(client: HTTPClient) -> dict[str, Any]:
    """/healthz as an admin key reads it: liveness, documents by status, queue lengths and counters."""
    health: dict[str, Any] = client.get("/healthz", headers=bearer(ADMIN_KEY)).json()
    return health


def server_counters(client: HTTPClient) -> dict[str, int]:
    """The server's counters since start (`admin_health`)."""
    counters: dict[str, int] = admin_health(client)["counters"]
    return counters


def assert_error(response: HTTPResponse, status: int, code: str) -> dict[str, Any]:
    """A typed JSON error with this status and code, and nothing of the server's insides in it."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    assert body["error"]["message"] and body["error"]["type"]
    for leak in LEAKS:
        assert leak not in response.text, response.text
    return body["error"]


def upload(client: HTTPClient, headers: dict[str, str], name: str, data: bytes, **fields: str) -> HTTPResponse:
    return client.post("/v1/documents", files={"file": (name, data)}, data=fields, headers=headers)


def wait_settled(client: HTTPClient, doc_id: str, headers: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    """The document's info once it is ready or failed."""
    deadline = time.monotonic() + timeout
    while True:
        info = client.get(f"/v1/documents/{doc_id}", headers=headers).json()
        if info.get("status") in ("ready", "failed"):
            return info
        assert time.monotonic() < deadline, f"document {doc_id} not settled after {timeout} s: {info}"
        time.sleep(0.05)


def wait_queue(client: HTTPClient, **counts: int) -> None:
    """Wait until /healthz's queue shows at least these counts (`active_generations=1`, ...)."""
    deadline = time.monotonic() + 60
    while any(admin_health(client)["queue"][name] < count for name, count in counts.items()):
        assert time.monotonic() < deadline, (counts, admin_health(client)["queue"])
        time.sleep(0.02)


def upload_ready(client: HTTPClient, headers: dict[str, str], name: str, data: bytes, **fields: str) -> str:
    created = upload(client, headers, name, data, **fields)
    assert created.status_code == 202, created.text
    info = wait_settled(client, created.json()["id"], headers)
    assert info["status"] == "ready", info
    return str(info["id"])


def hang_up_after_first_token(stream: httpx.Response) -> None:
    """Reads an answer's event stream until its first token, then stops: the caller closes the connection."""
    for name, _ in read_sse(stream.iter_lines()):
        if name == "token":
            return
    raise AssertionError("the stream ended before its first token")


def wait_answer_ended(
    read_health: Callable[[], dict[str, Any]], before: dict[str, int], timeout: float = 60
) -> dict[str, Any]:
    """The health (from `read_health`) once an answer ended since the counters `before`, cancelled or completed,
    and nothing is decoding; at the timeout, as it is then (for the caller's assertions to report)."""
    deadline = time.monotonic() + timeout
    while True:
        health = read_health()
        counters = health["counters"]
        ended = any(counters[name] != before[name] for name in ("generations_cancelled", "generations_completed"))
        if (ended and health["queue"]["active_generations"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def assert_answer_cancelled(health: dict[str, Any], before: dict[str, int]) -> None:
    """One answer was cancelled since the counters `before`, none completed, and none is running."""
    counters = health["counters"]
    assert counters["generations_cancelled"] == before["generations_cancelled"] + 1, counters
    assert counters["generations_completed"] == before["generations_completed"], counters
    assert counters["generated_tokens"] == before["generated_tokens"], counters
    assert health["queue"]["active_generations"] == 0, health["queue"]


def set_read_only(path: Path, read_only: bool = True) -> None:
    """Makes a directory really read-only (no entry may be created, renamed or removed in it), or undoes it.

    Permissions do not bind root, so as root the directory is made immutable (`chattr +i`) instead; where
    neither works the test is skipped with the reason.
    """
    if os.geteuid() != 0:
        path.chmod(0o555 if read_only else 0o755)
        return
    chattr = shutil.which("chattr")
    done = (
        chattr is not None
        and subprocess.run(
            [chattr, "+i" if read_only else "-i", str(path)], capture_output=True, check=False
        ).returncode
        == 0
    )
    if not done:
        if read_only:
            pytest.skip("running as root, and `chattr +i` is not available here: cannot make a directory read-only")
        raise OSError(f"cannot make {path} writable again")


@contextlib.contextmanager
def read_only(path: Path, already: bool = False) -> Iterator[None]:
    """Read-only for the `with` block (`already`: it was made read-only before; only undo it after)."""
    if not already:
        set_read_only(path)
    try:
        yield
    finally:
        set_read_only(path, False)


def read_response(connection: socket.socket, first: bytes = b"") -> bytes:
    """The whole HTTP response the server sends on `connection` (after `first`, what was read of it already): its
    head and body may come in several reads (h11 writes them apart), so it is read up to its Content-Length."""
    answer = first
    while b"\r\n\r\n" not in answer or len(answer) < _response_length(answer):
        more = connection.recv(65536)
        if not more:
            break
        answer += more
    return answer


def _response_length(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return len(head) + 4 + (int(length.group(1)) if length else 0)


def send_part_of_an_upload(port: int, key: str, text: bytes) -> socket.socket:
    """An upload whose body is a third sent, on a connection left open: the server is inside receiving it."""
    boundary = "infokvboundary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.txt"\r\n'
        "Content-Type: text/plain\r\n\r\n"
    ).encode()
    body = head + text + f"\r\n--{boundary}--\r\n".encode()
    raw = socket.create_connection(("127.0.0.1", port))
    raw.sendall(
        (
            f"POST /v1/documents HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body[: len(body) // 3]
    )
    return raw
