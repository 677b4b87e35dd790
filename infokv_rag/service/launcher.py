"""Run `infokv-rag serve` in a subprocess on a free loopback port, and read its event streams (tests,
benchmarks, scripts).

    with ServerProcess(model="tiny", data_dir=tmp, api_keys=["..."]) as server:
        httpx.get(server.url + "/healthz")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class ServerProcess:
    """A real uvicorn server process; `settings` become `INFOKV_<NAME>` environment variables."""

    def __init__(
        self,
        model: str,
        data_dir: str | os.PathLike[str],
        api_keys: Sequence[str] = (),
        settings: Mapping[str, Any] | None = None,
        admin_keys: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = model
        self.data_dir = Path(data_dir)
        self.api_keys = list(api_keys)
        self.admin_keys = list(admin_keys)
        self.settings = dict(settings or {})
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / f"{self.data_dir.name}-server.log"
        self.extra_env = dict(env or {})
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self, timeout: float = 180.0) -> ServerProcess:
        env = {**os.environ, **self.extra_env}
        for name in list(env):
            if name in ("INFOKV_API_KEYS", "INFOKV_ADMIN_KEYS", "INFOKV_ALLOW_ANONYMOUS"):
                del env[name]
        if self.api_keys:
            env["INFOKV_API_KEYS"] = ",".join(self.api_keys)
        if self.admin_keys:
            env["INFOKV_ADMIN_KEYS"] = ",".join(self.admin_keys)
        for name, value in self.settings.items():
            env[f"INFOKV_{name.upper()}"] = str(int(value) if isinstance(value, bool) else value)
        self.port = free_port()
        command = [
            sys.executable,
            "-m",
            "infokv_rag.cli",
            "serve",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as response:
                    if response.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"the server did not answer /healthz within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful: uvicorn runs the shutdown), then SIGKILL after `timeout`."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return process.returncode if process else None
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait(5)

    def kill(self) -> int | None:
        """SIGKILL, as a crash or the OOM killer would: no shutdown code runs."""
        process, self.process = self.process, None
        if process is None:
            return None
        process.send_signal(signal.SIGKILL)
        return process.wait(30)

    def __enter__(self) -> ServerProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_sse(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(event, data) of a text/event-stream's lines, as a browser's EventSource parses them."""
    event, data = "message", list[str]()
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif not line.startswith(":"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
