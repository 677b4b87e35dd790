"""Summaries of the evicted entries (`infokv_rag.summaries`), on the random 3-layer model from conftest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infokv_rag import CacheStoreError, CompressionConfig, InfoKVEngine
from infokv_rag.cache import EvictedSummary
from infokv_rag.recall import attend_over_cold
from infokv_rag.store import MANIFEST, _manifest_checksum
from infokv_rag.summaries import absorb

from .test_cold_tier import TEXT, kl, log_probs


def test_absorbing_keeps_every_evicted_entry_counted_and_summed() -> None:
    torch.manual_seed(0)
    kv_heads, dim = 2, 8
    first_keys, first_values = torch.randn(kv_heads, 50, dim), torch.randn(kv_heads, 50, dim)
    later_keys, later_values = torch.randn(kv_heads, 30, dim) + 2, torch.randn(kv_heads, 30, dim)
    summary = absorb(absorb(None, first_keys, first_values, 6, 0), later_keys, later_values, 6, 1)
    assert summary.keys.shape == (kv_heads, 6, dim) and summary.log_counts.shape == (kv_heads, 6)
    counts = summary.log_counts.exp()
    # Two compressions folded in: 80 entries per head, and their sums, whatever the grouping.
    assert torch.allclose(counts.sum(dim=1), torch.full((kv_heads,), 80.0))
    weighted = (counts[:, :, None] * summary.keys).sum(dim=1)
    assert torch.allclose(weighted, first_keys.sum(dim=1) + later_keys.sum(dim=1), atol=1e-3)
    weighted = (counts[:, :, None] * summary.values).sum(dim=1)
    assert torch.allclose(weighted, first_values.sum(dim=1) + later_values.sum(dim=1), atol=1e-3)
    # Fewer entries than the size: one each.
    few = absorb(None, first_keys[:, :3], first_values[:, :3], 6, 0)
    assert few.length == 3 and torch.allclose(few.log_counts.exp(), torch.ones(kv_heads, 3))


def test_a_summary_of_repeated_keys_attends_exactly_as_the_entries_it_stands_for() -> None:
    torch.manual_seed(1)
    heads, kv_heads, q, dim = 4, 2, 3, 8
    distinct = torch.randn(kv_heads, 4, dim) * 2
    repeats = torch.tensor([1, 3, 5, 7])
    keys = distinct.repeat_interleave(repeats, dim=1)  # 16 evicted entries, four distinct keys
    values = torch.randn(kv_heads, 16, dim)
    summary = absorb(None, keys, values, 4, 0)
    query, hot, hot_values = torch.randn(heads, q, dim), torch.randn(kv_heads, 7, dim), torch.randn(kv_heads, 7, dim)
    output, _ = attend_over_cold(query, summary.keys, summary.values, hot, hot_values, 0.5, summary.log_counts)
    exact, _ = attend_over_cold(query, keys, values, hot, hot_values, 0.5)
    assert torch.allclose(output, exact, atol=1e-5)
    # An entry of log count -inf (a cluster that emptied) weighs nothing.
    padded = EvictedSummary(
        torch.cat([summary.keys, torch.randn(kv_heads, 1, dim)], dim=1),
        torch.cat([summary.values, torch.randn(kv_heads, 1, dim) * 100], dim=1),
        torch.cat([summary.log_counts, torch.full((kv_heads, 1), -torch.inf)], dim=1),
    )
    output, _ = attend_over_cold(query, padded.keys, padded.values, hot, hot_values, 0.5, padded.log_counts)
    assert torch.allclose(output, exact, atol=1e-5)


def test_summaries_bring_the_answer_closer_to_the_full_cache(random_engine: InfoKVEngine) -> None:
    full = random_engine.ingest_text(TEXT, CompressionConfig(method="full"))
    with_summaries = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, chunk_size=64))
    without = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, chunk_size=64, summaries=0))
    assert with_summaries.cache.summaries is not None and without.cache.summaries is None
    assert [summary.length for summary in with_summaries.cache.summaries] == [16] * 3
    # The same budget: the summaries take the place of 16 tokens per layer (per-layer means are rounded).
    assert abs(with_summaries.stats.kept_tokens + 3 * 16 - without.stats.kept_tokens) <= 3
    reference_question, reference_answer = log_probs(full, 0)
    question, answer = log_probs(with_summaries, 0)
    question_without, answer_without = log_probs(without, 0)
    assert kl(reference_question, question) < 0.5 * kl(reference_question, question_without)
    assert kl(reference_answer, answer) < 0.5 * kl(reference_answer, answer_without)


def test_summaries_beyond_the_budget_are_capped_by_it(random_engine: InfoKVEngine) -> None:
    """Summaries take their place in the keep budget: asked for more than it holds, they are what it holds less one
    token of the document's own, not one per evicted entry (a cache as large as the full one, and minutes of
    clustering), while the cache says it keeps a quarter."""
    full = random_engine.ingest_text(TEXT, CompressionConfig(method="full"))
    config = CompressionConfig(keep=0.25, chunk_size=64, summaries=100_000)
    capped = random_engine.ingest_text(TEXT, config)
    budget = round(0.25 * full.stats.document_tokens)
    assert config.summaries_for(full.stats.document_tokens) == budget - 1
    assert capped.cache.summaries is not None
    assert all(0 < summary.length <= budget - 1 for summary in capped.cache.summaries)
    assert capped.stats.cache_bytes < 0.5 * full.stats.cache_bytes, (capped.stats.cache_bytes, full.stats.cache_bytes)


def test_summaries_are_saved_verified_and_refused_when_malformed(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25))
    loaded = random_engine.load(doc.save(tmp_path / "cache"))
    assert loaded.config.summaries == 16 and loaded.cache.summaries is not None and doc.cache.summaries is not None
    for saved, read in zip(doc.cache.summaries, loaded.cache.summaries, strict=True):
        for name in ("keys", "values", "log_counts"):
            assert torch.equal(getattr(saved, name), getattr(read, name))
    question = "What is the notice period?"
    assert loaded.ask(question, max_new_tokens=8) == doc.ask(question, max_new_tokens=8)
    # A cache whose config asks for fewer summaries than it holds was not written by this library.
    manifest = json.loads((tmp_path / "cache" / MANIFEST).read_text())
    manifest["config"]["summaries"] = 8
    manifest["checksum"] = _manifest_checksum(manifest)
    (tmp_path / "cache" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheStoreError, match="malformed summaries"):
        random_engine.load(tmp_path / "cache")
