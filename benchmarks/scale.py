"""Scale-out benchmark: the Ray Serve application with 1 and 2 model-worker replicas on the same documents.

Starts a local Ray instance and the application (`infokv_rag.service.ray_app`) on a file:// store, uploads
--documents planted-fact documents once, then for 1 and then 2 replicas runs --clients concurrent clients
for --duration seconds, each asking a random planted question of a random document (JSON /ask,
--max-tokens tokens). Reports answers per minute and p50/p95 latency side by side, with the 2/1 ratios.
Then the time to the first answer of a document on replicas that never saw it: the application is
restarted, and the first question's latency (the cache loaded from the store) is set against reading the
same document again (upload until ready, then the first question).

    python benchmarks/scale.py                                     # tiny, 4 documents, 4 clients, 60 s each
    python benchmarks/scale.py --documents 2 --clients 2 --duration 10 --words 150   # a smoke run

On one machine both replicas share its cores, so the 2/1 ratio measures what the cores allow; on a cluster
each replica has its own GPU or CPUs (`--replica-cpus`).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve

from infokv_rag.evaluation import FactDocument, make_fact_document
from infokv_rag.service.launcher import free_port
from infokv_rag.service.ray_app import APP_NAME, build_app
from infokv_rag.service.settings import Settings

KEY = "bench-key-0123456789"
HEADERS = {"Authorization": f"Bearer {KEY}"}
TIMEOUT = 900.0


def deploy(settings: Settings, replicas: int, replica_cpus: float) -> None:
    serve.run(build_app(settings, replicas, replica_cpus), name=APP_NAME, route_prefix="/")


def call(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """Retries 503 (a queue is full, or a replica is starting) until TIMEOUT."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        response = client.request(method, path, headers=HEADERS, **kwargs)
        if response.status_code != 503 or time.monotonic() > deadline:
            response.raise_for_status()
            return response
        time.sleep(0.5)


def upload_ready(client: httpx.Client, name: str, text: str) -> str:
    doc_id = call(client, "POST", "/v1/documents", files={"file": (name, text.encode())}).json()["id"]
    deadline = time.monotonic() + TIMEOUT
    while (status := call(client, "GET", f"/v1/documents/{doc_id}").json()["status"]) != "ready":
        if status == "failed" or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become ready ({status})")
        time.sleep(0.2)
    return str(doc_id)


def ask(client: httpx.Client, doc_id: str, question: str, max_tokens: int) -> float:
    began = time.perf_counter()
    call(client, "POST", f"/v1/documents/{doc_id}/ask", json={"question": question, "max_tokens": max_tokens})
    return time.perf_counter() - began


def load_run(url: str, documents: dict[str, FactDocument], args: argparse.Namespace) -> dict[str, float]:
    """--clients clients asking for --duration seconds; answers per minute and latency percentiles."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + args.duration

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
            while time.monotonic() < stop:
                doc_id = rng.choice(list(documents))
                question = rng.choice(documents[doc_id].facts).question
                seconds = ask(client, doc_id, question, args.max_tokens)
                with lock:
                    latencies.append(seconds)

    began = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(seed,)) for seed in range(args.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - began
    ordered = sorted(latencies)
    return {
        "answers": len(ordered),
        "answers_per_minute": 60 * len(ordered) / elapsed,
        "p50": statistics.median(ordered),
        "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
    }


def first_answer_times(url: str, settings: Settings, args: argparse.Namespace) -> dict[str, float]:
    """On freshly started replicas: the first answer of a ready document (loaded from the store) vs reading
    the same text again (upload until ready, then the first answer)."""
    fact_doc = make_fact_document(seed=999, target_words=args.words)
    question = fact_doc.facts[0].question
    with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
        doc_id = upload_ready(client, "first.txt", fact_doc.text)
        serve.delete(APP_NAME)
        deploy(settings, 1, args.replica_cpus)
        from_store = ask(client, doc_id, question, args.max_tokens)
        began = time.perf_counter()
        again = upload_ready(client, "again.txt", fact_doc.text)
        ask(client, again, question, args.max_tokens)
        return {"store_load": from_store, "read_again": time.perf_counter() - began}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--words", type=int, default=600, help="words per document")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per replica count")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs of the local Ray instance")
    parser.add_argument("--replica-cpus", type=float, default=1.0)
    parser.add_argument("--store", default=None, help="a store URL (default: file:// in a temporary directory)")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="infokv-scale-"))
    settings = Settings(
        model=args.model,
        store=args.store or f"file://{work}/store",
        data_dir=work / "local",
        api_keys=(f"bench:{KEY}",),
        max_new_tokens=max(args.max_tokens, 16),
        default_max_tokens=args.max_tokens,
    )
    port = free_port()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = f"http://127.0.0.1:{port}"
        results: dict[int, dict[str, float]] = {}
        documents: dict[str, FactDocument] = {}
        for replicas in (1, 2):
            deploy(settings, replicas, args.replica_cpus)
            if not documents:
                with httpx.Client(base_url=url, timeout=TIMEOUT) as client:
                    for index in range(args.documents):
                        fact_doc = make_fact_document(seed=100 + index, target_words=args.words)
                        documents[upload_ready(client, f"doc{index}.txt", fact_doc.text)] = fact_doc
            results[replicas] = load_run(url, documents, args)
        first = first_answer_times(url, settings, args)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(
        f"model {args.model}, {args.documents} documents of ~{args.words} words, {args.clients} clients, "
        f"{args.duration:.0f} s per replica count, {args.max_tokens} new tokens, {args.cpus} CPUs"
    )
    print("| replicas | answers | answers/min | p50 s | p95 s |")
    print("|---|---|---|---|---|")
    for replicas, row in results.items():
        print(
            f"| {replicas} | {row['answers']:.0f} | {row['answers_per_minute']:.1f} | {row['p50']:.2f} | "
            f"{row['p95']:.2f} |"
        )
    one, two = results[1], results[2]
    print(
        f"| 2 / 1 | | {two['answers_per_minute'] / one['answers_per_minute']:.2f}x | "
        f"{two['p50'] / one['p50']:.2f}x | {two['p95'] / one['p95']:.2f}x |"
    )
    print(
        f"\nfirst answer on a replica that never saw the document: {first['store_load']:.2f} s from the store, "
        f"{first['read_again']:.2f} s reading it again ({first['read_again'] / first['store_load']:.1f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
