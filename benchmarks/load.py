"""Load test of the HTTP service: concurrent clients, answers checked against solo answers, memory flat.

Starts the real server (uvicorn subprocess, tiny model by default), uploads 3 planted-fact documents,
asks every question alone once (greedy: the reference answers), then runs N concurrent clients for
--duration seconds. Each request is one of: /ask as JSON, /ask streamed over SSE, or
/v1/chat/completions streamed; every answer must equal the same question's solo answer exactly.
The server's RSS is sampled throughout; it must stay flat once the load has warmed up.

    python benchmarks/load.py                                   # 8 clients, 3 documents, 60 s
    python benchmarks/load.py --duration 20 --max-tokens 12     # a quick run
    python benchmarks/load.py --url http://127.0.0.1:8000 --api-key KEY --pid 1234   # a running server

Exit status 0 when there were no errors, no mismatches and memory stayed flat; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from infokv_rag.config import DEFAULT_METHOD
from infokv_rag.evaluation import make_fact_document
from infokv_rag.prompt import question_turns
from infokv_rag.scorers import method_names
from infokv_rag.service.launcher import ServerProcess, read_sse

KINDS = ("ask-json", "ask-sse", "chat-sse")


@dataclass
class Result:
    client: int
    kind: str
    doc: int
    question: str
    seconds: float
    first_token: float | None
    tokens: int
    matched: bool
    error: str | None = None


class Client:
    def __init__(self, url: str, key: str | None, model: str, max_tokens: int) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=600)
        self.model = model
        self.max_tokens = max_tokens

    def close(self) -> None:
        self.http.close()

    def ask(self, kind: str, doc_id: str, question: str) -> tuple[str, int, float | None]:
        """(answer, completion tokens, seconds to the first token or None)."""
        started = time.perf_counter()
        if kind == "ask-json":
            response = self.http.post(
                f"/v1/documents/{doc_id}/ask", json={"question": question, "max_tokens": self.max_tokens}
            )
            _check(response)
            body = response.json()
            return body["answer"], body["usage"]["completion_tokens"], None
        if kind == "ask-sse":
            request = {"question": question, "max_tokens": self.max_tokens, "stream": True}
            path = f"/v1/documents/{doc_id}/ask"
        else:
            # The same single user turn that /ask builds, so the answer must be the same too.
            ((_, content),) = question_turns(question)
            request = {
                "model": self.model,
                "document_id": doc_id,
                "max_tokens": self.max_tokens,
                "stream": True,
                "messages": [{"role": "user", "content": content}],
                "stream_options": {"include_usage": True},
            }
            path = "/v1/chat/completions"
        pieces: list[str] = []
        first: float | None = None
        tokens = 0
        with self.http.stream("POST", path, json=request) as response:
            if response.status_code != 200:
                response.read()
                _check(response)
            for name, data in read_sse(response.iter_lines()):
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if name == "error" or "error" in payload:
                    raise RuntimeError(payload["error"]["message"])
                if name == "token":
                    pieces.append(payload["text"])
                elif name == "done":
                    tokens = payload["usage"]["completion_tokens"]
                elif kind == "chat-sse":
                    if payload.get("usage"):
                        tokens = payload["usage"]["completion_tokens"]
                    for choice in payload.get("choices", []):
                        if choice["delta"].get("content"):
                            pieces.append(choice["delta"]["content"])
                if pieces and first is None:
                    first = time.perf_counter() - started
        return "".join(pieces), tokens, first


def _check(response: httpx.Response) -> None:
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except Exception:  # noqa: BLE001
            message = response.text[:200]
        raise RuntimeError(f"HTTP {response.status_code}: {message}")


class RssSampler(threading.Thread):
    def __init__(self, pid: int | None, every: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int]] = []
        self.every = every
        self.stopped = threading.Event()
        self.process = None
        if pid is not None:
            import psutil

            self.process = psutil.Process(pid)

    def run(self) -> None:
        while self.process is not None and not self.stopped.is_set():
            try:
                self.samples.append((time.monotonic(), self.process.memory_info().rss))
            except Exception:  # noqa: BLE001 - the process ended
                return
            self.stopped.wait(self.every)

    def window(self, start: float, end: float) -> list[int]:
        return [rss for t, rss in self.samples if start <= t <= end]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]
    line = lambda cells: "| " + " | ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def summarise(results: list[Result], key: str) -> list[list[str]]:
    groups: dict[Any, list[Result]] = defaultdict(list)
    for result in results:
        groups[getattr(result, key)].append(result)
    ordered = [(name, groups[name]) for name in sorted(groups)]
    ordered.append(("all", list(results)))
    rows = []
    for name, group in ordered:
        ok = [r for r in group if r.error is None]
        seconds = [r.seconds for r in ok]
        firsts = [r.first_token for r in ok if r.first_token is not None]
        tokens = sum(r.tokens for r in ok)
        rows.append(
            [
                str(name),
                str(len(group)),
                str(sum(r.error is not None for r in group)),
                str(sum(r.error is None and not r.matched for r in group)),
                f"{percentile(seconds, 0.5):.2f}",
                f"{percentile(seconds, 0.95):.2f}",
                f"{percentile(firsts, 0.5):.2f}" if firsts else "-",
                str(tokens),
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of concurrent load (default 60)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--words", type=int, default=220, help="words per document (default 220)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=method_names())
    parser.add_argument("--keep", default="0.5")
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--admin-key", default=None, help="an admin key of the server at --url, to report its counters (/healthz)"
    )
    parser.add_argument("--pid", type=int, default=None, help="the running server's pid (for its RSS)")
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=0.03,
        help="largest allowed RSS growth over the load, as a fraction (default 0.03)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    server = None
    key, admin_key = args.api_key, args.admin_key
    if args.url is None:
        workdir = Path(tempfile.mkdtemp(prefix="infokv-load-"))
        key, admin_key = "load-test-key-0001", "load-admin-key-0001"
        server = ServerProcess(
            args.model, workdir / "data", api_keys=[key], admin_keys=[admin_key], log_path=workdir / "server.log"
        )
        print(f"starting the server ({args.model}); log: {server.log_path}", file=sys.stderr)
        server.start()
        url, pid = server.url, server.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        return run(args, url, key, pid, admin_key)
    finally:
        if server is not None:
            server.stop()


def run(args: argparse.Namespace, url: str, key: str | None, pid: int | None, admin_key: str | None) -> int:
    client = Client(url, key, args.model, args.max_tokens)
    model = client.http.get("/v1/models").json()["data"][0]["id"]
    client.model = model
    docs: list[tuple[str, list[str]]] = []
    for index in range(args.documents):
        fact_doc = make_fact_document(seed=100 + index, target_words=args.words)
        response = client.http.post(
            "/v1/documents",
            files={"file": (f"doc{index}.txt", fact_doc.text.encode())},
            data={"method": args.method, "keep": args.keep},
        )
        _check_status(response, 202)
        docs.append((response.json()["id"], [fact.question for fact in fact_doc.facts]))
    for doc_id, _ in docs:
        while (info := client.http.get(f"/v1/documents/{doc_id}").json())["status"] != "ready":
            if info["status"] == "failed":
                raise SystemExit(f"document {doc_id} failed: {info['reason']}")
            time.sleep(0.2)
        print(
            f"{doc_id}: {info['tokens']} tokens, kept {info['kept_tokens']}, {info['prefill_seconds']} s to read",
            file=sys.stderr,
        )

    pairs = [(d, doc_id, q) for d, (doc_id, questions) in enumerate(docs) for q in questions]
    reference: dict[tuple[int, str], str] = {}
    solo: list[float] = []
    for d, doc_id, question in pairs:
        started = time.perf_counter()
        reference[(d, question)] = client.ask("ask-json", doc_id, question)[0]
        solo.append(time.perf_counter() - started)
    print(f"{len(pairs)} reference answers, asked alone: median {statistics.median(solo):.2f} s", file=sys.stderr)

    sampler = RssSampler(pid)
    sampler.start()
    time.sleep(0.5)
    before = sampler.samples[-1][1] if sampler.samples else None
    results: list[Result] = []
    lock = threading.Lock()
    load_start = time.monotonic()
    deadline = load_start + args.duration

    def worker(index: int) -> None:
        rng = random.Random(args.seed * 1000 + index)
        mine = Client(url, key, model, args.max_tokens)
        count = 0
        try:
            while time.monotonic() < deadline:
                d, doc_id, question = rng.choice(pairs)
                kind = KINDS[(index + count) % len(KINDS)]
                count += 1
                started = time.perf_counter()
                try:
                    answer, tokens, first = mine.ask(kind, doc_id, question)
                    result = Result(
                        index,
                        kind,
                        d,
                        question,
                        time.perf_counter() - started,
                        first,
                        tokens,
                        answer == reference[(d, question)],
                    )
                    if not result.matched:
                        print(
                            f"MISMATCH client {index} {kind} doc {d} {question!r}: {answer!r} != "
                            f"{reference[(d, question)]!r}",
                            file=sys.stderr,
                        )
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    result = Result(
                        index,
                        kind,
                        d,
                        question,
                        time.perf_counter() - started,
                        None,
                        0,
                        False,
                        f"{type(exc).__name__}: {exc}",
                    )
                    print(f"ERROR client {index} {kind}: {result.error}", file=sys.stderr)
                with lock:
                    results.append(result)
        finally:
            mine.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    load_end = time.monotonic()
    time.sleep(0.5)
    sampler.stopped.set()
    sampler.join()
    # Counters cover every tenant: /healthz shows them to an admin key only.
    health = client.http.get("/healthz", headers={"Authorization": f"Bearer {admin_key}"} if admin_key else None)
    counters = health.json().get("counters", "(none shown: pass --admin-key)")
    client.close()

    elapsed = load_end - load_start
    print(
        f"\n{args.clients} clients, {len(docs)} documents, {len(pairs)} questions, {elapsed:.0f} s "
        f"(requested {args.duration:.0f} s), max_tokens {args.max_tokens}, model {model}"
    )
    header = ["client", "requests", "errors", "mismatches", "p50 s", "p95 s", "p50 first s", "tokens"]
    print()
    print(table(summarise(results, "client"), header))
    print()
    print(table(summarise(results, "kind"), ["kind", *header[1:]]))
    errors = sum(r.error is not None for r in results)
    mismatches = sum(r.error is None and not r.matched for r in results)
    tokens = sum(r.tokens for r in results if r.error is None)
    print(
        f"\nthroughput: {len(results) / elapsed:.2f} answers/s, {tokens / elapsed:.1f} tokens/s; "
        f"solo answer median {statistics.median(solo):.2f} s"
    )
    print(f"server counters: {counters}")

    flat = True
    if sampler.samples:
        quarter = elapsed / 4
        early = sampler.window(load_start, load_start + quarter)
        late = sampler.window(load_end - quarter, load_end)
        all_rss = sampler.window(load_start, load_end)
        baseline, final = max(early), max(late)
        growth = final - baseline
        flat = growth <= args.max_rss_growth * baseline
        print()
        print(
            table(
                [
                    [
                        mib(before or 0),
                        mib(baseline),
                        mib(final),
                        mib(max(all_rss)),
                        f"{growth / 2**20:+.1f}",
                        f"{100 * growth / baseline:+.2f}%",
                        "yes" if flat else "NO",
                    ]
                ],
                ["RSS before MiB", "first quarter MiB", "last quarter MiB", "peak MiB", "growth MiB", "growth", "flat"],
            )
        )
        steps = 10
        timeline = []
        for step in range(steps + 1):
            moment = load_start + elapsed * step / steps
            nearest = min(sampler.samples, key=lambda sample: abs(sample[0] - moment))
            timeline.append(f"{elapsed * step / steps:.0f}s {mib(nearest[1])}")
        print("RSS over the load (MiB): " + ", ".join(timeline))
    else:
        print("\nRSS not measured (give --pid for a running server)")
    ok = errors == 0 and mismatches == 0 and flat and len(results) > 0
    print(
        f"\nresult: {'PASS' if ok else 'FAIL'} ({len(results)} answers, {errors} errors, {mismatches} mismatches, "
        f"memory {'flat' if flat else 'GREW'})"
    )
    return 0 if ok else 1


def _check_status(response: httpx.Response, status: int) -> None:
    if response.status_code != status:
        raise SystemExit(f"HTTP {response.status_code}: {response.text[:300]}")


if __name__ == "__main__":
    sys.exit(main())
