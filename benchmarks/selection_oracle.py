"""How far can choosing which tokens to keep go? Selection by the questions' own attention, an oracle.

    python -m benchmarks.selection_oracle --split dev --keep 0.25

For each document of the real-document corpus (`benchmarks/realdocs`): one prefill of the whole document
(one chunk), then the cache is compressed at the same budget, with the same machinery, several ways
(the default's: sinks, observation window, one threshold over every (layer, KV head), word units, summaries):

- `infokv` (and any `--rows` of the engine, e.g. `infokv@0.25[value_weighting=True]`): their own scores;
- `oracle: questions`: a token's score is the most attention any token of any of the document's questions
  (each asked as the product asks it, over the full cache) pays it, over the query heads of its KV group;
  it sets the layer budgets as well as the tokens kept;
- `oracle: questions + answers`: the same with the full cache's answer teacher-forced after each question,
  so it also sees what every token of the full cache's answer reads;
- `oracle budgets, default ranking` and `default budgets, oracle ranking`: that oracle split in two, the layer
  budgets from one and the choice within each layer from the other, to tell which of the two loses answers.

The oracles know the questions, so they are not methods: they tell how much of what a compressed cache loses
any choice of tokens could keep with this model at this budget, and so how far a query-agnostic scorer
could still get. Only document-dependent questions are answered (greedy, as `realdocs_quality`), with the
mean KL(full || row) teacher-forced on the full cache's answers. The `full` and `no document` rows that
define them come from `realdocs_quality`'s cache (computed here into it when missing). `--oracles` runs
some of the oracle rows only (each costs an answer per dependent question); `--oracles` with no name runs the
`--rows` alone, a screen of settings from one prefill per document:

    python -m benchmarks.selection_oracle --split dev --oracles --rows infokv@0.25 'infokv@0.25[units=clause]'
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from benchmarks.quality import mean_kl, progress
from benchmarks.realdocs import SPLITS, load_realdocs
from benchmarks.realdocs_quality import (
    FULL,
    Bench,
    DocumentResult,
    EngineRow,
    ResultCache,
    answer,
    default_cache_dir,
    parse_rows,
)
from benchmarks.variants import Rescorer, compress_variants, teacher_forced_logits
from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.cache import DocumentCache
from infokv_rag.documents import load_document
from infokv_rag.evaluation import answer_matches
from infokv_rag.prompt import question_turns
from infokv_rag.scorers.base import Scorer
from infokv_rag.signals import LayerSignals

ROOT = Path(__file__).resolve().parent.parent
ORACLE_QUESTIONS = "oracle: questions"
ORACLE_ANSWERS = "oracle: questions + answers"
ORACLE_BUDGETS = "oracle budgets, default ranking"
ORACLE_RANKING = "default budgets, oracle ranking"
ORACLES = (ORACLE_QUESTIONS, ORACLE_ANSWERS, ORACLE_BUDGETS, ORACLE_RANKING)


class QuestionAttention:
    """A forward capture: per layer, the most attention any of the run's tokens pays each document token.

    `attention[layer]` is (kv_heads, n), the maximum over every query head of the KV group, every query
    token and every run captured so far (softmax over the whole cache, the run's own tokens causally)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.attention: dict[int, Tensor] = {}

    def record_attention(self, layer: int, queries: Tensor, keys: Tensor, scaling: float) -> None:
        heads, count, _ = queries.shape
        kv_heads, total, _ = keys.shape
        grouped = queries.float().reshape(kv_heads, heads // kv_heads * count, -1)
        logits = (grouped @ keys.float().transpose(1, 2) * scaling).reshape(kv_heads, heads // kv_heads, count, total)
        visible = torch.ones(count, total, dtype=torch.bool, device=keys.device).tril(diagonal=total - count)
        probabilities = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1)[..., : self.n]
        most = probabilities.amax(dim=(1, 2))
        previous = self.attention.get(layer)
        self.attention[layer] = most if previous is None else torch.maximum(previous, most)

    def record_layer_change(self, layer: int, before: Tensor, after: Tensor) -> None:
        """Not needed."""


class OracleScorer(Scorer[Any]):
    """Scores a layer's resident tokens by captured question attention, kept by word like the default."""

    def __init__(self, inner: Scorer[Any], attention: dict[int, Tensor]) -> None:
        super().__init__(inner.settings)
        self.signals = inner.signals
        self.inner = inner
        self.attention = attention

    def comparable_scores(self, signals: LayerSignals) -> Tensor:
        return self.attention[signals.layer].gather(1, signals.positions)

    def score(self, signals: LayerSignals) -> Tensor:
        return signals.word_max(self.comparable_scores(signals))

    def whole_units(self, signals: LayerSignals) -> Tensor | None:
        return self.inner.whole_units(signals)  # its budget cuts between words as the default's does


class MixedScorer(Scorer[Any]):
    """Layer budgets from one scorer's comparable scores, the choice within each layer from another's."""

    def __init__(self, budgets: Scorer[Any], ranking: Scorer[Any]) -> None:
        super().__init__(ranking.settings)
        self.signals = budgets.signals | ranking.signals
        self.budgets = budgets
        self.ranking = ranking

    def comparable_scores(self, signals: LayerSignals) -> Tensor:
        return self.budgets.comparable_scores(signals)

    def score(self, signals: LayerSignals) -> Tensor:
        return self.ranking.score(signals)

    def whole_units(self, signals: LayerSignals) -> Tensor | None:
        return self.ranking.whole_units(signals)


def question_attention(
    engine: InfoKVEngine, full: DocumentCache, conversations: Sequence[tuple[str, Sequence[int]]]
) -> dict[int, Tensor]:
    """Per layer (kv_heads, n): the most attention the tokens of any (question, continuation) pay each
    document token over the full cache."""
    n = full.document_tokens
    capture = QuestionAttention(n)
    runner = engine.runner
    for question, continuation in conversations:
        ids = [*engine.prompt.conversation_ids(question_turns(question)), *continuation]
        session = full.working_cache(len(ids), summaries=False)
        positions = torch.arange(n, n + len(ids), device=runner.device)
        runner.forward(torch.tensor(ids, device=runner.device), positions, session, capture)
    return capture.attention


def compress(
    engine: InfoKVEngine,
    result: DocumentResult,
    rows: Sequence[EngineRow],
    keep: float,
    oracle_labels: Sequence[str],
) -> tuple[CompressedDocument, dict[str, CompressedDocument]]:
    """The full cache, and each row's and each named oracle's compression, from one prefill of the document."""
    chunk = max(CompressionConfig().chunk_size, len(engine.prompt.document_ids(result.document.text)))
    questions = [question for question, _ in result.questions]
    conversations: dict[str, list[tuple[str, Sequence[int]]]] = {
        ORACLE_QUESTIONS: [(question, ()) for question in questions],
        ORACLE_ANSWERS: [(question, result.full_ids(question)) for question in questions],
    }

    captured: dict[str, dict[int, Tensor]] = {}

    def oracle(full: DocumentCache, scorer: Scorer[Any], label: str) -> OracleScorer:
        if label not in captured:  # one capture per document serves every row that reads it
            captured[label] = question_attention(engine, full, conversations[label])
        return OracleScorer(scorer, captured[label])

    every_oracle: dict[str, Rescorer] = {
        ORACLE_QUESTIONS: lambda full, scorer: oracle(full, scorer, ORACLE_QUESTIONS),
        ORACLE_ANSWERS: lambda full, scorer: oracle(full, scorer, ORACLE_ANSWERS),
        ORACLE_BUDGETS: lambda full, scorer: MixedScorer(oracle(full, scorer, ORACLE_ANSWERS), scorer),
        ORACLE_RANKING: lambda full, scorer: MixedScorer(scorer, oracle(full, scorer, ORACLE_ANSWERS)),
    }
    oracles = {label: every_oracle[label] for label in oracle_labels}
    configs = {
        FULL: CompressionConfig(method="full", chunk_size=chunk),
        **{row.label: dataclasses.replace(row.config, chunk_size=chunk) for row in rows},
        **{label: CompressionConfig(keep=keep, chunk_size=chunk) for label in oracles},
    }
    rescorers = [oracles.get(label) for label in configs]
    made = dict(
        zip(configs, compress_variants(engine, result.document, list(configs.values()), rescorers), strict=True)
    )
    return made.pop(FULL), made


@dataclass
class RowTotals:
    kept: int = 0
    dependent: int = 0
    kl: list[float] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


def answer_dependent(
    result: DocumentResult,
    full: CompressedDocument,
    compressed: dict[str, CompressedDocument],
    totals: dict[str, RowTotals],
    max_new_tokens: int,
) -> None:
    """Answers the document's dependent questions from every compressed cache; adds up kept answers and KL."""
    for question in (q for q in result.results() if q.dependent):
        turns, reference_ids = question_turns(question.question), result.full_ids(question.question)
        reference = teacher_forced_logits(full, turns, reference_ids)
        for label, document in compressed.items():
            text = answer(document, question.question, max_new_tokens).text()
            total = totals[label]
            total.dependent += 1
            total.kl.append(mean_kl(reference, teacher_forced_logits(document, turns, reference_ids)))
            if answer_matches(text, question.expected):
                total.kept += 1
            else:
                full_answer = question.answers[FULL]
                total.lost.append(f"{result.doc.doc_id}: {question.question} -> {text!r} (full: {full_answer!r})")


def run(args: argparse.Namespace) -> int:
    docs = load_realdocs(args.split, doc_ids=args.docs)
    rows = parse_rows(args.rows)
    torch.manual_seed(0)
    engine = InfoKVEngine.from_pretrained(args.model)
    bench = Bench(engine, ResultCache(args.cache_dir, lambda label: False), args.max_new_tokens)
    labels = [*(row.label for row in rows), *args.oracles]
    totals = {label: RowTotals() for label in labels}
    started = time.perf_counter()
    for index, doc in enumerate(docs):
        result = DocumentResult(doc, load_document(doc.pdf_path), doc.questions)
        bench.run_document(result, [])  # the full and no-document rows: which questions are dependent
        full, compressed = compress(engine, result, rows, args.keep, args.oracles)
        answer_dependent(result, full, compressed, totals, args.max_new_tokens)
        line = ", ".join(f"{label} {t.kept}/{t.dependent}" for label, t in totals.items())
        progress(f"[{index + 1}/{len(docs)}] {doc.doc_id}: {line} ({time.perf_counter() - started:.0f}s)")
    return report(args, totals)


def report(args: argparse.Namespace, totals: dict[str, RowTotals]) -> int:
    command = "python -m benchmarks.selection_oracle " + " ".join(args.command)
    lines = [
        f"`{command}`",
        "",
        f"Split {args.split}, keep {args.keep}, one prefill per document; document-dependent questions only.",
        "",
        "| row | dependent kept | mean KL(full‖row) |",
        "|---|---|---|",
    ]
    for label, total in totals.items():
        share = f" ({total.kept / total.dependent:.0%})" if total.dependent else ""
        mean = sum(total.kl) / len(total.kl) if total.kl else 0.0
        lines.append(f"| {label} | {total.kept}/{total.dependent}{share} | {mean:.3f} |")
    markdown = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"selection-oracle-{args.split}"
    stem.with_suffix(".md").write_text(markdown)
    details = {label: dataclasses.asdict(total) for label, total in totals.items()}
    stem.with_suffix(".json").write_text(json.dumps({"command": command, "rows": details}, indent=1))
    print(markdown)
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--split", choices=SPLITS, default="dev")
    parser.add_argument("--docs", nargs="+", help="document ids (default: every document of the split)")
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--rows", nargs="+", default=["infokv@0.25"], help="engine rows beside the oracles")
    parser.add_argument(
        "--oracles", nargs="*", choices=ORACLES, default=list(ORACLES), help="oracle rows to run (none: the rows alone)"
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args(argv)
    args.command = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
