"""A compressed cache held in codes (`CompressionConfig.stored_bits`), on the random 3-layer model from conftest."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from infokv_rag import CacheStoreError, CompressedDocument, CompressionConfig, ConfigError, InfoKVEngine
from infokv_rag.cache import DocumentCache, HeadExtras, LayerKV
from infokv_rag.coded_cache import CodedCache, DecodedOnRead, ExtrasOnRead
from infokv_rag.generation import GenerationOptions
from infokv_rag.prompt import question_turns
from infokv_rag.quantisation import PAGE_TOKENS, QuantisedEntries
from infokv_rag.store import COLD, FORMAT_VERSION, MANIFEST, TENSORS, _manifest_checksum

from .helpers import document_cache, resign

TEXT = " ".join(f"Clause {i}: the fee is {i * 37} euros within {i + 3} days." for i in range(40))
QUESTION = "What is the fee of clause 7?"


def decoded_in_place(document: CompressedDocument, bits: int) -> CompressedDocument:
    """`document` (at the model's dtype) with each layer's keys and values, and each head's extras, replaced by
    what their codes decode to: the arithmetic the benchmark's simulation of the twenty-eighth session used."""

    def decoded(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entries = QuantisedEntries.encode(keys, values, bits)
        return entries.all_keys(bits).to(keys.dtype), entries.all_values(bits).to(values.dtype)

    cache = document.cache
    assert isinstance(cache, DocumentCache) and cache.extras is not None
    layers = [LayerKV(*decoded(layer.keys, layer.values), layer.positions, layer.scores) for layer in cache.layers]
    extras = []
    for extra in cache.extras:
        heads = [
            decoded(extra.keys[extra.of_head(h)][None], extra.values[extra.of_head(h)][None])
            for h in range(len(extra.counts))
        ]
        keys, values = (torch.cat([head[i][0] for head in heads]) for i in (0, 1))
        extras.append(HeadExtras(keys, values, extra.positions, extra.counts))
    return dataclasses.replace(document, cache=dataclasses.replace(cache, layers=layers, extras=extras))


def answer_ids(document: CompressedDocument, recall: float | int | None = None) -> list[int]:
    options = GenerationOptions.build(max_new_tokens=6, recall=recall)
    generation = document.generate(question_turns(QUESTION), options)
    "".join(generation)
    return list(generation.token_ids)


def test_stored_bits_is_4_or_8_and_left_out_of_a_config_without_it() -> None:
    for bad in (2, 16, True, "4"):
        with pytest.raises(ConfigError, match="stored_bits must be one of"):
            CompressionConfig(stored_bits=bad)  # type: ignore[arg-type]
    assert "stored_bits" not in CompressionConfig().to_dict()
    config = CompressionConfig(stored_bits=4)
    assert config.to_dict()["stored_bits"] == 4 and CompressionConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("bits", [8, 4])
def test_a_cache_in_codes_answers_as_its_entries_decoded_from_them(random_engine: InfoKVEngine, bits: int) -> None:
    plain = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4))
    coded = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=bits))
    assert isinstance(coded.cache, CodedCache) and coded.cache.extras is not None, "per-head budgets: extras too"
    expected = decoded_in_place(plain, bits)
    # Every entry an answer reads, layer by layer and beside each layer, is what the codes decode to.
    got, want = coded.cache.working_cache(8), expected.cache.working_cache(8)
    for layer, reference in zip(got.layers, want.layers, strict=True):
        assert layer.base is not None and reference.base is not None and layer.length == reference.length == 0
        assert isinstance(layer.base, DecodedOnRead), "the codes are read in place, decoded at each read"
        for got_tensor, want_tensor in zip(layer.base.entries(), reference.base.entries(), strict=True):
            assert torch.equal(got_tensor, want_tensor)
        assert torch.equal(layer.base.positions, reference.base.positions)
        assert torch.equal(layer.base.scores, reference.base.scores)
    assert got.summaries is not None and want.summaries is not None
    for side, reference_side in zip(got.summaries, want.summaries, strict=True):
        materialised, reference_materialised = side.materialised(), reference_side.materialised()
        assert torch.equal(materialised.keys, reference_materialised.keys)
        assert torch.equal(materialised.values, reference_materialised.values)
        assert torch.equal(side.log_counts, reference_side.log_counts)
    # Between reads neither answer holds any of the document's entries, decoded or not: only its log counts.
    log_counts = sum(side.log_counts.nbytes for side in want.summaries)
    assert want.nbytes == got.nbytes == log_counts
    assert all(isinstance(side.extras, ExtrasOnRead) for side in got.summaries), "the extras' codes read in place"
    assert answer_ids(coded) == answer_ids(expected)
    # Decoded, not copied: near the entries at the model's dtype, nearer at 8 bits.
    error = max(
        float((a.base.entries()[0] - b.keys).abs().max() / b.keys.abs().max())
        for a, b in zip(got.layers, document_cache(plain).layers, strict=True)
        if a.base is not None
    )
    assert 0 < error < (0.01 if bits == 8 else 0.1), error


def test_a_cache_in_codes_costs_the_bytes_of_its_codes(random_engine: InfoKVEngine) -> None:
    plain = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4))
    sizes = {}
    for bits in (8, 4):
        coded = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=bits))
        assert coded.stats.cache_bytes == coded.cache.nbytes
        assert coded.stats.kept_tokens_per_layer == plain.stats.kept_tokens_per_layer
        assert coded.cache.beside_tokens() == plain.cache.beside_tokens() > 0
        for layer in range(3):
            kept, plain_kept = coded.cache.kept_positions(layer), plain.cache.kept_positions(layer)
            assert all(torch.equal(a, b) for a, b in zip(kept, plain_kept, strict=True))
        sizes[bits] = coded.stats.cache_bytes
    # float32 entries: 8-bit codes with float16 ranges are about 9/32 of them, 4-bit ones about 5/32; the
    # summaries stay at the model's dtype.
    summaries = sum(summary.nbytes for summary in plain.cache.summaries or [])
    entries = plain.stats.cache_bytes - summaries
    assert 0.25 * entries < sizes[8] - summaries < 0.32 * entries
    assert 0.13 * entries < sizes[4] - summaries < 0.19 * entries


def test_a_saved_cache_in_codes_loads_as_codes_and_answers_the_same(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    coded = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=4, recall=0.1))
    path = coded.save(tmp_path / "doc")
    manifest = json.loads((path / MANIFEST).read_text())
    assert manifest["format_version"] == FORMAT_VERSION and manifest["config"]["stored_bits"] == 4
    names = set(load((path / TENSORS).read_bytes()))
    assert "codes.key_codes.0" in names and "extra_codes.value_codes.0.1" in names and "keys.0" not in names
    loaded = random_engine.load(path)
    assert isinstance(loaded.cache, CodedCache) and loaded.config == coded.config
    assert loaded.stats.cache_bytes == coded.stats.cache_bytes == loaded.cache.nbytes
    assert answer_ids(loaded) == answer_ids(coded)
    # With the cold tier: the question reads every entry and recalls some; the heads' extras stay beside.
    assert answer_ids(loaded, recall=0.1) == answer_ids(coded, recall=0.1)


def test_an_answer_leaves_the_codes_as_they_were(random_engine: InfoKVEngine) -> None:
    coded = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=4, recall=0.1))
    assert isinstance(coded.cache, CodedCache)
    before = [layer.entries.key_codes.clone() for layer in coded.cache.layers]
    first = answer_ids(coded, recall=0.1)
    assert answer_ids(coded) and answer_ids(coded, recall=0.1) == first
    assert all(torch.equal(a.entries.key_codes, b) for a, b in zip(coded.cache.layers, before, strict=True))


def test_positions_repeated_or_out_of_order_are_refused_even_with_a_consistent_manifest(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """Kept entries stay in the document's order, each once: a layer that holds one position twice (or out of
    order) would answer from a document that never was."""
    for stored_bits in (None, 4):
        path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=stored_bits)).save(
            tmp_path / f"doc-{stored_bits}"
        )
        tensors = load((path / TENSORS).read_bytes())
        for broken in (torch.zeros_like, lambda positions: positions.flip(1).contiguous()):
            resign(path, {**tensors, "positions.0": broken(tensors["positions.0"])})
            with pytest.raises(CacheStoreError, match="repeated or out of order"):
                random_engine.load(path)


def test_codes_that_do_not_fit_the_model_are_refused_even_with_a_consistent_manifest(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=4)).save(tmp_path / "doc")
    tensors = load((path / TENSORS).read_bytes())
    broken = {**tensors, "codes.key_codes.1": tensors["codes.key_codes.1"][:, 1:].contiguous()}
    resign(path, broken)
    with pytest.raises(CacheStoreError, match="layer 1: key_codes does not match"):
        random_engine.load(path)
    missing = {name: tensor for name, tensor in tensors.items() if name != "extra_codes.value_low.2.0"}
    resign(path, missing)
    with pytest.raises(CacheStoreError, match="layer 2's extras of head 0: value_low does not match"):
        random_engine.load(path)
    # A config of 8 bits over codes of 4: the codes are half as wide as the config says.
    resign(path, tensors)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["config"]["stored_bits"] = 8
    manifest["checksum"] = _manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheStoreError, match="key_codes does not match"):
        random_engine.load(path)


def test_non_finite_entries_are_refused_even_with_a_consistent_manifest(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """NaN or infinite keys, values or code ranges, hot or cold, answer nothing the document says: refused at load
    (an ingestion that overflowed writes them as well as a broken tool)."""
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.4, stored_bits=4, recall=0.1)).save(tmp_path / "d")
    random_engine.load(path)
    saved = {name: (path / name).read_bytes() for name in (TENSORS, MANIFEST)}
    tensors = load(saved[TENSORS])
    for name, value in (("codes.key_low.1", float("nan")), ("codes.value_high.0", float("inf"))):
        broken = tensors[name].clone()
        broken.view(-1)[0] = value
        resign(path, {**tensors, name: broken})
        with pytest.raises(CacheStoreError, match=f"NaN or infinite values in {name}"):
            random_engine.load(path)
    for name, data in saved.items():  # the hot tensors as saved, bound to the cache (`resign` writes them bare)
        (path / name).write_bytes(data)
    cold = load((path / COLD).read_bytes())
    name = next(name for name, tensor in cold.items() if tensor.is_floating_point())
    broken = cold[name].clone()
    broken.view(-1)[-1] = float("nan")
    resign(path, {**cold, name: broken}, COLD)
    with pytest.raises(CacheStoreError, match=f"cold.safetensors holds NaN or infinite values in {name}"):
        random_engine.load(path)


def test_a_partial_last_page_ranges_over_its_own_entries_only() -> None:
    generator = torch.Generator().manual_seed(0)
    keys = 5.0 + torch.rand(2, PAGE_TOKENS + 3, 32, generator=generator)  # every channel in [5, 6]
    values = torch.rand(2, PAGE_TOKENS + 3, 32, generator=generator)
    entries = QuantisedEntries.encode(keys, values, 8)
    assert bool((entries.key_low.float() >= 4.99).all()), "padding widened the last page's range"
    decoded = entries.all_keys(8)
    step = (entries.key_high.float() - entries.key_low.float()) / 255
    assert float((decoded - keys).abs().max()) <= float(step.max()) / 2 + 1e-6
