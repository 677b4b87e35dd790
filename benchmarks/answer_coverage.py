"""Where lost answers went: how much of each answer's own text a compressed cache still holds.

    python -m benchmarks.answer_coverage --split dev --rows infokv@0.25 kvzip@0.25

For each question of the real-document corpus (`benchmarks/realdocs`), its accepted answers are looked up
in the document's own tokens (case-insensitive, every occurrence). Each row's cache is built the way the
product builds it (the PDF, then `ingest_document`); an occurrence's coverage is the share of its
(layer, KV head, token) entries that the hot cache kept, and a question's coverage is that of its best
occurrence. Joined with the verdicts `benchmarks.realdocs_quality` cached for the same rows (run it first:
this script answers nothing itself), the table tells a lost answer whose tokens were evicted (the scoring
chose wrong) from one whose tokens were kept and which was lost anyway (context around them, or the model).

Questions whose answers do not appear verbatim in the document (a paraphrase, a computed number) have no
coverage and are listed as such.
"""

from __future__ import annotations

import argparse
import bisect
import re
import statistics
import sys
from collections.abc import Sequence

import torch
from torch import Tensor

from benchmarks.quality import progress
from benchmarks.realdocs import SPLITS, load_realdocs
from benchmarks.realdocs_quality import (
    FULL_ROW,
    NO_DOCUMENT_ROW,
    Bench,
    EngineRow,
    ResultCache,
    default_cache_dir,
    parse_rows,
)
from infokv_rag import CompressedDocument, InfoKVEngine
from infokv_rag.documents import Document, load_document
from infokv_rag.evaluation import answer_matches


def answer_spans(engine: InfoKVEngine, ids: Sequence[int], answers: Sequence[str]) -> list[range]:
    """Token index ranges of every occurrence of any of `answers` in the document prefix `ids`, as whole words
    ("42" is not in "1,420" nor "420", as the checker takes a number whole)."""
    pieces = [engine.tokenizer.decode([token]) for token in ids]
    starts, offset = [], 0
    for piece in pieces:
        starts.append(offset)
        offset += len(piece)
    text = "".join(pieces).lower()
    spans = []
    for answer in answers:
        if not answer:
            continue
        # Not inside a word or a longer number: no letter or digit beside it, nor a decimal or thousands separator.
        whole = re.compile(rf"(?<!\w)(?<!\d[.,]){re.escape(answer.lower())}(?!\w)(?![.,]\d)")
        for found in whole.finditer(text):
            # The tokens from the one the answer starts in to the one it ends in.
            spans.append(range(bisect.bisect_right(starts, found.start()) - 1, bisect.bisect_left(starts, found.end())))
    return spans


def kept_entries(compressed: CompressedDocument) -> Tensor:
    """(layers, kv_heads, n) True where the hot cache holds the entry of that document position."""
    n = compressed.cache.document_tokens
    layers = compressed.cache.layer_positions()
    kept = torch.zeros(len(layers), layers[0].shape[0], n, dtype=torch.bool)
    for layer in range(len(layers)):
        for head, positions in enumerate(compressed.cache.kept_positions(layer)):
            kept[layer, head, positions.cpu()] = True
    return kept


def coverage(kept: Tensor, spans: Sequence[range]) -> float | None:
    """The best span's share of kept entries, or None without a span."""
    shares = [float(kept[:, :, span.start : span.stop].float().mean()) for span in spans]
    return max(shares) if shares else None


def verdicts(
    bench: Bench, document: Document, row: EngineRow, questions: dict[str, tuple[str, ...]]
) -> dict[str, bool]:
    """The cached right/wrong of `row` per question (questions it never answered are left out)."""
    record = bench.cache.load(bench.key(document, row.identity()), row.label)
    return {
        question: answer_matches(result["answer"], questions[question])
        for question, result in record["questions"].items()
        if question in questions
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--split", default="dev", choices=SPLITS)
    parser.add_argument("--docs", nargs="+", default=None, help="only these document ids")
    parser.add_argument("--rows", nargs="+", required=True, help="rows as in benchmarks.realdocs_quality")
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="as the realdocs_quality run used")
    args = parser.parse_args(argv)
    rows = parse_rows(args.rows)
    engine = InfoKVEngine.from_pretrained(args.model)
    bench = Bench(engine, ResultCache(default_cache_dir(), lambda label: False), args.max_new_tokens)
    lines = [
        "| document | question | full | " + " | ".join(f"{row.label} coverage, verdict" for row in rows) + " |",
        "|---|---|---|" + "---|" * len(rows),
    ]
    covered: dict[tuple[str, bool], list[float]] = {}
    for doc in load_realdocs(args.split, doc_ids=args.docs):
        document = load_document(doc.pdf_path)
        questions = dict(doc.questions)
        full, blank = (verdicts(bench, document, row, questions) for row in (FULL_ROW, NO_DOCUMENT_ROW))
        if not full:
            raise SystemExit(f"no cached answers for {doc.doc_id}: run benchmarks.realdocs_quality on it first")
        ids = engine.prompt.document_ids(document.text)
        spans = {question: answer_spans(engine, ids, answers) for question, answers in questions.items()}
        cells: dict[str, list[str]] = {question: [] for question in questions}
        for row in rows:
            progress(f"{doc.doc_id}: {row.label}")
            kept = kept_entries(engine.ingest_document(document, row.config))
            answered = verdicts(bench, document, row, questions)
            for question in questions:
                share, right = coverage(kept, spans[question]), answered.get(question)
                verdict = "?" if right is None else ("right" if right else "wrong")
                cells[question].append(f"{'-' if share is None else f'{share:.2f}'}, {verdict}")
                if share is not None and right is not None and full.get(question) and not blank.get(question):
                    covered.setdefault((row.label, right), []).append(share)
        for question in questions:
            mark = "right" if full.get(question) else "wrong"
            lines.append(f"| {doc.doc_id} | {question} | {mark} | " + " | ".join(cells[question]) + " |")
    print("\n".join(lines))
    print("\nDocument-dependent questions whose answer appears in the document: mean coverage")
    print("| row | answers kept: n, mean coverage | answers lost: n, mean coverage |\n|---|---|---|")
    for row in rows:
        kept_shares, lost_shares = covered.get((row.label, True), []), covered.get((row.label, False), [])

        def cell(shares: list[float]) -> str:
            return f"{len(shares)}, {statistics.mean(shares):.2f}" if shares else "0, -"

        print(f"| {row.label} | {cell(kept_shares)} | {cell(lost_shares)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
