"""Soak test of the HTTP service: tenants, uploads, asks and deletes mixed for minutes; leaks and memory.

Starts the real server (uvicorn subprocess, tiny model by default) with one API key per tenant, then runs
N clients for M minutes. Client i acts for tenant i % T and repeatedly, at random: uploads a small
document holding a secret of its tenant, asks about one of its tenant's ready documents (JSON or SSE),
lists its documents, reads one (polling uploads until ready, as a real client does), deletes one (keeping
the store's size bounded), or probes another tenant's document (GET, ask or DELETE of its id, which must
be a 404 exactly like an unknown id).

Counted: errors (any answer but the intended ones: 2xx, 404 for a document another client of the same
tenant just deleted, 409 for one still being read, 503 busy), cross-tenant leaks (another tenant's id or
secret in any answer, or a probe that is not a 404), p50/p95 latency per operation, and the server's RSS
over time (flat is the goal: the last quarter within --max-rss-growth of the first quarter after warm-up).

    python -m benchmarks.soak                              # 8 clients, 2 tenants, 10 minutes
    python -m benchmarks.soak --minutes 1 --clients 4      # a quick run

Exit status 0 when there were no errors, no leaks and memory stayed flat; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from infokv_rag.evaluation import make_fact_document
from infokv_rag.service.launcher import ServerProcess, read_sse

from .load import RssSampler, mib, percentile, table

OPERATIONS = {"ask": 40, "upload": 14, "list": 14, "get": 10, "probe": 14, "delete": 8}
"""Relative weights of what a client does next."""
INTENDED = {404, 409, 503}
"""Refusals a soak client may get without anything being wrong (see the module docstring)."""


@dataclass
class Tenant:
    name: str
    key: str
    documents: dict[str, str] = field(default_factory=dict)
    """Its ready documents: id -> the secret in the document."""
    pending: dict[str, str] = field(default_factory=dict)
    """Uploaded, not yet seen ready (clients poll them with `get`, as a real client would)."""
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Outcome:
    operation: str
    seconds: float
    status: int
    error: str | None = None
    leak: str | None = None

    @property
    def idle(self) -> bool:
        """Nothing to do (e.g. no document to probe yet): not a request."""
        return self.status == 0 and self.error is None


class Soak:
    def __init__(self, url: str, tenants: list[Tenant], args: argparse.Namespace) -> None:
        self.url = url
        self.tenants = tenants
        self.args = args
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.uploaded = 0

    # One client ---------------------------------------------------------------------------------

    def client(self, index: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        tenant = self.tenants[index % len(self.tenants)]
        others = [t for t in self.tenants if t is not tenant]
        http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=600)
        actions: dict[str, Callable[[], tuple[int, str | None, str | None]]] = {
            "ask": lambda: self.ask(http, tenant, others, rng),
            "upload": lambda: self.upload(http, tenant, rng),
            "list": lambda: self.list_documents(http, tenant, others),
            "get": lambda: self.get(http, tenant, others, rng),
            "probe": lambda: self.probe(http, others, rng),
            "delete": lambda: self.delete(http, tenant, others, rng),
        }
        names, weights = list(OPERATIONS), list(OPERATIONS.values())
        try:
            while time.monotonic() < deadline:
                time.sleep(rng.uniform(0, 2 * self.args.think))
                operation = self._feasible(rng.choices(names, weights)[0], tenant)
                started = time.perf_counter()
                try:
                    status, error, leak = actions[operation]()
                except Exception as exc:  # noqa: BLE001 - counted and reported
                    status, error, leak = 0, f"{type(exc).__name__}: {exc}", None
                outcome = Outcome(operation, time.perf_counter() - started, status, error, leak)
                if error or leak:
                    print(f"{'LEAK' if leak else 'ERROR'} client {index} {operation}: {leak or error}", file=sys.stderr)
                with self.lock:
                    self.outcomes.append(outcome)
        finally:
            http.close()

    def _feasible(self, operation: str, tenant: Tenant) -> str:
        """What the client does instead when the drawn operation has nothing to act on."""
        with tenant.lock:
            ready, known = len(tenant.documents), len(tenant.documents) + len(tenant.pending)
        if operation == "upload" and known >= self.args.documents_per_tenant:
            return "delete"  # keeps the store's size bounded: memory must be flat, not the store growing
        if operation == "ask" and not ready:
            return "upload" if known < self.args.documents_per_tenant else "get"
        if operation == "get" and not known:
            return "list"
        return operation

    @staticmethod
    def _foreign(text: str, others: list[Tenant]) -> str | None:
        for other in others:
            with other.lock:
                known = {**other.documents, **other.pending}
            for doc_id, secret in known.items():
                if doc_id in text or secret in text:
                    return f"{other.name}'s document {doc_id} in the answer"
        return None

    @staticmethod
    def _status(response: httpx.Response, expected: set[int]) -> str | None:
        if response.status_code in expected | INTENDED:
            return None
        return f"HTTP {response.status_code}: {response.text[:200]}"

    @staticmethod
    def _pick(tenant: Tenant, rng: random.Random, pending: bool = False) -> str | None:
        with tenant.lock:
            known = sorted({**tenant.documents, **tenant.pending} if pending else tenant.documents)
        return rng.choice(known) if known else None

    # Operations: each returns (status, error, leak) ------------------------------------------------

    def upload(self, http: httpx.Client, tenant: Tenant, rng: random.Random) -> tuple[int, str | None, str | None]:
        secret = f"SOAK-{tenant.name}-{secrets.token_hex(4)}"
        text = make_fact_document(seed=rng.randrange(10**6), target_words=self.args.words, facts=1).text
        body = f"{text}\n\nThe access code of this document is {secret}.\n"
        response = http.post(
            "/v1/documents",
            files={"file": ("memo.txt", body.encode())},
            data={"method": self.args.method, "keep": self.args.keep},
        )
        if response.status_code == 202:
            with tenant.lock:
                tenant.pending[response.json()["id"]] = secret
            with self.lock:
                self.uploaded += 1
        return response.status_code, self._status(response, {202}), None

    def ask(
        self, http: httpx.Client, tenant: Tenant, others: list[Tenant], rng: random.Random
    ) -> tuple[int, str | None, str | None]:
        doc_id = self._pick(tenant, rng)
        if doc_id is None:
            return 0, None, None
        request = {"question": "What is the access code of this document?", "max_tokens": self.args.max_tokens}
        if rng.random() < 0.5:
            response = http.post(f"/v1/documents/{doc_id}/ask", json=request)
            return response.status_code, self._status(response, {200}), self._foreign(response.text, others)
        with http.stream("POST", f"/v1/documents/{doc_id}/ask", json={**request, "stream": True}) as stream:
            if stream.status_code != 200:
                stream.read()
                return stream.status_code, self._status(stream, {200}), self._foreign(stream.text, others)
            events = list(read_sse(stream.iter_lines()))
        text = "".join(data for _, data in events)
        names = [name for name, _ in events]
        error = None
        if names[-1:] != ["done"]:
            error = f"the stream ended with {names[-1:]}: {events[-1:]}"
            if names[-1:] == ["error"] and json.loads(events[-1][1])["error"]["code"] == "cancelled":
                error = None  # (only at shutdown)
        return 200, error, self._foreign(text, others)

    def list_documents(
        self, http: httpx.Client, tenant: Tenant, others: list[Tenant]
    ) -> tuple[int, str | None, str | None]:
        response = http.get("/v1/documents")
        leak = self._foreign(response.text, others)
        if response.status_code == 200 and leak is None:
            owners = {d["owner"] for d in response.json()["data"]}
            if owners - {tenant.name}:
                leak = f"documents of {owners - {tenant.name}} listed"
        return response.status_code, self._status(response, {200}), leak

    def get(
        self, http: httpx.Client, tenant: Tenant, others: list[Tenant], rng: random.Random
    ) -> tuple[int, str | None, str | None]:
        """Reads one of the tenant's documents, an upload still pending first (it becomes askable once ready)."""
        with tenant.lock:
            pending = sorted(tenant.pending)
        doc_id = rng.choice(pending) if pending else self._pick(tenant, rng)
        if doc_id is None:
            return 0, None, None
        response = http.get(f"/v1/documents/{doc_id}")
        error = self._status(response, {200})
        if response.status_code == 200:
            status = response.json()["status"]
            if status == "failed":
                error = f"document failed: {response.json()['reason']}"
            elif status == "ready":
                with tenant.lock:
                    if doc_id in tenant.pending:
                        tenant.documents[doc_id] = tenant.pending.pop(doc_id)
        return response.status_code, error, self._foreign(response.text, others)

    def probe(self, http: httpx.Client, others: list[Tenant], rng: random.Random) -> tuple[int, str | None, str | None]:
        other = rng.choice(others)
        doc_id = self._pick(other, rng, pending=True)
        if doc_id is None:
            return 0, None, None
        kind = rng.choice(["get", "ask", "delete"])
        if kind == "get":
            response = http.get(f"/v1/documents/{doc_id}")
        elif kind == "ask":
            response = http.post(f"/v1/documents/{doc_id}/ask", json={"question": "Code?", "max_tokens": 2})
        else:
            response = http.delete(f"/v1/documents/{doc_id}")
        leak = None
        if response.status_code != 404 or response.json()["error"]["code"] != "document_not_found":
            leak = f"{kind} of {other.name}'s {doc_id} answered {response.status_code}: {response.text[:120]}"
        elif self._foreign(response.text, others):
            leak = f"{kind} of {other.name}'s {doc_id} named a document"
        return response.status_code, None, leak

    def delete(
        self, http: httpx.Client, tenant: Tenant, others: list[Tenant], rng: random.Random
    ) -> tuple[int, str | None, str | None]:
        with tenant.lock:
            if len(tenant.documents) <= self.args.keep_documents:
                return 0, None, None  # keep a few to ask about
            doc_id = rng.choice(sorted(tenant.documents))
            tenant.documents.pop(doc_id)
        response = http.delete(f"/v1/documents/{doc_id}")
        return response.status_code, self._status(response, {200}), self._foreign(response.text, others)


# Report ----------------------------------------------------------------------------------------------


def report(
    soak: Soak,
    sampler: RssSampler,
    start: float,
    end: float,
    warmup: float,
    args: argparse.Namespace,
    counters: dict[str, int],
) -> bool:
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in soak.outcomes:
        if not outcome.idle:
            groups[outcome.operation].append(outcome)
    rows = []
    everything = [o for group in groups.values() for o in group]
    for name, group in [*sorted(groups.items()), ("all", everything)]:
        seconds = [o.seconds for o in group]
        rows.append(
            [
                name,
                str(len(group)),
                str(sum(200 <= o.status < 300 for o in group)),
                str(sum(o.status in INTENDED for o in group)),
                str(sum(o.error is not None for o in group)),
                str(sum(o.leak is not None for o in group)),
                f"{percentile(seconds, 0.5):.2f}",
                f"{percentile(seconds, 0.95):.2f}",
            ]
        )
    elapsed = end - start
    print(
        f"\n{args.clients} clients, {len(soak.tenants)} tenants, {elapsed / 60:.1f} min, model {args.model}, "
        f"max_tokens {args.max_tokens}, {soak.uploaded} uploads accepted"
    )
    print()
    print(table(rows, ["operation", "requests", "2xx", "intended 404/409/503", "errors", "leaks", "p50 s", "p95 s"]))
    errors = sum(o.error is not None for o in everything)
    leaks = sum(o.leak is not None for o in everything)

    flat = True
    if sampler.samples:
        after = start + warmup
        span = end - after
        first = sampler.window(after, after + span / 4)
        last = sampler.window(end - span / 4, end)
        baseline, final = max(first), max(last)
        growth = (final - baseline) / baseline
        flat = growth <= args.max_rss_growth
        steps = max(1, round(elapsed / 60))
        timeline = []
        for step in range(steps + 1):
            moment = start + elapsed * step / steps
            nearest = min(sampler.samples, key=lambda sample: abs(sample[0] - moment))
            timeline.append((f"{elapsed * step / steps / 60:.0f}", mib(nearest[1])))
        print("\nserver RSS (MiB) over time:\n")
        print(table([[r for _, r in timeline]], [f"{m} min" for m, _ in timeline]))
        print(
            f"\nRSS after warm-up ({warmup:.0f} s): first quarter max {mib(baseline)} MiB, last quarter max "
            f"{mib(final)} MiB, growth {100 * growth:+.1f}% (limit {100 * args.max_rss_growth:.0f}%): "
            f"{'flat' if flat else 'GREW'}; peak {mib(max(r for _, r in sampler.samples))} MiB"
        )
    print(f"server counters: {counters}")
    ok = errors == 0 and leaks == 0 and flat and bool(everything)
    print(
        f"\nresult: {'PASS' if ok else 'FAIL'} ({len(everything)} requests, {errors} errors, {leaks} cross-tenant "
        f"leaks, memory {'flat' if flat else 'GREW'})"
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tenants", type=int, default=2)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the run that is warm-up (0.2)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--method", default="infokv")
    parser.add_argument("--keep", default="0.5")
    parser.add_argument("--words", type=int, default=200, help="words per uploaded document (default 200)")
    parser.add_argument("--think", type=float, default=0.1, help="mean pause between a client's requests (s)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--documents-per-tenant", type=int, default=6, help="past this, uploads turn into deletes")
    parser.add_argument("--keep-documents", type=int, default=2, help="deletes leave a tenant this many documents")
    parser.add_argument("--max-rss-growth", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tenants < 2:
        parser.error("--tenants must be at least 2 (leaks are between tenants)")
    if not 0 <= args.warmup < 1:
        parser.error(f"--warmup is a fraction of the run, from 0 up to but not including 1 (got {args.warmup})")

    workdir = Path(tempfile.mkdtemp(prefix="infokv-soak-"))
    tenants = [Tenant(f"tenant{i}", f"soak-{i}-{secrets.token_urlsafe(16)}") for i in range(args.tenants)]
    admin_key = f"soak-admin-{secrets.token_urlsafe(16)}"
    server = ServerProcess(
        args.model,
        workdir / "data",
        api_keys=[f"{t.name}:{t.key}" for t in tenants],
        admin_keys=[f"ops:{admin_key}"],
        log_path=workdir / "server.log",
    )
    print(f"starting the server ({args.model}); log: {server.log_path}", file=sys.stderr)
    server.start()
    try:
        soak = Soak(server.url, tenants, args)
        sampler = RssSampler(server.pid, every=1.0)
        sampler.start()
        start = time.monotonic()
        deadline = start + 60 * args.minutes
        threads = [threading.Thread(target=soak.client, args=(i, deadline)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        end = time.monotonic()
        sampler.stopped.set()
        sampler.join()
        admin = {"Authorization": f"Bearer {admin_key}"}  # counters cover every tenant: admin keys only
        counters = httpx.get(server.url + "/healthz", headers=admin).json()["counters"]
        ok = report(soak, sampler, start, end, args.warmup * (end - start), args, counters)
    finally:
        server.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
