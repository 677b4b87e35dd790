"""Follow-up latency: answering from a stored compressed cache vs re-reading the document per question.

    python benchmarks/latency.py                         # default model, ~4K-token document (make bench-latency)
    python benchmarks/latency.py --model tiny --words 600   # a quick run

Measured on one planted-fact document (`infokv_rag.evaluation.make_fact_document`):
- ingestion: chunked prefill + InfoKV scoring + compression (keep 0.25 by default);
- save, and load from disk (manifest and sha256 checks, tensors rebuilt), median of --repeats loads;
- follow-up time to first token (TTFT): wall time of `generate(question, max_new_tokens=1)` against the
  in-memory cache and against the reloaded disk cache, median over the document's questions x repeats;
- re-prefill: what a question costs without a stored cache, measured: one plain forward pass of the
  model (Hugging Face, no compression, no signal capture) over the document + question tokens, up to the
  first token's logits. Same tokens as the cached path: the document prefix followed by the question.
Targets (from the issue): follow-up TTFT at least 20x faster than re-prefilling; loading under 0.5 s.

With a cold tier (`--recall R`, default 0.1; 0 for none) the same document is ingested with it, and each
question is asked with recall and without (recall=0) in turn, on the same cache in the same run: TTFT
with recall over TTFT without (target <= 1.5x, issue 13); hot + cold bytes on disk over the full cache
at the model's dtype (target <= 0.5); the document's hot cache (which every answer reads in place) plus the
most keys and values one answer held of its own (from its tensors: recalled entries, question and answer)
over the full cache (target <= the document's cache + recall + the question's share).

With `--stored-bits B` the document is also ingested with its kept entries held in codes of B bits
(`CompressionConfig.stored_bits`), and each question is asked of both caches in turn (without recall): the codes'
bytes, TTFT and the time per generated token from codes over those at the model's dtype, and what one answer
holds: it decodes each layer's codes, and its heads' extras, whenever that layer attends (one layer at a time,
dropped after).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.config import DEFAULT_METHOD, recall_tokens
from infokv_rag.documents import document_from_text
from infokv_rag.evaluation import make_fact_document
from infokv_rag.generation import GenerationOptions, Usage
from infokv_rag.ingestion import DocumentStats
from infokv_rag.prompt import question_turns
from infokv_rag.scorers import method_names

TTFT_SPEEDUP_TARGET = 20.0
LOAD_TARGET_SECONDS = 0.5


def follow_up_seconds(doc: CompressedDocument, question: str, recall: float | None = None) -> float:
    """Wall time from asking to the first generated token (`recall`: as `GenerationOptions.recall`)."""
    return follow_up(doc, question, recall)[0]


def follow_up(doc: CompressedDocument, question: str, recall: float | None = None) -> tuple[float, Usage]:
    """(wall time from asking to the first generated token, the answer's usage)."""
    started = time.perf_counter()
    generation = doc.generate(question_turns(question), GenerationOptions(max_new_tokens=1, recall=recall))
    generation.text()
    return time.perf_counter() - started, generation.usage


LONG_ANSWER = "Repeat the first paragraph of the document word for word."
"""A question whose answer runs to `DECODE_TOKENS` tokens, to time decoding."""
DECODE_TOKENS = 40


def seconds_per_token(doc: CompressedDocument) -> float:
    """Wall seconds per generated token after the first, over a `DECODE_TOKENS`-token answer."""
    started = time.perf_counter()
    generation = doc.generate(question_turns(LONG_ANSWER), GenerationOptions(max_new_tokens=DECODE_TOKENS))
    generation.text()
    usage = generation.usage
    assert usage.time_to_first_token is not None
    return (time.perf_counter() - started - usage.time_to_first_token) / max(usage.completion_tokens - 1, 1)


@torch.inference_mode()
def reprefill_seconds(engine: InfoKVEngine, text: str, question: str) -> tuple[float, int]:
    """A plain forward of document + question to the first token's logits: (seconds, tokens)."""
    ids = engine.prompt.document_ids(text) + engine.prompt.conversation_ids(question_turns(question))
    input_ids = torch.tensor([ids], device=engine.runner.device)
    started = time.perf_counter()
    with engine.lock:
        output = engine.model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
    int(output.logits[0, -1].argmax())
    return time.perf_counter() - started, len(ids)


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="default, tiny, a local HF directory or a .gguf file")
    parser.add_argument("--words", type=int, default=3300, help="document length in words (3300: ~4K tokens)")
    parser.add_argument("--seed", type=int, default=0, help="which planted-fact document")
    parser.add_argument("--method", default=DEFAULT_METHOD, choices=method_names())
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--recall", type=float, default=0.1, help="cold-tier recall per question (0: no cold tier)")
    parser.add_argument(
        "--cold-bits",
        type=int,
        default=None,
        choices=(4, 8),
        help="width of the cold tier's codes (default: the engine's choice for the model's dtype)",
    )
    parser.add_argument(
        "--stored-bits",
        type=int,
        default=None,
        choices=(4, 8),
        help="also hold the document's kept entries in codes of this width and compare its answers' TTFT",
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of follow-up questions and of loads")
    parser.add_argument("--reprefills", type=int, default=1, help="re-prefill measurements (each costs a full prefill)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]

    device = "cpu" if not torch.cuda.is_available() else "cuda"
    started = time.perf_counter()
    engine = InfoKVEngine.from_pretrained(args.model, device=device)
    print(
        f"model {args.model} loaded in {time.perf_counter() - started:.1f} s on {device}, "
        f"{torch.get_num_threads()} threads",
        file=sys.stderr,
    )
    fact_doc = make_fact_document(args.seed, target_words=args.words)
    questions = [fact.question for fact in fact_doc.facts]
    document = document_from_text(fact_doc.text)

    # Warm-up (allocator, kernels), not measured.
    engine.ingest_text(" ".join(fact_doc.text.split()[:200]), CompressionConfig(method=args.method, keep=args.keep))

    config = CompressionConfig(method=args.method, keep=args.keep, recall=args.recall, cold_bits=args.cold_bits)
    print(f"ingesting {len(fact_doc.text.split()):,} words ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    doc = engine.ingest_document(document, config)
    ingest_seconds = time.perf_counter() - started
    stats = doc.stats
    coded = None
    if args.stored_bits:
        print(f"ingesting it again, held in {args.stored_bits}-bit codes ...", file=sys.stderr, flush=True)
        coded = engine.ingest_document(document, dataclasses.replace(config, stored_bits=args.stored_bits))

    in_memory, with_recall, recall_usages, from_codes = [], [], [], []
    plain_usages, coded_usages = [], []
    for _ in range(args.repeats):
        for question in questions:
            seconds, usage = follow_up(doc, question, recall=0)
            in_memory.append(seconds)
            plain_usages.append(usage)
            if coded is not None:
                seconds, usage = follow_up(coded, question, recall=0)
                from_codes.append(seconds)
                coded_usages.append(usage)
            if doc.cold_tier is not None:
                seconds, usage = follow_up(doc, question)
                with_recall.append(seconds)
                recall_usages.append(usage)

    with tempfile.TemporaryDirectory(prefix="infokv-latency-") as workdir:
        started = time.perf_counter()
        path = doc.save(Path(workdir) / "cache")
        save_seconds = time.perf_counter() - started
        cache_file_bytes = sum(p.stat().st_size for p in path.iterdir())
        loads, reloaded, reloaded_recall = [], [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            loaded = engine.load(path)
            loads.append(time.perf_counter() - started)
            reloaded += [follow_up_seconds(loaded, q, recall=0) for q in questions]
            if loaded.cold_tier is not None:
                reloaded_recall += [follow_up_seconds(loaded, q) for q in questions]

    print("measuring re-prefill of document + question ...", file=sys.stderr, flush=True)
    reprefills = []
    for index in range(args.reprefills):
        seconds, prompt_tokens = reprefill_seconds(engine, fact_doc.text, questions[index % len(questions)])
        reprefills.append(seconds)

    ttft_memory = statistics.median(in_memory)
    ttft_disk = statistics.median(reloaded)
    load = statistics.median(loads)
    reprefill = statistics.median(reprefills)
    speedup_memory = reprefill / ttft_memory
    speedup_disk = reprefill / ttft_disk
    speedup_disk_with_load = reprefill / (load + ttft_disk)

    def met(ok: bool) -> str:
        return "yes" if ok else "**no**"

    rows = [
        ("document", f"{stats.document_tokens:,} tokens ({args.words:,} words, seed {args.seed})", "", ""),
        (
            "cache kept",
            f"{stats.kept_tokens_per_layer[0]:,} tokens per layer ({config.method}, keep {config.keep}); "
            f"{stats.cache_bytes / 2**20:,.1f} MiB vs {stats.full_cache_bytes / 2**20:,.1f} MiB full "
            f"(ratio {stats.compression_ratio:.3f}); {cache_file_bytes / 2**20:,.1f} MiB on disk",
            "",
            "",
        ),
        (
            "ingestion (prefill + scoring + compression)",
            f"{fmt(ingest_seconds)} (prefill {fmt(stats.prefill_seconds)}, "
            f"{stats.document_tokens / stats.prefill_seconds:,.0f} tok/s; scoring {fmt(stats.scoring_seconds)}; "
            f"compression {fmt(stats.compression_seconds)})",
            "",
            "",
        ),
        ("save (atomic, fsynced)", fmt(save_seconds), "", ""),
        (
            "load from disk (verify + rebuild), median",
            f"{fmt(load)} (min {fmt(min(loads))}, max {fmt(max(loads))})",
            f"< {LOAD_TARGET_SECONDS} s",
            met(load < LOAD_TARGET_SECONDS),
        ),
        (
            "follow-up TTFT, in-memory cache, median",
            f"{fmt(ttft_memory)} (min {fmt(min(in_memory))}, max {fmt(max(in_memory))}, n={len(in_memory)})",
            "",
            "",
        ),
        (
            "follow-up TTFT, reloaded disk cache, median",
            f"{fmt(ttft_disk)} (min {fmt(min(reloaded))}, max {fmt(max(reloaded))}, n={len(reloaded)})",
            "",
            "",
        ),
        (
            "re-prefill document + question to first token",
            f"{fmt(reprefill)} ({prompt_tokens:,} tokens, plain forward, n={len(reprefills)})",
            "",
            "",
        ),
        (
            "speedup: re-prefill / TTFT in memory",
            f"{speedup_memory:,.1f}x",
            f">= {TTFT_SPEEDUP_TARGET:.0f}x",
            met(speedup_memory >= TTFT_SPEEDUP_TARGET),
        ),
        (
            "speedup: re-prefill / TTFT reloaded",
            f"{speedup_disk:,.1f}x",
            f">= {TTFT_SPEEDUP_TARGET:.0f}x",
            met(speedup_disk >= TTFT_SPEEDUP_TARGET),
        ),
        ("speedup: re-prefill / (load + TTFT reloaded)", f"{speedup_disk_with_load:,.1f}x", "", ""),
        ("held by one answer beside the document's cache / full", own_share(plain_usages, stats), "", ""),
    ]
    if coded is not None:
        per_token: dict[str, list[float]] = {"dtype": [], "codes": []}
        for _ in range(args.repeats):
            per_token["dtype"].append(seconds_per_token(doc))
            per_token["codes"].append(seconds_per_token(coded))
        at_dtype, from_codes_token = (statistics.median(per_token[label]) for label in ("dtype", "codes"))
        rows += [
            (
                f"cache in {args.stored_bits}-bit codes (`--stored-bits`)",
                f"{coded.stats.cache_bytes / 2**20:,.1f} MiB (ratio {coded.stats.compression_ratio:.3f}) against "
                f"{stats.cache_bytes / 2**20:,.1f} MiB at the model's dtype",
                "",
                "",
            ),
            (
                "follow-up TTFT from the codes, median",
                f"{fmt(statistics.median(from_codes))} ({statistics.median(from_codes) / ttft_memory:.2f}x the "
                f"model's dtype's, asked in turn; n={len(from_codes)})",
                "",
                "",
            ),
            (
                "time per generated token from the codes, median",
                f"{fmt(from_codes_token)} ({from_codes_token / at_dtype:.2f}x the model's dtype's {fmt(at_dtype)}; "
                f"a {DECODE_TOKENS}-token answer, asked in turn; n={len(per_token['codes'])})",
                "",
                "",
            ),
            (
                "held by one answer beside the codes / full",
                f"{own_share(coded_usages, stats)}; beside it, one layer's decode while that layer attends: "
                f"{layer_decode_share(coded):.4f} (transient)",
                "",
                "",
            ),
        ]
    if with_recall:
        rows += recall_rows(
            args, engine, doc, in_memory, with_recall, reloaded_recall, recall_usages, reprefill, cache_file_bytes
        )
    print(
        f"\n### Follow-up latency: model `{args.model}`, {device}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after\n"
    )
    print("| measurement | value | target | met |")
    print("|---|---|---|---|")
    for name, value, target, ok in rows:
        print(f"| {name} | {value} | {target} | {ok} |")
    all_met = load < LOAD_TARGET_SECONDS and min(speedup_memory, speedup_disk) >= TTFT_SPEEDUP_TARGET
    print(
        f"\nTargets: follow-up TTFT >= {TTFT_SPEEDUP_TARGET:.0f}x faster than re-prefilling "
        f"({met(min(speedup_memory, speedup_disk) >= TTFT_SPEEDUP_TARGET)}); "
        f"load < {LOAD_TARGET_SECONDS} s ({met(load < LOAD_TARGET_SECONDS)})."
    )
    return 0 if all_met else 1


def own_share(usages: list[Usage], stats: DocumentStats) -> str:
    """The most bytes one answer held of its own (`Usage.peak_cache_bytes`, up to its first token) over the full
    cache's."""
    return f"{max(usage.peak_cache_bytes for usage in usages) / stats.full_cache_bytes:.4f} (peak, from tensors)"


def layer_decode_share(coded: CompressedDocument) -> float:
    """The largest layer's kept entries (its own and its heads' extras) at the model's dtype over the full cache:
    what an answer from codes decodes for one layer's attention and drops after it."""
    runner = coded.engine.runner
    element = torch.empty(0, dtype=runner.dtype).element_size()
    entries = max(
        sum(len(positions) for positions in coded.cache.kept_positions(layer))
        for layer in range(len(coded.cache.lengths))
    )
    return 2 * entries * runner.head_dim * element / coded.stats.full_cache_bytes


RECALL_TTFT_TARGET = 1.5
DISK_TARGET = 0.5


def recall_rows(
    args: argparse.Namespace,
    engine: InfoKVEngine,
    doc: CompressedDocument,
    without: list[float],
    with_recall: list[float],
    reloaded_recall: list[float],
    usages: list[Usage],
    reprefill: float,
    disk_bytes: int,
) -> list[tuple[str, str, str, str]]:
    """The cold tier's rows: TTFT with recall against without, disk and resident bytes against the full cache."""
    if doc.cold_tier is None:
        raise ValueError("the cold tier's rows need a document ingested with recall")
    stats = doc.stats
    n, element = stats.document_tokens, torch.empty(0, dtype=engine.runner.dtype).element_size()
    ratio = statistics.median(with_recall) / statistics.median(without)
    disk = disk_bytes / stats.full_cache_bytes
    # At 16 bits the hot cache and the full one halve (fp32 on this CPU); the cold tier's codes stay as they are.
    disk_16 = (disk_bytes - stats.cache_bytes * (1 - 2 / element)) / (stats.full_cache_bytes * 2 / element)
    # The document's cache, which the answer reads in place, and what the answer held of its own beside it.
    peak = (stats.cache_bytes + max(usage.peak_cache_bytes for usage in usages)) / stats.full_cache_bytes
    question = max(usage.prompt_tokens for usage in usages)
    bound = stats.compression_ratio + (recall_tokens(args.recall, n) + question) / n
    recalled = statistics.median(usage.recalled_tokens for usage in usages) / len(doc.cache.lengths)
    # While the question is read, one layer at a time holds its cold keys and values dequantised, with each
    # head's extras beside them (float32): every entry outside the layer.
    per_entry = 2 * engine.runner.kv_heads * engine.runner.head_dim * 4
    decoded = max((n - length) * per_entry for length in doc.cache.lengths)

    def met(ok: bool) -> str:
        return "yes" if ok else "**no**"

    return [
        (
            "cold tier",
            f"{doc.config.cold_bits}-bit, {stats.cold_bytes / 2**20:,.1f} MiB; recall {args.recall} "
            f"({recalled:,.0f} entries per layer and KV head per question)",
            "",
            "",
        ),
        ("follow-up TTFT with recall, in memory, median", fmt(statistics.median(with_recall)), "", ""),
        ("follow-up TTFT with recall, reloaded, median", fmt(statistics.median(reloaded_recall)), "", ""),
        (
            "TTFT with recall / without (same questions, interleaved)",
            f"{ratio:.2f}x",
            f"<= {RECALL_TTFT_TARGET}x",
            met(ratio <= RECALL_TTFT_TARGET),
        ),
        ("speedup: re-prefill / TTFT with recall", f"{reprefill / statistics.median(with_recall):,.1f}x", "", ""),
        (
            "disk: hot + cold tier / full cache at the model's dtype",
            f"{disk:.3f} ({engine.runner.dtype}); these "
            f"{doc.config.cold_bits}-bit codes beside a 16-bit cache: {disk_16:.3f} (a 16-bit cache gets "
            f"{CompressionConfig(recall=args.recall).cold_tier_bits(2)}-bit codes by default)",
            f"<= {DISK_TARGET}",
            met(disk <= DISK_TARGET),
        ),
        (
            "resident KV while answering / full (the document's cache + the answer's own peak, from tensors)",
            f"{peak:.3f}",
            f"<= the document's cache + recall + question = {bound:.3f}",
            met(peak <= bound),
        ),
        (
            "beside it while the question is read: one layer's cold entries and extras in float32 / full",
            f"{decoded / stats.full_cache_bytes:.3f} ({decoded / 2**20:,.1f} MiB, transient)",
            "",
            "",
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
