"""The cold tier and per-question recall (issue 13), on the random 3-layer model from conftest."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from safetensors.torch import load_file

from infokv_rag import CacheStoreError, CompressedDocument, CompressionConfig, ConfigError, InfoKVEngine
from infokv_rag.cold_tier import ColdLayer
from infokv_rag.config import recall_tokens
from infokv_rag.decoding import working_session
from infokv_rag.documents import document_from_text
from infokv_rag.generation import GenerationOptions
from infokv_rag.prompt import question_turns
from infokv_rag.quantisation import PAGE_TOKENS, QuantisedEntries
from infokv_rag.recall import attend_over_cold
from infokv_rag.store import COLD, MANIFEST, TENSORS, CacheStore, _manifest_checksum

from .conftest import CORPUS
from .helpers import document_cache, resign

TEXT = " ".join(CORPUS * 8)
QUESTION = "What is the notice period?"
ANSWER = "The notice period is thirty days, in writing."


def log_probs(document: CompressedDocument, recall: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (tokens, vocab) over the question, recalling `recall` entries per (layer, KV head),
    and over ANSWER fed after it."""
    engine = document.engine
    ids = engine.prompt.conversation_ids(question_turns(QUESTION))
    answer = engine.tokenizer.encode(ANSWER, add_special_tokens=False)
    n, q = document.cache.document_tokens, len(ids)
    session, plan = working_session(document, q + len(answer), recall)
    assert (plan is not None) == bool(recall)
    with torch.inference_mode():
        asked = engine.runner.forward(torch.tensor(ids), torch.arange(n, n + q), session, recall=plan)
        answered = engine.runner.forward(torch.tensor(answer), torch.arange(n + q, n + q + len(answer)), session)
    return torch.log_softmax(engine.runner.logits(asked), dim=-1), torch.log_softmax(
        engine.runner.logits(answered), dim=-1
    )


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference.exp() * (reference - other)).sum(-1).mean())


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_round_trip_within_half_a_step(bits: int) -> None:
    torch.manual_seed(0)
    heads, m, dim = 2, 2 * PAGE_TOKENS + 5, 64
    keys, values = torch.randn(heads, m, dim) * 3, torch.randn(heads, m, dim)
    order = torch.randperm(m)  # given in any order, kept in position order
    cold = ColdLayer.build([(keys[h, order], values[h, order], order) for h in range(heads)], bits)
    assert cold.lengths == [m, m] and all(torch.equal(p, torch.arange(m)) for p in cold.positions)
    for head, entries in enumerate(cold.heads):
        assert entries.key_codes.dtype == torch.uint8 and entries.key_codes.shape == (1, m, dim * bits // 8)
        # Keys: per channel within a page of PAGE_TOKENS entries.
        page = torch.arange(m) // PAGE_TOKENS
        step = (entries.key_high.float() - entries.key_low.float())[0, page] / (2**bits - 1)
        assert bool(((entries.all_keys(bits)[0] - keys[head]).abs() <= step / 2 + 1e-3).all())
        # Values: per token in groups of channels.
        step = (entries.value_high.float() - entries.value_low.float())[0] / (2**bits - 1)
        step = step.repeat_interleave(dim // step.shape[-1], dim=-1)
        assert bool(((entries.all_values(bits)[0] - values[head]).abs() <= step / 2 + 1e-3).all())


@pytest.mark.parametrize("bits", [4, 8])
def test_code_ranges_hold_offset_channels_and_stay_finite(bits: int) -> None:
    """Ranges are stored in float16: rounded outward, so an offset channel (1000.3 plus a small spread, KIVI's key
    outliers) stays within half a step of its stored range instead of being clamped by half a float16 spacing,
    and saturated, so an element past float16's range (a bf16 model may make one) decodes finite, not NaN."""
    offset = torch.full((1, PAGE_TOKENS, 64), 1000.3) + torch.linspace(0, 0.01, PAGE_TOKENS)[None, :, None]
    entries = QuantisedEntries.encode(offset, offset, bits)
    for decoded, low, high in (
        (entries.all_keys(bits), entries.key_low, entries.key_high),
        (entries.all_values(bits), entries.value_low, entries.value_high),
    ):
        step = float((high.float() - low.float()).max()) / (2**bits - 1)  # one float16 spacing at most: 0.5
        assert float((decoded - offset).abs().max()) <= step / 2 + 1e-4 < 0.02  # inward rounding clamped by 0.2
    huge = torch.randn(1, PAGE_TOKENS, 64)
    huge[0, 3, 5] = 7e4
    entries = QuantisedEntries.encode(huge, -huge, bits)
    assert bool(entries.all_keys(bits).isfinite().all()) and bool(entries.all_values(bits).isfinite().all())
    assert float(entries.all_keys(bits)[0, 3, 5]) == pytest.approx(torch.finfo(torch.float16).max)


@pytest.mark.parametrize("layer_budgets", ["per_head", "global"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_cold_tier_holds_exactly_what_no_part_of_the_hot_cache_does(
    random_engine: InfoKVEngine, bits: int, layer_budgets: str
) -> None:
    full = random_engine.ingest_text(TEXT, CompressionConfig(method="full"))
    config = CompressionConfig(keep=0.25, recall=0.1, cold_bits=bits, settings={"layer_budgets": layer_budgets})
    doc = random_engine.ingest_text(TEXT, config)
    assert doc.cold_tier is not None
    cache = document_cache(doc)
    assert (cache.extras is not None) == (layer_budgets == "per_head")
    n = doc.cache.document_tokens
    for index, (hot, cold, whole) in enumerate(
        zip(cache.layers, doc.cold_tier.layers, document_cache(full).layers, strict=True)
    ):
        for head, entries in enumerate(cold.heads):
            positions = cold.positions[head]
            extras = cache.extras[index].positions[cache.extras[index].of_head(head)] if cache.extras else positions[:0]
            together = torch.cat([hot.positions[head], extras, positions]).sort().values
            assert torch.equal(together, torch.arange(n)), "every position is in the layer, an extra or cold, once"
            assert bool((positions[1:] > positions[:-1]).all())
            keys, values = entries.all_keys(bits)[0], entries.all_values(bits)[0]
            original_keys, original_values = whole.keys[head, positions], whole.values[head, positions]
            # Within half a step of each page's (keys) or group's (values) range, which spans at most twice
            # the largest magnitude.
            tolerance = 1 / (2**bits - 1) + 1e-3
            assert float((keys - original_keys).abs().max()) <= tolerance * float(original_keys.abs().max())
            assert float((values - original_values).abs().max()) <= tolerance * float(original_values.abs().max())
    if layer_budgets == "per_head":
        assert any(len(set(cold.lengths)) > 1 for cold in doc.cold_tier.layers), "heads that keep more evict fewer"
    assert doc.stats.cold_bytes == doc.cold_tier.nbytes > 0
    assert random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25)).cold_tier is None


def test_the_cold_tiers_width_follows_the_cache_dtype_unless_set(random_engine: InfoKVEngine) -> None:
    assert random_engine.runner.dtype == torch.float32
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    assert doc.config.cold_bits == 8 and doc.cold_tier is not None and doc.cold_tier.bits == 8
    assert random_engine.resolve_config(CompressionConfig(keep=0.25, recall=0.1, cold_bits=4)).cold_bits == 4
    assert random_engine.resolve_config(CompressionConfig(keep=0.25)).cold_bits is None, "no cold tier, no width"
    assert CompressionConfig(recall=0.1).cold_tier_bits(2) == 4  # a 16-bit cache: 8 bits would pass 0.5x on disk
    assert CompressionConfig(recall=0.1, cold_bits=8).cold_tier_bits(2) == 8


def test_page_ranges_bound_the_keys_and_their_dot_products() -> None:
    torch.manual_seed(1)
    keys = torch.randn(3 * PAGE_TOKENS + 5, 16)
    cold = ColdLayer.build([(keys, keys.clone(), torch.arange(len(keys)))], bits=8).heads[0]
    restored = cold.all_keys(bits=8)
    grouped = torch.randn(1, 6, 16)
    exact = grouped @ restored.transpose(1, 2)  # (kv_heads, queries, entries)
    pages = torch.arange(cold.length) // PAGE_TOKENS
    for page in range(4):
        low, high = cold.key_low[:, page].float().unsqueeze(-1), cold.key_high[:, page].float().unsqueeze(-1)
        upper = grouped.clamp_min(0) @ high + grouped.clamp_max(0) @ low
        assert bool((exact[:, :, pages == page] <= upper + 1e-2).all())


def test_the_question_attends_to_every_entry_and_ranks_the_cold_ones_by_their_share() -> None:
    torch.manual_seed(2)
    heads, kv_heads, q, dim = 4, 2, 3, 8
    query, cold, hot = torch.randn(heads, q, dim), torch.randn(kv_heads, 10, dim), torch.randn(kv_heads, 7, dim)
    cold_values, hot_values = torch.randn(kv_heads, 10, dim), torch.randn(kv_heads, 7, dim)
    output, mass = attend_over_cold(query, cold, cold_values, hot, hot_values, 0.5)
    # Directly: all keys with the hot ones last, a bottom-right causal mask over the question's own q.
    keys = torch.cat([cold, hot], dim=1).repeat_interleave(heads // kv_heads, dim=0)
    values = torch.cat([cold_values, hot_values], dim=1).repeat_interleave(heads // kv_heads, dim=0)
    logits = query @ keys.transpose(1, 2) * 0.5
    logits[:, :, -q:] += torch.full((q, q), -torch.inf).triu(1)
    probs = torch.softmax(logits, dim=-1)
    assert torch.allclose(output, probs @ values, atol=1e-5)
    expected = probs[:, :, :10].reshape(kv_heads, heads // kv_heads, q, 10).sum(dim=(1, 2))
    assert torch.allclose(mass, expected, atol=1e-5)
    # Logits hundreds apart: the shares stay finite and rank the entries as exactly computed ones do.
    sharp_output, sharp = attend_over_cold(query * 100, cold, cold_values, hot, hot_values, 0.5)
    logits = query @ keys.transpose(1, 2) * 50
    logits[:, :, -q:] += torch.full((q, q), -torch.inf).triu(1)
    probs = torch.softmax(logits.double(), dim=-1)
    expected = probs[:, :, :10].reshape(kv_heads, -1, 10).sum(dim=1).float()
    assert bool(sharp.isfinite().all()) and torch.allclose(sharp, expected, atol=1e-5)
    assert torch.allclose(sharp_output, (probs @ values.double()).float(), atol=1e-4)


@pytest.mark.parametrize("layer_budgets", ["per_head", "global"])
@pytest.mark.parametrize("chunk_size", [2048, 64])
def test_recalling_everything_restores_the_full_cache(
    random_engine: InfoKVEngine, chunk_size: int, layer_budgets: str
) -> None:
    full = random_engine.ingest_text(TEXT, CompressionConfig(method="full"))
    # In chunks too: with a cold tier, later chunks are computed over the whole document, not a compressed one.
    # Without summaries: with no recall the answer then reads the hot cache (and the heads' extras) alone.
    settings = {"layer_budgets": layer_budgets}
    config = CompressionConfig(
        keep=0.25, recall=1.0, cold_bits=8, chunk_size=chunk_size, summaries=0, settings=settings
    )
    doc = random_engine.ingest_text(TEXT, config)
    assert (document_cache(doc).extras is not None) == (layer_budgets == "per_head")
    assert doc.cache.document_tokens > 2 * chunk_size or chunk_size > doc.cache.document_tokens
    reference_question, reference_answer = log_probs(full, 0)
    question, answer = {}, {}
    # A quarter of the document: a few dozen entries of a random model's cache move its answer by less than which
    # ones they are (64 helped by 2% before whole words were kept, and hurt by 2% after).
    some = doc.cache.document_tokens // 4
    for name, recall in (("without", 0), ("some", some), ("everything", doc.cache.document_tokens)):
        asked, answered = log_probs(doc, recall)
        question[name], answer[name] = kl(reference_question, asked), kl(reference_answer, answered)
    # The question reads every entry whatever the budget; the answer reads the hot and the recalled ones.
    assert question["everything"] < 1e-6 and question["some"] < 1e-6 < question["without"]
    assert answer["everything"] < 1e-6 < answer["some"] < answer["without"]


def test_recall_is_per_answer_and_leaves_the_document_cache_alone(random_engine: InfoKVEngine) -> None:
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    cache = document_cache(doc)
    before = [(layer.keys.clone(), layer.positions.clone()) for layer in cache.layers]
    first = doc.generate(question_turns(QUESTION), GenerationOptions(max_new_tokens=6))
    first_text = first.text()
    expected = recall_tokens(0.1, doc.cache.document_tokens)
    assert doc.cold_tier is not None
    n = doc.cache.document_tokens
    assert first.usage.recalled_tokens == sum(min(expected, n - length) for length in doc.cache.lengths)
    # The working cache held the recalled entries, the question and the answer fed back; it read the hot entries
    # in place, holding none of their bytes.
    entry_bytes = random_engine.bytes_per_token // len(cache.layers)
    held = first.usage.recalled_tokens
    fed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    # Beside each layer, the heads' extras (per-head budgets, the default), read in place: the answer holds one
    # log count per padded slot, never a padded copy of every layer's; no summaries when recalling.
    side = sum(entries.nbytes for entries in doc.cache.working_cache(0, summaries=False).summaries or [])
    assert cache.extras is not None and side > 0
    assert side == sum(4 * extra.counts.numel() * extra.most for extra in cache.extras)
    assert first.usage.peak_cache_bytes == (held + len(cache.layers) * fed) * entry_bytes + side
    doc.ask("Who delivers the goods?", max_new_tokens=6, recall=0.5)
    assert doc.ask(QUESTION, max_new_tokens=6) == first_text
    off = doc.generate(question_turns(QUESTION), GenerationOptions(max_new_tokens=6, recall=0))
    off.text()
    assert off.usage.recalled_tokens == 0
    for (keys, positions), layer in zip(before, cache.layers, strict=True):
        assert torch.equal(keys, layer.keys) and torch.equal(positions, layer.positions)


@pytest.mark.parametrize(("keep", "repeats", "room"), [(0.25, 8, 40), (0.5, 3, 0)])
def test_recall_holds_the_decode_cap(random_engine: InfoKVEngine, keep: float, repeats: int, room: int) -> None:
    # With no room beyond the document's layers, the first eviction leaves none spare: recall then grows the
    # buffers inside the forward pass, and the next eviction must still be able to cut them.
    doc = random_engine.ingest_text(" ".join(CORPUS * repeats), CompressionConfig(keep=keep, recall=0.1))
    cap = max(doc.cache.lengths) + room
    turns = question_turns("What is the notice period?")
    generation = doc.generate(turns, GenerationOptions(max_new_tokens=80, max_cache_tokens=cap))
    generation.text()
    assert generation.usage.recalled_tokens > 0
    assert generation.usage.max_resident_tokens <= cap


def test_a_cap_with_no_room_to_recall_counts_the_summaries_it_reads(random_engine: InfoKVEngine) -> None:
    """An answer that recalls nothing reads the summaries instead, so under `max_cache_tokens` they must fit; one
    that may recall needs room for one recalled entry only, and the refusal says that least cap (it said the one
    with the summaries, refusing caps just under it that answer, recalling less)."""
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.2))
    extras = doc.cache.beside_tokens(summaries=False)
    summaries = doc.cache.beside_tokens() - extras
    assert summaries > 1
    turns = [("user", "Summarise.")]
    suffix = random_engine.prompt.conversation_ids(turns)
    slack = GenerationOptions().eviction_slack
    floor = doc.cache.sink_tokens + len(suffix) + doc.config.window + extras + slack
    with pytest.raises(
        ConfigError, match=f"one recalled entry .* the {summaries} summaries instead.* at least {floor + 1},"
    ):
        doc.generate(turns, GenerationOptions(max_new_tokens=8, max_cache_tokens=floor))
    generation = doc.generate(turns, GenerationOptions(max_new_tokens=40, max_cache_tokens=floor + 1))
    generation.text()
    assert generation.usage.recalled_tokens > 0 and generation.usage.max_resident_tokens <= floor + 1
    with pytest.raises(ConfigError, match=f"the summaries \\({summaries}\\) .* at least {floor + summaries},"):
        doc.generate(turns, GenerationOptions(max_new_tokens=8, max_cache_tokens=floor + 1, recall=0))
    generation = doc.generate(turns, GenerationOptions(max_new_tokens=40, max_cache_tokens=floor + summaries, recall=0))
    generation.text()
    assert generation.usage.recalled_tokens == 0 and generation.usage.max_resident_tokens <= floor + summaries


def test_recall_options_are_checked(random_engine: InfoKVEngine) -> None:
    for bad in ({"recall": 1.5}, {"recall": -3}, {"recall": True}, {"cold_bits": 2}):
        with pytest.raises(ConfigError):
            CompressionConfig(**bad)
    with pytest.raises(ConfigError, match="needs recall > 0"):
        CompressionConfig(cold_bits=8)  # a width for a cold tier that would not exist
    with pytest.raises(ConfigError, match="recall"):
        GenerationOptions(recall=2.0)
    plain = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25))
    with pytest.raises(ConfigError, match="no cold tier"):
        plain.ask(QUESTION, recall=0.1)
    # Without a cold tier a config reads as it did before the cold tier existed (store keys unchanged).
    assert "recall" not in CompressionConfig().to_dict()
    assert CompressionConfig(recall=0.1).to_dict()["recall"] == 0.1


def test_a_saved_cold_tier_is_mapped_verified_and_answers_the_same(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    answer = doc.ask(QUESTION, max_new_tokens=8)
    path = doc.save(tmp_path / "doc")
    loaded = random_engine.load(path)
    assert loaded.cold_tier is not None and loaded.stats == doc.stats
    assert loaded.ask(QUESTION, max_new_tokens=8) == answer
    for got, want in zip(loaded.cold_tier.layers, doc.cold_tier.layers, strict=True):  # type: ignore[union-attr]
        for head in range(len(want.heads)):
            assert torch.equal(got.heads[head].key_codes, want.heads[head].key_codes)
            assert torch.equal(got.positions[head], want.positions[head])

    tampered = shutil.copytree(path, tmp_path / "tampered")
    data = bytearray((tampered / COLD).read_bytes())
    data[-1] ^= 1
    (tampered / COLD).write_bytes(bytes(data))
    with pytest.raises(CacheStoreError, match="sha256"):
        random_engine.load(tampered)

    truncated = shutil.copytree(path, tmp_path / "truncated")
    (truncated / COLD).write_bytes((path / COLD).read_bytes()[:-100])
    with pytest.raises(CacheStoreError, match="sha256"):
        random_engine.load(truncated)

    missing = shutil.copytree(path, tmp_path / "missing")
    (missing / COLD).unlink()
    with pytest.raises(CacheStoreError, match="missing"):
        random_engine.load(missing)


def test_a_mapped_cold_tier_changed_in_place_after_loading_is_not_read(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """The cold tier is mapped, so a change made to its file in place after the load would show through the map
    (and reading past a truncation would kill the process): recall refuses it instead. A file replaced by a
    rename leaves the map on the verified one."""
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    answer = doc.ask(QUESTION, max_new_tokens=8)
    without_recall = doc.ask(QUESTION, max_new_tokens=8, recall=0)
    path = doc.save(tmp_path / "doc")
    good = (path / COLD).read_bytes()

    loaded = random_engine.load(path)
    replacement = path / "replacement"
    replacement.write_bytes(bytes(len(good)))
    os.replace(replacement, path / COLD)  # zeros, by rename: the map still reads the file it verified
    assert loaded.ask(QUESTION, max_new_tokens=8) == answer
    (path / COLD).write_bytes(good)

    for change in ("written over", "truncated"):  # written over first: without the check it fails, not crashes
        loaded = random_engine.load(path)
        # An answer asked before the change and read after it (as the service queues answers) reads the cold tier
        # only then: it is checked then.
        asked_before = loaded.generate(question_turns(QUESTION), GenerationOptions(max_new_tokens=8))
        time.sleep(0.05)  # file times tick coarsely: a change must come after the load's stamp
        with open(path / COLD, "r+b") as handle:
            if change == "written over":
                handle.seek(len(good) // 2)
                handle.write(bytes(4096))
            else:
                handle.truncate(len(good) // 2)
        with pytest.raises(CacheStoreError, match="written over or truncated in place"):
            asked_before.text()
        with pytest.raises(CacheStoreError, match="written over or truncated in place"):
            loaded.ask(QUESTION, max_new_tokens=8)
        assert loaded.ask(QUESTION, max_new_tokens=8, recall=0) == without_recall, "the hot cache is in memory"
        with pytest.raises(CacheStoreError, match="sha256"):
            random_engine.load(path)
        (path / COLD).write_bytes(good)


def test_a_cold_tier_written_over_with_its_modification_time_set_back_is_not_read(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """`cp -p`, `touch -r` and `rsync -a --inplace` write a file in place and set its modification time back: with
    the size unchanged too, the map read the new bytes unnoticed. Its status change time tells (it cannot be set
    back), and a change of status alone (a chmod, a new hard link) is read again and found the same, as are a
    `touch` and the same bytes written again in place (each refused for good by a loaded cache before)."""
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    answer = doc.ask(QUESTION, max_new_tokens=8)
    path = doc.save(tmp_path / "doc")
    good = (path / COLD).read_bytes()
    loaded = random_engine.load(path)
    time.sleep(0.05)  # file times tick coarsely: a change must come after the load's stamp
    (path / COLD).chmod(0o600)
    os.link(path / COLD, tmp_path / "backup")
    assert loaded.ask(QUESTION, max_new_tokens=8) == answer
    time.sleep(0.05)
    os.utime(path / COLD)
    assert loaded.ask(QUESTION, max_new_tokens=8) == answer
    time.sleep(0.05)
    with open(path / COLD, "r+b") as handle:
        handle.write(good)
    assert loaded.ask(QUESTION, max_new_tokens=8) == answer
    (tmp_path / "backup").unlink()
    for then_removed in (False, True):  # removed: its removal is its last status change, after the write
        loaded = random_engine.load(path)
        time.sleep(0.05)
        status = (path / COLD).stat()
        with open(path / COLD, "r+b") as handle:
            handle.seek(len(good) // 2)
            handle.write(bytes(4096))
        os.utime(path / COLD, ns=(status.st_atime_ns, status.st_mtime_ns))
        assert (path / COLD).stat().st_mtime_ns == status.st_mtime_ns
        if then_removed:
            (path / COLD).unlink()
        with pytest.raises(CacheStoreError, match="written over or truncated in place"):
            loaded.ask(QUESTION, max_new_tokens=8)
        (path / COLD).write_bytes(good)


def test_a_cold_tier_changed_in_place_while_a_question_reads_it_is_refused_before_any_answer(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change that lands after the check before an answer, while the question's pass reads the cold tier (other
    answers run between the two), is read with it: the answer is refused before any of it is given."""
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1)).save(tmp_path / "doc")
    loaded = random_engine.load(path)
    forward = random_engine.runner.forward

    def written_over_while_read(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("recall") is not None:
            data = (path / COLD).read_bytes()
            with open(path / COLD, "r+b") as handle:  # one byte of the codes changed, in place, the size kept
                handle.seek(len(data) - 1)
                handle.write(bytes([data[-1] ^ 1]))
            status = os.stat(path / COLD)
            os.utime(path / COLD, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))  # file times tick coarsely
        return forward(*args, **kwargs)

    monkeypatch.setattr(random_engine.runner, "forward", written_over_while_read)
    given: list[str] = []
    with pytest.raises(CacheStoreError, match="written over or truncated in place"):
        given.extend(loaded.stream(QUESTION, max_new_tokens=8))
    assert given == []


@pytest.mark.parametrize("where", ["directory moved", "another working directory"])
def test_a_mapped_cold_tier_changed_in_place_is_noticed_wherever_its_directory_is(
    where: str, random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mapped file is checked through the descriptor it was mapped from, not by its path: once the cache
    directory is moved, or the process changes directory after a load by a relative path, the path names no file or
    another one, and a change made in place to the mapped file must still be noticed."""
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1)).save(tmp_path / "doc")
    size = (path / COLD).stat().st_size
    monkeypatch.chdir(tmp_path)
    loaded = random_engine.load("doc")
    if where == "directory moved":
        path = path.rename(tmp_path / "archived")
    else:
        shutil.copytree(path, tmp_path / "elsewhere" / "doc")  # "doc" names an intact copy there
        monkeypatch.chdir(tmp_path / "elsewhere")
    time.sleep(0.05)  # file times tick coarsely: a change must come after the load's stamp
    with open(path / COLD, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(bytes(4096))
    with pytest.raises(CacheStoreError, match="written over or truncated in place"):
        loaded.ask(QUESTION, max_new_tokens=8)


def test_a_mapped_cold_tier_changed_in_place_is_not_saved(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """Saving a loaded document reads its mapped cold tier: changed in place since the load, the new bytes would
    be saved under fresh checksums (a copy that then loads as verified), and a truncation would kill the
    process. The save refuses it instead, and leaves no copy."""
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1)).save(tmp_path / "doc")
    good = (path / COLD).read_bytes()
    for change in ("written over", "truncated"):  # written over first: without the check it fails, not crashes
        loaded = random_engine.load(path)
        time.sleep(0.05)  # file times tick coarsely: a change must come after the load's stamp
        with open(path / COLD, "r+b") as handle:
            if change == "written over":
                handle.seek(len(good) - 64)
                handle.write(b"\x7f" * 64)
            else:
                handle.truncate(len(good) // 2)
        copy = tmp_path / f"copy {change}"
        with pytest.raises(CacheStoreError, match="written over or truncated in place"):
            loaded.save(copy)
        assert not copy.exists()
        (path / COLD).write_bytes(good)


def test_special_files_in_a_cache_are_refused_without_reading_them(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    """A FIFO would block the load for good, and a link to a device such as /dev/zero would read without end."""
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1)).save(tmp_path / "doc")
    for name in (MANIFEST, TENSORS, COLD):
        for special in ("fifo", "device"):
            broken = shutil.copytree(path, tmp_path / f"{special}-{name}")
            (broken / name).unlink()
            if special == "fifo":
                os.mkfifo(broken / name)
            else:
                (broken / name).symlink_to("/dev/zero")
            with pytest.raises(CacheStoreError, match="not a regular file"):
                random_engine.load(broken)


def test_a_foreign_cold_tier_of_the_same_shapes_is_refused_even_with_a_consistent_manifest(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """Uniform budgets and documents of as many tokens: every head of either cache keeps as many entries, so the
    other document's cold tier fits this cache's shapes exactly, and only its binding tells it apart."""
    config = CompressionConfig(keep=0.25, recall=0.1, settings={"layer_budgets": "uniform"})
    other_text = " ".join(CORPUS[::-1] * 8)  # the same sentences in another order
    assert len(random_engine.prompt.document_ids(other_text)) == len(random_engine.prompt.document_ids(TEXT))
    doc, other = (random_engine.ingest_text(text, config) for text in (TEXT, other_text))
    assert doc.cold_tier is not None and other.cold_tier is not None
    assert [layer.lengths for layer in doc.cold_tier.layers] == [layer.lengths for layer in other.cold_tier.layers]
    path, other_path = doc.save(tmp_path / "doc"), other.save(tmp_path / "other")
    # The other document's cold tier, with the manifest re-signed to match it (a copy script's work).
    shutil.copy(other_path / COLD, path / COLD)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][COLD] = json.loads((other_path / MANIFEST).read_text())["files"][COLD]
    manifest["checksum"] = _manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheStoreError, match="cold.safetensors is not the cold tier of this cache"):
        random_engine.load(path)
    # Saved again, a loaded cache's cold tier is bound to it as when it was made.
    again = random_engine.load(random_engine.load(other_path).save(tmp_path / "again"))
    assert again.ask(QUESTION, max_new_tokens=8) == other.ask(QUESTION, max_new_tokens=8)


def test_a_cold_tier_of_a_cache_that_keeps_the_same_positions_is_refused(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """streaming_llm keeps positions by place alone: the same text cached at another dtype keeps the same positions
    in other entries, and its cold tier (codes of as many bits) fits shapes and positions. The binding is to the hot
    tensors' bytes, so it is refused."""
    config = CompressionConfig(method="streaming_llm", keep=0.3, recall=0.1, cold_bits=8)
    paths = {
        dtype: InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu", dtype=dtype)
        .ingest_text(TEXT, config)
        .save(tmp_path / dtype)
        for dtype in ("fp32", "bf16")
    }
    shutil.copy(paths["fp32"] / COLD, paths["bf16"] / COLD)
    manifest = json.loads((paths["bf16"] / MANIFEST).read_text())
    manifest["files"][COLD] = json.loads((paths["fp32"] / MANIFEST).read_text())["files"][COLD]
    manifest["checksum"] = _manifest_checksum(manifest)
    (paths["bf16"] / MANIFEST).write_text(json.dumps(manifest))
    engine = InfoKVEngine.from_pretrained(str(random_model_dir), device="cpu", dtype="bf16")
    with pytest.raises(CacheStoreError, match="cold.safetensors is not the cold tier of this cache"):
        engine.load(paths["bf16"])


@pytest.mark.parametrize("version", [8, 9])
def test_a_cold_tier_saved_before_it_was_bound_to_the_hot_tensors_is_refused_and_a_cache_without_one_loads(
    version: int, random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """A cold tier of format 8 or earlier holds no binding, one of format 9 a binding to the kept positions only: it
    cannot be told from another cache's, so it is not read (the cache is ingested again); an older cache without a
    cold tier loads as it was."""

    def as_older_format(path: Path) -> Path:
        resign(path, load_file(path / TENSORS))  # its hot tensors as those formats wrote them: without a binding
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["format_version"] = version
        manifest["checksum"] = _manifest_checksum(manifest)
        (path / MANIFEST).write_text(json.dumps(manifest))
        return path

    with_cold_tier = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    older = rf"cold tier saved by an older version of infokv-rag \(cache format {version}\)"
    with pytest.raises(CacheStoreError, match=older):
        random_engine.load(as_older_format(with_cold_tier.save(tmp_path / "cold")))
    without = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25))
    loaded = random_engine.load(as_older_format(without.save(tmp_path / "hot")))
    assert loaded.ask(QUESTION, max_new_tokens=8) == without.ask(QUESTION, max_new_tokens=8)


def test_a_cache_made_with_recall_whose_cold_tier_is_gone_is_refused(
    random_engine: InfoKVEngine, tmp_path: Path
) -> None:
    """The cold tier dropped from a consistent manifest: refused at the load (a `CacheStore` then reads the document
    again), not loaded for every answer that recalls by default to fail."""
    path = random_engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1)).save(tmp_path / "doc")
    (path / COLD).unlink()
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["files"][COLD]
    manifest["checksum"] = _manifest_checksum(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CacheStoreError, match="made with recall 0.1 but holds no cold tier"):
        random_engine.load(path)


def test_recall_needs_a_method_that_evicts() -> None:
    # A full cache evicts nothing: with a default recall every ask would fail for want of a cold tier.
    with pytest.raises(ConfigError, match="evicts"):
        CompressionConfig(method="full", recall=0.1)
    assert not CompressionConfig(method="full").keeps_cold_tier


def test_layers_that_evict_nothing_keep_an_empty_cold_tier(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    doc = random_engine.ingest_text(TEXT, CompressionConfig(keep=100_000, recall=0.1))
    assert doc.cold_tier is not None and [layer.lengths for layer in doc.cold_tier.layers] == [[0, 0]] * 3
    generation = doc.generate(question_turns(QUESTION), GenerationOptions(max_new_tokens=4))
    answer = generation.text()
    assert generation.usage.recalled_tokens == 0
    loaded = random_engine.load(doc.save(tmp_path / "doc"))
    assert loaded.cold_tier is not None and loaded.ask(QUESTION, max_new_tokens=4) == answer


def test_the_store_keeps_a_saved_cache_that_fails_to_load_back(
    random_engine: InfoKVEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A document just read is returned as its saved copy loaded back (its cold tier mapped): a load-back that
    fails (no descriptor left) deleted the cache it had saved whole. The document read is returned, the cache kept."""
    store = CacheStore(tmp_path / "store")
    config = CompressionConfig(keep=0.25, recall=0.1)
    document = document_from_text(TEXT)

    def out_of_descriptors(*args: Any) -> NoReturn:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(random_engine, "load", out_of_descriptors)
    read, reused = store.ingest(random_engine, document, config)
    assert not reused and read.cold_tier is not None and read.cold_tier.source is None
    monkeypatch.undo()
    assert store.holds(random_engine, document, config)
    assert store.ingest(random_engine, document, config)[1]


def test_the_store_keeps_one_cache_whatever_the_recall_budget(random_engine: InfoKVEngine, tmp_path: Path) -> None:
    store = CacheStore(tmp_path / "store")
    document = document_from_text(TEXT)
    first, reused = store.ingest(random_engine, document, CompressionConfig(keep=0.25, recall=0.1))
    assert not reused and first.config.recall == 0.1
    # The document just read comes back as saved, its cold tier mapped from the file rather than held in memory.
    assert first.cold_tier is not None and first.cold_tier.source is not None
    # Another budget reads the same bytes: the stored cache, answering with the budget asked for.
    again, reused = store.ingest(random_engine, document, CompressionConfig(keep=0.25, recall=16))
    assert reused and again.config.recall == 16 and again.cold_tier is not None
    generation = again.generate(question_turns(QUESTION), GenerationOptions(max_new_tokens=2))
    generation.text()
    assert generation.usage.recalled_tokens == 16 * len(again.cold_tier.layers)
    # The width the engine chose for the default (8 bits for float32) is the same cache; another width, or
    # no cold tier, is another cache.
    _, reused = store.ingest(random_engine, document, CompressionConfig(keep=0.25, recall=0.1, cold_bits=8))
    assert reused
    _, reused = store.ingest(random_engine, document, CompressionConfig(keep=0.25, recall=0.1, cold_bits=4))
    assert not reused
    plain, reused = store.ingest(random_engine, document, CompressionConfig(keep=0.25))
    assert not reused and plain.cold_tier is None
    assert len(list(store.root.iterdir())) == 3
