"""Per-head budgets (`layer_budgets="per_head"`): each KV head keeps its own tokens, some as the layer's extras."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infokv_rag import CacheStoreError, CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.cache import DocumentCache, HeadExtras, LayerKV, ResidentCache
from infokv_rag.config import recall_tokens
from infokv_rag.decoding import working_session
from infokv_rag.prompt import question_turns
from infokv_rag.signals import LayerBudgetSettings
from infokv_rag.store import TENSORS

from .conftest import CORPUS
from .helpers import document_cache, resign
from .test_cold_tier import TEXT

QUESTION = "What is the notice period?"
PER_HEAD = {"layer_budgets": "per_head"}


def held_entries(doc: CompressedDocument, layer: int, head: int) -> torch.Tensor:
    """(kept, head_dim) every key the head keeps in the layer: its own, then its extras."""
    cache = document_cache(doc)
    assert cache.extras is not None
    extras = cache.extras[layer]
    return torch.cat([cache.layers[layer].keys[head], extras.keys[extras.of_head(head)]])


@pytest.mark.parametrize("chunk_size", [2048, 64])
def test_each_head_keeps_exactly_its_own_budget_of_the_documents_entries(
    random_engine: InfoKVEngine, chunk_size: int
) -> None:
    full = random_engine.ingest_text(TEXT, CompressionConfig(method="full"))
    config = CompressionConfig(keep=0.2, chunk_size=chunk_size, summaries=0, settings=PER_HEAD)
    doc = random_engine.ingest_text(TEXT, config)
    n, layers = doc.stats.document_tokens, len(document_cache(doc).layers)
    budget = config.budget_for(n, random_engine.prompt.head_tokens)
    kv_heads = random_engine.runner.kv_heads
    kept = [[len(held_entries(doc, layer, head)) for head in range(kv_heads)] for layer in range(layers)]
    # The total is shared by every (layer, KV head): a head may keep more than another overall.
    assert sum(map(sum, kept)) == budget * layers * kv_heads, kept
    assert any(len(set(row)) > 1 for row in kept), "the heads of some layer keep different numbers"
    assert doc.stats.kept_tokens == budget * layers, "over all layers, the mean over the heads, rounded once"
    entry_bytes = 2 * random_engine.runner.head_dim * document_cache(doc).layers[0].keys.element_size()
    assert doc.stats.cache_bytes == budget * layers * kv_heads * entry_bytes + layers * kv_heads * 8, "no padding"
    # Read in one chunk, every key is the full cache's (chunked, later chunks attend to a compressed cache).
    for layer in range(layers if chunk_size >= n else 0):
        for head in range(kv_heads):
            positions = doc.cache.kept_positions(layer)[head]
            assert len(set(positions.tolist())) == len(positions), "no position twice"
            # The full cache holds every position in order: each kept key is the document's at its position.
            document = document_cache(full).layers[layer].keys[head]
            torch.testing.assert_close(held_entries(doc, layer, head), document[positions], atol=1e-5, rtol=1e-4)
    assert doc.ask(QUESTION, max_new_tokens=6)


def _question_logits(engine: InfoKVEngine, cache: ResidentCache) -> torch.Tensor:
    runner, n = engine.runner, cache.document_tokens
    ids = torch.tensor(engine.prompt.conversation_ids(question_turns(QUESTION)))
    session = cache.working_cache(len(ids))
    return runner.logits(runner.forward(ids, torch.arange(n, n + len(ids)), session))


def test_extras_are_read_as_the_same_entries_held_in_the_layer(random_engine: InfoKVEngine) -> None:
    full = random_engine.ingest_text(TEXT, CompressionConfig(method="full"))
    moved, extras = [], []
    for layer in document_cache(full).layers:
        # The first 20 positions of each head move out of the layer into its extras.
        rest = LayerKV(layer.keys[:, 20:], layer.values[:, 20:], layer.positions[:, 20:], layer.scores[:, 20:])
        moved.append(rest)
        moved_indices = [torch.arange(20)] * layer.keys.shape[0]
        extras.append(HeadExtras.gathered(layer.keys, layer.values, layer.positions, moved_indices))
    split = DocumentCache(moved, full.cache.document_tokens, full.cache.sink_tokens, extras=extras)
    torch.testing.assert_close(
        _question_logits(random_engine, split), _question_logits(random_engine, full.cache), atol=1e-4, rtol=1e-4
    )


def test_padding_slots_of_a_head_with_fewer_extras_get_no_attention() -> None:
    keys, values = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    positions = torch.arange(6).expand(2, -1)
    extras = HeadExtras.gathered(keys, values, positions, [torch.tensor([1, 4]), torch.tensor([0, 2, 5])])
    assert extras.positions.tolist() == [1, 4, 0, 2, 5] and extras.keys[extras.of_head(1)].shape == (3, 4)
    assert extras.keys.shape == (5, 4) and extras.counts.tolist() == [2, 3] and extras.most == 3
    padded = extras.padded()
    assert torch.equal(padded.keys[0, :2], keys[0, [1, 4]]) and torch.equal(padded.values[1], values[1, [0, 2, 5]])
    assert padded.log_counts.tolist() == [[0.0, 0.0, -torch.inf], [0.0, 0.0, 0.0]]


def _rewrite_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Edits the saved tensors as a broken tool would: the checksums are made to match."""
    tensors = load_file(directory / TENSORS)
    edit(tensors)
    resign(directory, tensors)


@pytest.mark.parametrize("keep", [100, 0.3])
def test_kept_tokens_are_the_entries_held_per_kv_head_rounded_once(
    random_engine: InfoKVEngine, tmp_path: Path, keep: float
) -> None:
    doc = random_engine.ingest_text(" ".join(CORPUS * 12), CompressionConfig(method="kvzip", keep=keep))
    layers, kv_heads = len(doc.cache.lengths), random_engine.runner.kv_heads
    held = sum(len(positions) for layer in range(layers) for positions in doc.cache.kept_positions(layer))
    assert doc.stats.kept_tokens == round(held / kv_heads)
    # Each layer's figure is its own mean, rounded: their sum is off here (it is what this test is about).
    assert sum(doc.stats.kept_tokens_per_layer) != doc.stats.kept_tokens
    assert random_engine.load(doc.save(tmp_path / "doc")).stats.kept_tokens == doc.stats.kept_tokens


def test_a_per_head_cache_round_trips_and_malformed_extras_are_refused(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.2, chunk_size=64, settings=PER_HEAD))
    n = doc.stats.document_tokens
    cache = document_cache(doc)
    assert cache.extras is not None and cache.summaries is not None
    for layer, extras, summary in zip(cache.layers, cache.extras, cache.summaries, strict=True):
        # The summaries stand for exactly what each head evicted: not its extras.
        evicted = n - layer.length - extras.counts
        torch.testing.assert_close(summary.log_counts.exp().sum(dim=1), evicted.float())
    saved = doc.save(tmp_path / "doc")
    loaded = random_engine.load(saved)
    assert loaded.stats == doc.stats
    loaded_cache = document_cache(loaded)
    assert loaded_cache.extras is not None and cache.extras is not None
    for got, want in zip(loaded_cache.extras, cache.extras, strict=True):
        assert torch.equal(got.keys, want.keys) and torch.equal(got.counts, want.counts)
    assert loaded.ask(QUESTION, max_new_tokens=8) == doc.ask(QUESTION, max_new_tokens=8)

    def miscount(tensors: dict[str, torch.Tensor]) -> None:
        tensors["extra_counts.1"] = tensors["extra_counts.1"] + 1

    _rewrite_tensors(saved, miscount)
    with pytest.raises(CacheStoreError, match="malformed per-head extras in layer 1"):
        random_engine.load(saved)
    _rewrite_tensors(saved, lambda tensors: tensors.pop("extra_keys.0"))
    with pytest.raises(CacheStoreError, match="lacks the per-head extras of layer 0"):
        random_engine.load(saved)


def test_a_per_head_cache_with_a_cold_tier_keeps_the_extras_out_of_it(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    config = CompressionConfig(keep=0.2, recall=0.1, settings=PER_HEAD)
    doc = random_engine.ingest_text(TEXT, config)
    cache = document_cache(doc)
    assert doc.cold_tier is not None and cache.extras is not None
    n = doc.stats.document_tokens
    for layer, extras, cold in zip(cache.layers, cache.extras, doc.cold_tier.layers, strict=True):
        assert cold.lengths == (n - layer.length - extras.counts).tolist(), "each head's extras are held once, hot"
    loaded = random_engine.load(doc.save(tmp_path / "doc"))
    for recall in (0.1, 0.0):
        answer = doc.ask(QUESTION, max_new_tokens=8, recall=recall)
        assert loaded.ask(QUESTION, max_new_tokens=8, recall=recall) == answer


def test_a_cold_tier_beside_extras_that_overlap_the_layer_is_refused(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.2, recall=0.1, settings=PER_HEAD))
    cache = document_cache(doc)
    assert cache.extras is not None
    layer = next(index for index, extras in enumerate(cache.extras) if int(extras.counts[0]))
    path = doc.save(tmp_path / "doc")

    def overlap(tensors: dict[str, torch.Tensor]) -> None:
        tensors[f"extra_positions.{layer}"][0] = cache.layers[layer].positions[0, -1]

    _rewrite_tensors(path, overlap)
    with pytest.raises(CacheStoreError, match=f"layer {layer} holds a position of head 0 twice"):
        random_engine.load(path)


def test_an_answer_that_recalls_reads_every_extra_and_recalls_other_entries(random_engine: InfoKVEngine) -> None:
    config = CompressionConfig(keep=0.2, recall=0.05, summaries=0)
    settings = config.settings
    assert isinstance(settings, LayerBudgetSettings) and settings.layer_budgets == "per_head", (
        "the default keeps its per-head budgets with a cold tier"
    )
    doc = random_engine.ingest_text(TEXT, config)
    cache = document_cache(doc)
    assert cache.extras is not None and doc.cold_tier is not None
    n, recall = doc.stats.document_tokens, recall_tokens(0.05, doc.stats.document_tokens)
    ids = random_engine.prompt.conversation_ids(question_turns(QUESTION))
    session, plan = working_session(doc, len(ids), recall)
    random_engine.runner.forward(torch.tensor(ids), torch.arange(n, n + len(ids)), session, recall=plan)
    assert session.summaries is not None
    for index, (extras, cold) in enumerate(zip(cache.extras, doc.cold_tier.layers, strict=True)):
        layer = session.layers[index]
        assert layer.base is cache.layers[index], "the document's own entries are read in place"
        positions = torch.cat([layer.base.positions, layer.live("positions")], dim=1)
        side = session.summaries[index].log_counts
        for head in range(positions.shape[0]):
            in_layer = positions[head][positions[head] < n].tolist()
            own_extras = extras.positions[extras.of_head(head)].tolist()
            # The side slots hold this head's extras first, then padding up to the widest head's count.
            slots = side[head, : len(own_extras)].tolist()
            read_beside = [p for p, slot in zip(own_extras, slots, strict=True) if slot == 0.0]
            attended = in_layer + read_beside
            assert len(set(attended)) == len(attended), "no entry read twice"
            assert read_beside == own_extras, "every extra is read, beside the layer"
            if cold.lengths[head] >= recall:
                assert len(in_layer) == cache.layers[index].length + recall, (
                    "the recall brings in as many other entries"
                )


@pytest.mark.parametrize("chunk_size", [2048, 96])
@pytest.mark.parametrize("keep", [0.5, "half as a token count"])
@pytest.mark.parametrize("settings", [{"numbers": "everywhere"}, {}], ids=["everywhere", "default"])
def test_numbers_everywhere_keeps_every_number_in_every_head(
    random_engine: InfoKVEngine, chunk_size: int, keep: float | str, settings: dict[str, str]
) -> None:
    text = " ".join(f"Clause {i}: the fee is USD {1000 + 37 * i:,} and the period is thirty days." for i in range(24))
    ids = torch.tensor(random_engine.prompt.document_ids(text))
    budget = 0.5 if keep == 0.5 else (len(ids) + 1) // 2
    config = CompressionConfig(keep=budget, chunk_size=chunk_size, settings=settings)
    doc = random_engine.ingest_text(text, config)
    digits = random_engine.numerals[ids]
    words = torch.cumsum(random_engine.word_starts[ids].long(), 0)
    numbers = torch.isin(words, words[digits]).nonzero().flatten()
    assert 0 < len(numbers) < config.budget_for(len(ids), random_engine.prompt.head_tokens)
    for layer in range(len(document_cache(doc).layers)):
        for head, positions in enumerate(doc.cache.kept_positions(layer)):
            assert torch.isin(numbers, positions).all(), (layer, head)
    # Scored like any token, some head of some layer drops a number.
    scored_config = CompressionConfig(keep=0.5, chunk_size=chunk_size, settings={"numbers": "scored"})
    scored = random_engine.ingest_text(text, scored_config)
    assert not all(
        torch.isin(numbers, positions).all()
        for layer in range(len(document_cache(scored).layers))
        for positions in scored.cache.kept_positions(layer)
    )


@pytest.mark.tiny
@pytest.mark.parametrize("keep", [0.5, 0.7])
def test_numbers_everywhere_count_the_protected_tokens_in_each_head_s_budget(
    tiny_engine: InfoKVEngine, keep: float
) -> None:
    """A head's protected tokens (the prompt's head, sinks, window) are kept first: when a head's budget is
    sized, they count beside its numbers, or they take the places sized for the numbers (a head near its
    protected floor kept few of them: the real model's heads differ enough to show it, the random one's not)."""
    text = " ".join(
        f"The supplier shall deliver all of the ordered goods to the main warehouse of the buyer within {i + 10} "
        "days of the written notice."
        for i in range(8)
    )
    ids = torch.tensor(tiny_engine.prompt.document_ids(text))
    config = CompressionConfig(keep=keep)
    doc = tiny_engine.ingest_text(text, config)
    words = torch.cumsum(tiny_engine.word_starts[ids].long(), 0)
    numbers = torch.isin(words, words[tiny_engine.numerals[ids]]).nonzero().flatten()
    protected = max(tiny_engine.prompt.head_tokens, config.sink_tokens) + config.window
    assert len(numbers) + protected <= config.budget_for(len(ids), tiny_engine.prompt.head_tokens)
    for layer in range(len(document_cache(doc).layers)):
        for head, positions in enumerate(doc.cache.kept_positions(layer)):
            assert torch.isin(numbers, positions).all(), (layer, head)


def test_kept_tokens_per_layer_count_each_heads_extras(random_engine: InfoKVEngine) -> None:
    """Each layer's reported kept tokens are what it holds per KV head, its extras with its own entries (a count
    that left the extras out changed no test: the stats, `info` and the manifest would have shown it)."""
    doc = random_engine.ingest_text(" ".join(CORPUS * 12), CompressionConfig(keep=0.25))  # default: per-head budgets
    kv_heads = random_engine.runner.kv_heads
    held = [sum(len(p) for p in doc.cache.kept_positions(layer)) for layer in range(len(doc.cache.lengths))]
    extras = doc.cache.extra_positions()
    assert extras is not None and any(int(counts.sum()) for _, counts in extras), "the heads differ here"
    assert doc.stats.kept_tokens_per_layer == [round(h / kv_heads) for h in held]


def test_the_kept_entries_carry_their_rank_as_eviction_priority(random_engine: InfoKVEngine) -> None:
    """LayerKV.scores: 'the eviction priority (higher is kept longer)', what decode-time eviction ranks by: each
    head's best-scored tokens rank near 1, and the kept tokens do not all tie (a lost copy of the ranks into the
    cache changed no test)."""
    config = CompressionConfig(keep=0.25, settings={"layer_budgets": "uniform"})
    doc = random_engine.ingest_text(" ".join(CORPUS * 12), config)
    for layer in document_cache(doc).layers:
        assert bool((layer.scores.amax(dim=1) > 0.9).all()) and bool((layer.scores <= 1).all())
        assert bool((layer.scores.amin(dim=1) < layer.scores.amax(dim=1)).all())
