"""Read a PDF once into an InfoKV-compressed cache, then answer questions about it.

    make demo                       # or: python examples/demo.py [--model default] [--keep 0.25] [--stored-bits 4]

The sample is an equipment maintenance agreement written for this project (examples/sample/maintenance-
agreement.pdf: an order form with the deal's figures, then standard terms), so no model knows its answers;
the questions and the text a right answer contains come from examples/sample/maintenance-agreement-questions.md.
The compressed cache goes into the cache store ($INFOKV_CACHE_DIR/documents, default
~/.cache/infokv-rag/documents), so a second run (and `infokv-rag ask examples/sample/maintenance-agreement.pdf
--recall 0.1 -q ...`, with the demo's --keep, and any recall above 0: the keep and whether a cold tier is kept are
part of the cache's key, not how much each question recalls) reuses it instead
of reading the document again.

What it prints: each answer, from the compressed cache alone and with recall from its cold tier (`--recall`,
default 0.1; 0 for none, the default with `--method full`), and whether it contains the expected text (as whole
words: `infokv_rag.evaluation.answer_matches`); the compressed cache's size against the full cache's; the time to
the first token of a question answered from the cache against the time to re-read the document; and, for reference,
the same questions against the full (uncompressed) cache and against no document at all (what the model answers
from memory: a right answer there does not need the document). The re-read is measured, not estimated: the document
is prefilled again without compression (method "full"), then the same question is asked; re-reading costs that
prefill plus the question's time to first token on the full cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

from _common import SAMPLE, exit_codes, read_questions, run
from infokv_rag import CacheStore, CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.cli import ProgressBar, ratio_or_count, store_root
from infokv_rag.config import parse_keep
from infokv_rag.documents import load_document
from infokv_rag.errors import ConfigError
from infokv_rag.evaluation import BLANK_DOCUMENT, answer_matches
from infokv_rag.scorers import method, method_names

WRONG_ANSWER_EXIT = 1


def ask_timed(
    doc: CompressedDocument, question: str, max_new_tokens: int, recall: float | None = None
) -> tuple[str, float, float]:
    """(answer, time to first token, total seconds) of one greedy answer, streamed; `recall` as for `ask`."""
    from infokv_rag.generation import GenerationOptions
    from infokv_rag.prompt import question_turns

    started = time.perf_counter()
    options = GenerationOptions(max_new_tokens=max_new_tokens, recall=recall)
    generation = doc.generate(question_turns(question), options)
    answer = generation.text()
    total = time.perf_counter() - started
    return answer.strip(), generation.usage.time_to_first_token or total, total


def ask_checked(
    doc: CompressedDocument, question: str, expected: Sequence[str], max_new_tokens: int, recall: float | None = None
) -> tuple[str, bool, float, float]:
    """`ask_timed`'s (answer, time to first token, total seconds), with whether the answer holds an expected text
    as whole words ("150%" does not hold "50%")."""
    answer, ttft, total = ask_timed(doc, question, max_new_tokens, recall)
    return answer, answer_matches(answer, expected), ttft, total


# What each way of answering reads.
SOURCES = {"compressed": "the compressed cache alone", "recalled": "the compressed cache with recall"}


def megabytes(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__,
        epilog=exit_codes(f"{WRONG_ANSWER_EXIT} with --strict, an answer lacked the expected text"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--method", default="infokv", choices=method_names(), help="compression method (default: infokv)"
    )
    parser.add_argument(
        "--keep",
        type=ratio_or_count("--keep", parse_keep),
        default=0.25,
        help="kept in the cache: ratio (0.25; 1.0: every token) or token count (512)",
    )
    parser.add_argument(
        "--recall",
        type=ratio_or_count("--recall"),
        default=None,
        help="keep a cold tier and recall this much per question: ratio (0.1) or token count (64); 0: none "
        "(default: 0.1, none for a method that keeps every token, such as full)",
    )
    parser.add_argument(
        "--stored-bits",
        type=int,
        default=None,
        choices=(4, 8),
        help="hold the kept entries in codes of this width (default: at the model's dtype)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--store", default=None, help="cache store (default: $INFOKV_CACHE_DIR/documents)")
    parser.add_argument(
        "--strict", action="store_true", help=f"exit {WRONG_ANSWER_EXIT} when an answer lacks the expected text"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    # Refused before the model loads, in one line as any error of infokv-rag's or of the system (`run`).
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.recall is None:  # a method that evicts nothing leaves nothing to recall: a cold tier would be refused
        args.recall = 0.1 if method(args.method).compresses else 0
    config = CompressionConfig(method=args.method, keep=args.keep, recall=args.recall, stored_bits=args.stored_bits)
    document = load_document(SAMPLE)  # before the model loads: a document that cannot be read fails in seconds
    questions = read_questions()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    started = time.perf_counter()
    engine = InfoKVEngine.from_pretrained(args.model, device="cpu")
    source = engine.model_dir.name if engine.model_dir is not None else "in memory"
    print(f"model: {args.model} ({source}), loaded in {time.perf_counter() - started:.1f} s")

    print(f"document: {SAMPLE.name}, {len(document.pages)} pages, {len(document.text):,} characters")
    store = CacheStore(store_root(args.store))
    progress = ProgressBar(f"reading {SAMPLE.name}", enabled=True)
    started = time.perf_counter()
    doc, reused = store.ingest(engine, document, config, progress=progress)
    took = time.perf_counter() - started
    stats = doc.stats
    stored = store.holds(engine, document, config)
    if reused:
        print(f"reused the stored compressed cache in {took:.2f} s (loaded and verified, no prefill)")
    else:
        print(
            f"read and compressed in {took:.1f} s (prefill {stats.prefill_seconds:.1f} s, "
            f"scoring {stats.scoring_seconds:.1f} s, compression {stats.compression_seconds:.2f} s)"
            + ("; stored" if stored else "; not stored (the warning above says why)")
        )
    print(f"cache: {store.path_for(engine, document, config) if stored else 'none stored'}")
    print(
        f"cache size: {megabytes(stats.cache_bytes)} compressed vs {megabytes(stats.full_cache_bytes)} full "
        f"({stats.cache_bytes:,} vs {stats.full_cache_bytes:,} bytes, ratio {stats.compression_ratio:.3f}); "
        f"{stats.document_tokens:,} document tokens, {stats.kept_tokens / len(stats.kept_tokens_per_layer):,.0f} kept "
        f"per layer on average "
        f"(method {stats.method}, keep {stats.keep})"
    )
    if doc.cold_tier is not None:
        recalled = (
            f"{args.recall:.0%} of the document's tokens"
            if isinstance(args.recall, float)
            else f"{args.recall:,} tokens"
        )
        print(
            f"cold tier: {megabytes(stats.cold_bytes)} ({doc.cold_tier.bits}-bit) of evicted entries; each question "
            f"recalls {recalled} per layer from it"
        )

    print()
    ways = {"compressed": 0.0, "recalled": None} if doc.cold_tier is not None else {"compressed": None}
    right = {way: [False] * len(questions) for way in ways}
    for number, (question, expected) in enumerate(questions, start=1):
        print(f"Q{number}: {question}")
        for way, recall in ways.items():
            answer, ok, ttft, total = ask_checked(doc, question, expected, args.max_new_tokens, recall)
            right[way][number - 1] = ok
            last = (way, ttft, total)
            label = f"A{number} ({way})" if len(ways) > 1 else f"A{number}"
            print(f"{label}: {answer}")
            print(
                f"    expected to contain {' or '.join(repr(e) for e in expected)}: {'yes' if ok else 'NO'}"
                f"   (first token {ttft:.2f} s, answer {total:.1f} s)"
            )
    for way in ways:
        print(f"\n{sum(right[way])}/{len(questions)} answers from {SOURCES[way]} contain the expected text", end="")
    print()
    final = sum(right["recalled" if len(ways) > 1 else "compressed"])

    # Re-reading: what every question would cost without a stored cache, measured now.
    print("\nmeasuring a re-read of the document for comparison (uncompressed prefill) ...", flush=True)
    full = engine.ingest_document(document, CompressionConfig(method="full"))
    follow_up = questions[-1][0]
    _, full_ttft, _ = ask_timed(full, follow_up, 1)
    reread = full.stats.prefill_seconds + full_ttft
    # The last answer: the follow-up's, asked the last way (with recall where there is a cold tier).
    way, ttft, total = last
    print(
        f"follow-up question (Q{len(questions)}) from {SOURCES[way]}: first token after {ttft:.2f} s, "
        f"whole answer {total:.1f} s"
    )
    print(
        f"re-reading the document for it instead: {reread:.1f} s to the first token "
        f"(measured: prefill of {stats.document_tokens:,} tokens {full.stats.prefill_seconds:.1f} s "
        f"+ the question on the full cache {full_ttft:.2f} s)"
    )
    print(f"the follow-up's first token comes {reread / ttft:.0f}x sooner than by re-reading")

    # What compression cost: the same questions against the uncompressed cache just built, and against no document
    # (the model's memory), which tells the answers that need the document from those the model knows anyway.
    references = {"full cache": full, "no document": engine.ingest_document(BLANK_DOCUMENT, CompressionConfig("full"))}
    print("\nthe same questions against the full (uncompressed) cache and against no document, for reference:")
    right.update({name: [False] * len(questions) for name in references})
    for number, (question, expected) in enumerate(questions, start=1):
        for name, reference in references.items():
            answer, ok, _, _ = ask_checked(reference, question, expected, args.max_new_tokens)
            right[name][number - 1] = ok
            print(f"A{number} ({name}): {answer}   [{'yes' if ok else 'NO'}]")
    recalled = f", {sum(right['recalled'])}/{len(questions)} with recall" if len(ways) > 1 else ""
    full_right, blank_right = right["full cache"], right["no document"]
    dependent = [i for i in range(len(questions)) if full_right[i] and not blank_right[i]]
    kept = sum(right["compressed"][i] for i in dependent)
    print(
        f"\nsummary: {sum(right['compressed'])}/{len(questions)} right from the compressed cache "
        f"({stats.compression_ratio:.0%} of the full cache's bytes){recalled}, "
        f"{sum(full_right)}/{len(questions)} from the full cache, {sum(blank_right)}/{len(questions)} with no document"
    )
    print(
        f"of the {len(dependent)} answers that need the document (the full cache right, no document wrong), the "
        f"compressed cache alone keeps {kept}"
    )
    return WRONG_ANSWER_EXIT if args.strict and final < len(questions) else 0


if __name__ == "__main__":
    sys.exit(run(main, __file__))
