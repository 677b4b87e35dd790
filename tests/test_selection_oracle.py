"""benchmarks/selection_oracle.py: the questions' attention it selects by."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from benchmarks.selection_oracle import (
    ORACLES,
    MixedScorer,
    OracleScorer,
    QuestionAttention,
    parse_args,
    question_attention,
)
from benchmarks.variants import compress_variants
from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag.documents import document_from_text
from infokv_rag.scorers.base import NoSettings, Scorer
from infokv_rag.signals import LayerSignals

from .helpers import document_cache
from .test_scorers import TOKENS_READ, synthetic_signals


def test_the_capture_keeps_the_most_attention_any_query_pays_each_document_token() -> None:
    generator = torch.Generator().manual_seed(0)
    n, count, heads, kv_heads, dim = 6, 3, 4, 2, 8
    queries = torch.randn(heads, count, dim, generator=generator)
    keys = torch.randn(kv_heads, n + count, dim, generator=generator)
    capture = QuestionAttention(n)
    capture.record_attention(0, queries, keys, 0.5)
    expected = torch.zeros(kv_heads, n)
    for head in range(heads):
        group = head // (heads // kv_heads)
        for query in range(count):
            visible = n + query + 1  # the document, then the run's tokens up to this one
            probabilities = (queries[head, query] @ keys[group, :visible].T * 0.5).softmax(dim=-1)
            expected[group] = torch.maximum(expected[group], probabilities[:n])
    assert torch.allclose(capture.attention[0], expected, atol=1e-6)
    # A second run only raises what the first found.
    capture.record_attention(0, queries * 0, keys, 0.5)
    assert torch.allclose(capture.attention[0], torch.maximum(expected, torch.full_like(expected, 1 / (n + 1))))


def test_several_questions_give_the_most_attention_of_each(random_engine: InfoKVEngine) -> None:
    text = "The fee is 40 dollars. Notice is due in 30 days. " * 8
    doc = random_engine.ingest_text(text, CompressionConfig(method="full"))
    full = document_cache(doc)
    first = question_attention(random_engine, full, [("What is the fee?", ())])
    second = question_attention(random_engine, full, [("When is notice due?", [11, 12])])
    both = question_attention(random_engine, full, [("What is the fee?", ()), ("When is notice due?", [11, 12])])
    assert sorted(both) == list(range(random_engine.runner.num_layers))
    for layer, attention in both.items():
        assert attention.shape == (random_engine.runner.kv_heads, doc.cache.document_tokens)
        assert torch.allclose(attention, torch.maximum(first[layer], second[layer]))
        assert not torch.allclose(first[layer], second[layer])


class ByPosition(Scorer[Any]):
    """Ranks later tokens first (`sign` 1) or earlier ones (-1); deeper layers compare higher."""

    def __init__(self, sign: float) -> None:
        super().__init__(NoSettings())
        self.sign = sign

    def score(self, signals: LayerSignals) -> Tensor:
        return self.sign * signals.positions.float()

    def comparable_scores(self, signals: LayerSignals) -> Tensor:
        return (signals.layer + 1) * (self.sign * signals.positions.float()).softmax(dim=1)


def test_a_mixed_scorer_takes_budgets_from_one_scorer_and_the_choice_in_each_layer_from_the_other(
    random_engine: InfoKVEngine,
) -> None:
    document = document_from_text("The fee is 40 dollars. Notice is due in 30 days. " * 12)
    config = CompressionConfig(keep=0.25, summaries=0)
    early, late = ByPosition(-1.0), ByPosition(1.0)
    alone, mixed = compress_variants(
        random_engine,
        document,
        [config, config],
        [lambda full, scorer: early, lambda full, scorer: MixedScorer(budgets=early, ranking=late)],
    )
    assert mixed.cache.lengths == alone.cache.lengths
    assert len(set(alone.cache.lengths)) > 1  # the budgets differ per layer, so they were not uniform
    n, sinks, window = alone.cache.document_tokens, alone.cache.sink_tokens, config.window
    for alone_layer, mixed_layer in zip(document_cache(alone).layers, document_cache(mixed).layers, strict=True):
        length = mixed_layer.length
        # Beside the protected sinks and window, the late ranking keeps each layer's last tokens, the early one
        # its first.
        late_kept = [*range(sinks), *range(n - (length - sinks), n)]
        early_kept = [*range(length - window), *range(n - window, n)]
        for head in range(random_engine.runner.kv_heads):
            assert mixed_layer.positions[head].tolist() == late_kept
            assert alone_layer.positions[head].tolist() == early_kept


def test_oracles_with_no_name_screen_the_rows_alone() -> None:
    assert parse_args(["--oracles", "--rows", "infokv@0.25", "infokv@0.25[units=clause]"]).oracles == []
    assert parse_args([]).oracles == list(ORACLES)


def test_the_oracles_keep_words_whole_as_the_default_does() -> None:
    """The oracles compare with the default in the same machinery: a budget that ends inside a word keeps the word
    whole there too (the default's units), and a ranking by position keeps every token alone, as its own does."""
    default = CompressionConfig().method_spec.build(CompressionConfig().settings)
    signals = synthetic_signals(default.signals)
    attention = {signals.layer: torch.rand(2, TOKENS_READ, generator=torch.Generator().manual_seed(0))}
    words = default.whole_units(signals)
    assert words is not None
    oracle = OracleScorer(default, attention)
    for scorer in (oracle, MixedScorer(budgets=ByPosition(1.0), ranking=oracle), MixedScorer(oracle, default)):
        units = scorer.whole_units(signals)
        assert units is not None and torch.equal(units, words)
    assert MixedScorer(budgets=oracle, ranking=ByPosition(1.0)).whole_units(signals) is None
