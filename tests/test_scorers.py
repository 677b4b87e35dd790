"""Every registered compression method on synthetic signals, in the style of kvpress's tests over all presses.

Each method gets only the signals it declares (the others are None), so a scorer that reads an
undeclared signal fails here. Adding a method: its module under infokv_rag/scorers/ and its entry in
EXPECTED_SIGNALS.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from infokv_rag import CompressionConfig, ConfigError, InfoKVEngine
from infokv_rag.config import SETTINGS_ADDED, described, matches
from infokv_rag.ingestion import Ingestion
from infokv_rag.scorers import method, method_names
from infokv_rag.scorers.base import Scorer, average_ranks, normalize
from infokv_rag.scorers.infokv import InfoKVScorer, InfoKVSettings
from infokv_rag.selection import adaptive_budgets, protected_mask, select_per_head, select_tokens
from infokv_rag.signals import (
    ACCUMULATED_ATTENTION,
    EVOLUTION,
    INFORMATION,
    LAST_QUERY_ATTENTION,
    PREDICTED_RECONSTRUCTION,
    RECONSTRUCTION_ATTENTION,
    SIGNALS,
    WINDOW_ATTENTION,
    LayerBudgetSettings,
    LayerSignals,
    SignalCapture,
)

EXPECTED_SIGNALS: dict[str, frozenset[str]] = {
    "full": frozenset(),
    "h2o": frozenset({ACCUMULATED_ATTENTION}),
    "kvzip": frozenset({RECONSTRUCTION_ATTENTION}),
    "infokv": frozenset({INFORMATION, PREDICTED_RECONSTRUCTION}),
    "infokv_evolution": frozenset({EVOLUTION}),
    "infokv_information": frozenset({INFORMATION}),
    "infokv_quality": frozenset({INFORMATION, RECONSTRUCTION_ATTENTION}),
    "knorm": frozenset(),
    "random": frozenset(),
    "snapkv": frozenset({WINDOW_ATTENTION}),
    "streaming_llm": frozenset(),
    "tova": frozenset({LAST_QUERY_ATTENTION}),
}
"""What each method reads with its default settings."""

KV_HEADS, HEADS, HEAD_DIM = 2, 4, 8
TOKENS_READ, SINKS, WINDOW, BUDGET = 96, 4, 16, 40
README = Path(__file__).resolve().parent.parent / "README.md"


def synthetic_signals(wanted: frozenset[str], seed: int = 0, layer: int = 1, keep: float = 0.25) -> LayerSignals:
    """One layer after some compression: 70 of 96 positions resident per KV head (different per head)."""
    generator = torch.Generator().manual_seed(seed)
    length = 70

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=generator)

    old = torch.stack(
        [
            torch.randperm(TOKENS_READ - SINKS - WINDOW, generator=generator)[: length - SINKS - WINDOW]
            for _ in range(KV_HEADS)
        ]
    )
    positions = torch.cat(
        [
            torch.arange(SINKS).expand(KV_HEADS, -1),
            (old + SINKS).sort(dim=1).values,
            torch.arange(TOKENS_READ - WINDOW, TOKENS_READ).expand(KV_HEADS, -1),
        ],
        dim=1,
    )
    evolution = rand(TOKENS_READ)
    available = {
        WINDOW_ATTENTION: rand(HEADS, length).softmax(dim=-1),
        LAST_QUERY_ATTENTION: rand(HEADS, length).softmax(dim=-1),
        ACCUMULATED_ATTENTION: rand(KV_HEADS, length) * 10,
        RECONSTRUCTION_ATTENTION: rand(KV_HEADS, length),
        PREDICTED_RECONSTRUCTION: rand(KV_HEADS, length) * 0.1,
        INFORMATION: rand(TOKENS_READ) * 5,
        EVOLUTION: evolution,
    }
    given: dict[str, Any] = {name: value for name, value in available.items() if name in wanted}
    if EVOLUTION in wanted:
        given["mean_evolution"] = evolution * 0.5 + 0.25
    return LayerSignals(
        layer=layer,
        tokens_read=TOKENS_READ,
        positions=positions,
        keys=rand(KV_HEADS, length, HEAD_DIM) - 0.5,
        values=rand(KV_HEADS, length, HEAD_DIM) - 0.5,
        sentences=torch.arange(TOKENS_READ) // 7,
        clauses=torch.arange(TOKENS_READ) // 3,
        words=torch.arange(TOKENS_READ) // 2,
        numerals=torch.arange(TOKENS_READ) % 11 == 0,
        keep=keep,
        seed=seed,
        **given,
    )


def scorer_of(name: str, **settings: Any) -> Scorer[Any]:
    config = CompressionConfig(method=name, settings=settings)
    return config.method_spec.build(config.settings)


def test_the_registry_is_what_this_file_expects() -> None:
    assert set(method_names()) == set(EXPECTED_SIGNALS)
    for name in method_names():
        assert method(name).name == name


@pytest.mark.parametrize("name", method_names())
def test_declared_signals(name: str) -> None:
    signals = scorer_of(name).signals
    assert signals == EXPECTED_SIGNALS[name]
    assert signals <= SIGNALS


@pytest.mark.parametrize("name", method_names())
def test_scores_have_one_value_per_resident_token_and_kv_head(name: str) -> None:
    signals = synthetic_signals(scorer_of(name).signals)
    scores = scorer_of(name).score(signals)
    assert scores.shape == (KV_HEADS, signals.positions.shape[1])
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("name", method_names())
def test_scores_are_deterministic(name: str) -> None:
    wanted = scorer_of(name).signals
    first = scorer_of(name).score(synthetic_signals(wanted, seed=3))
    again = scorer_of(name).score(synthetic_signals(wanted, seed=3))
    assert torch.equal(first, again)


@pytest.mark.parametrize("name", method_names())
def test_selection_respects_the_budget_and_keeps_sinks_and_window(name: str) -> None:
    signals = synthetic_signals(scorer_of(name).signals)
    scores = scorer_of(name).score(signals)
    protected = protected_mask(signals.positions, TOKENS_READ, SINKS, WINDOW)
    kept = select_tokens(scores, protected, BUDGET)
    assert kept.shape == (KV_HEADS, BUDGET)
    for head in range(KV_HEADS):
        positions = set(signals.positions[head, kept[head]].tolist())
        assert set(range(SINKS)) <= positions, "attention sinks are kept"
        assert set(range(TOKENS_READ - WINDOW, TOKENS_READ)) <= positions, "the observation window is kept"
        assert len(positions) == BUDGET


@pytest.mark.parametrize("name", method_names())
def test_settings_have_defaults_round_trip_and_refuse_unknown_fields(name: str) -> None:
    config = CompressionConfig(method=name)
    assert config.settings == method(name).settings()
    assert CompressionConfig.from_dict(config.to_dict()) == config
    assert hash(config) == hash(CompressionConfig.from_dict(config.to_dict()))
    with pytest.raises(ConfigError, match=f"method '{name}' has no setting no_such_knob"):
        CompressionConfig(method=name, settings={"no_such_knob": 1})


@pytest.mark.parametrize("name", method_names())
def test_a_method_refuses_every_other_method_s_settings_object(name: str) -> None:
    """Even one whose class subclasses its own (the quality mode's settings are InfoKV's and more): it would run
    as that method under this one's name, or fail deep inside scoring."""
    own = method(name).settings
    for other in {method(other).settings for other in method_names()} - {own}:
        with pytest.raises(ConfigError, match=f"method '{name}' takes {own.__name__}, not {other.__name__}"):
            CompressionConfig(method=name, settings=other())


def added_settings(name: str) -> set[str]:
    """The settings of `SETTINGS_ADDED` that method `name` has."""
    return SETTINGS_ADDED.keys() & set(method(name).setting_names)


@pytest.mark.parametrize("name", [name for name in method_names() if added_settings(name)])
def test_a_setting_added_later_is_left_out_of_the_dict_at_the_value_older_configs_had(name: str) -> None:
    own = added_settings(name)
    before = CompressionConfig(method=name, settings={setting: SETTINGS_ADDED[setting] for setting in own})
    assert not own & before.to_dict()["settings"].keys()  # so its saved configs and store keys stay as they were
    assert CompressionConfig.from_dict(before.to_dict()) == before
    for setting in own:
        hints = typing.get_type_hints(method(name).settings)
        choices = typing.get_args(hints[setting]) if typing.get_origin(hints[setting]) is Literal else (True, False)
        other = next(choice for choice in choices if choice != SETTINGS_ADDED[setting])
        try:
            changed = CompressionConfig(method=name, settings={**before.to_dict()["settings"], setting: other})
        except ConfigError:
            continue  # that value needs other settings too (e.g. global budgets need a scale shared by layers)
        assert changed.to_dict()["settings"][setting] == other
        assert CompressionConfig.from_dict(changed.to_dict()) == changed


@pytest.mark.parametrize("name", method_names())
def test_settings_with_choices_are_validated_on_construction(name: str) -> None:
    settings = method(name).settings
    hints = typing.get_type_hints(settings)
    for item in dataclasses.fields(settings):
        if typing.get_origin(hints[item.name]) is Literal:
            with pytest.raises(ConfigError, match=item.name):
                settings(**{item.name: "not-a-choice"})


@pytest.mark.parametrize("name", ["infokv", "infokv_information", "snapkv"])
def test_pooling_kernel_must_be_odd(name: str) -> None:
    with pytest.raises(ConfigError, match="pooling_kernel must be a positive odd number"):
        CompressionConfig(method=name, settings={"pooling_kernel": 4})


def test_infokv_reads_only_the_signals_its_weights_use() -> None:
    window = {"attention": "window", "layer_budgets": "uniform"}
    assert scorer_of("infokv", lam=1.0, **window).signals == {WINDOW_ATTENTION}
    assert scorer_of("infokv", lam=1.0, accumulated_attention=True, **window).signals == {
        WINDOW_ATTENTION,
        ACCUMULATED_ATTENTION,
    }
    assert scorer_of("infokv", tau=0.5, **window).signals == {INFORMATION, EVOLUTION, WINDOW_ATTENTION}
    assert scorer_of("infokv", tau=0.0, lam=0.0, layer_budgets="uniform").signals == {EVOLUTION}
    # Global layer budgets read the predicted attention even when A has no weight.
    assert scorer_of("infokv", lam=0.0).signals == {INFORMATION, PREDICTED_RECONSTRUCTION}


def test_infokv_attention_from_reconstruction() -> None:
    assert scorer_of("infokv", attention="reconstruction").signals == {INFORMATION, RECONSTRUCTION_ATTENTION}
    # Global layer budgets rank layers by the reconstruction attention even when A has no weight.
    budgets_only = scorer_of("infokv", attention="reconstruction", layer_budgets="global", lam=0.0)
    assert budgets_only.signals == {INFORMATION, RECONSTRUCTION_ATTENTION}
    signals = synthetic_signals(SIGNALS)
    attention_only = scorer_of("infokv", attention="reconstruction", lam=1.0, normalization="rank", units="token")
    assert torch.equal(attention_only.score(signals), scorer_of("kvzip").score(signals).argsort().argsort() / 69)
    with pytest.raises(
        ConfigError, match=r"layer_budgets=\"per_head\" needs attention=\"reconstruction\" or \"predicted\""
    ):
        CompressionConfig(method="infokv", settings={"attention": "window"})


def test_infokv_attention_predicted_by_the_surrogate() -> None:
    assert scorer_of("infokv", attention="predicted", layer_budgets="global").signals == {
        INFORMATION,
        PREDICTED_RECONSTRUCTION,
    }
    signals = synthetic_signals(SIGNALS)
    attention_only = scorer_of("infokv", lam=1.0, units="token")
    assert signals.predicted_reconstruction is not None
    assert torch.equal(attention_only.score(signals), signals.predicted_reconstruction.argsort().argsort() / 69)
    assert torch.equal(attention_only.comparable_scores(signals), signals.predicted_reconstruction)


@pytest.mark.parametrize("name", ["kvzip", "infokv_quality"])
def test_reconstruction_methods_keep_per_head_budgets_over_scores_comparable_across_layers(name: str) -> None:
    signals = synthetic_signals(scorer_of(name).signals)
    settings = CompressionConfig(method=name).settings
    assert isinstance(settings, LayerBudgetSettings) and settings.layer_budgets == "per_head"
    assert signals.reconstruction_attention is not None
    assert torch.equal(scorer_of(name).comparable_scores(signals), signals.reconstruction_attention)


def test_the_ablations_score_like_infokv_with_fixed_weights() -> None:
    for name, weights in (
        ("infokv_information", {"tau": 1.0, "lam": 0.0}),
        ("infokv_evolution", {"tau": 0.0, "lam": 0.0}),
    ):
        signals = synthetic_signals(SIGNALS)
        same_signals = dataclasses.asdict(scorer_of(name).settings)
        # Built directly: with lam=0, infokv would refuse the ablations' window attention (it reads none).
        infokv = InfoKVScorer(InfoKVSettings(**{**same_signals, **weights}))
        assert torch.equal(scorer_of(name).score(signals), infokv.score(signals))


def test_random_depends_on_seed_and_layer() -> None:
    scorer = scorer_of("random")
    base = scorer.score(synthetic_signals(frozenset(), seed=0, layer=1))
    assert not torch.equal(base, scorer.score(synthetic_signals(frozenset(), seed=0, layer=2)))


def test_the_readme_table_lists_exactly_the_registered_methods() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Compression methods") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", section, flags=re.MULTILINE)
    assert dict(rows) == {name: method(name).summary for name in method_names()}
    assert len(rows) == len(method_names())


def test_word_units_keep_a_word_whole() -> None:
    signals = synthetic_signals(SIGNALS)
    by_token = scorer_of("infokv", units="token").score(signals)
    by_word = scorer_of("infokv").score(signals)
    words = signals.words[signals.positions]
    for head in range(KV_HEADS):
        for word in words[head].unique():
            members = words[head] == word
            assert bool((by_word[head, members] == by_token[head, members].max()).all())
    assert not torch.equal(by_word, by_token)


def test_a_budget_that_ends_inside_a_word_keeps_whole_words_instead() -> None:
    """Word scores tie, so a budget can end inside a word ("259,091" kept as "091"): the word goes whole and the
    best later words that fit whole take its places; the count stays the budget."""
    # Positions 0-9: sink 0, window 9; words: 0 | 1 | 2 2 2 | 3 | 4 4 | 5 | 6 | 7 | 8 (position 9 is word 8).
    units = torch.tensor([[0, 1, 2, 2, 2, 3, 4, 4, 5, 8]])
    scores = torch.tensor([[0.0, 9.0, 8.0, 8.0, 8.0, 1.0, 5.0, 5.0, 4.0, 0.0]])
    protected = torch.tensor([[True, False, False, False, False, False, False, False, False, True]])
    # Budget 4: sink, window, word 1, then one place: word 2 (three tokens) does not fit, word 4 (two) neither,
    # word 5 (one token) does.
    assert select_tokens(scores, protected, 4, units)[0].tolist() == [0, 1, 8, 9]
    assert select_tokens(scores, protected, 4)[0].tolist() == [0, 1, 4, 9]  # by token: a piece of word 2
    # Budget 6: word 2 fits whole; the cut then falls between words and nothing changes.
    assert select_tokens(scores, protected, 6, units)[0].tolist() == [0, 1, 2, 3, 4, 9]
    # Per head budgets choose the same way.
    common, rest = select_per_head(scores.expand(2, -1), protected.expand(2, -1), [4, 6], units.expand(2, -1))
    assert sorted([*common[0].tolist(), *rest[0].tolist()]) == [0, 1, 8, 9]
    assert sorted([*common[1].tolist(), *rest[1].tolist()]) == [0, 1, 2, 3, 4, 9]
    # A word the window's edge runs through keeps its protected part; its rest ranks by its score (word 8: 0.0).
    units_at_window = torch.tensor([[0, 1, 2, 2, 2, 3, 4, 4, 8, 8]])
    assert select_tokens(scores, protected, 3, units_at_window)[0].tolist() == [0, 1, 9]


def test_a_cut_word_gives_way_to_later_words_that_fill_its_places_exactly() -> None:
    """The first later word that fits is not always part of a whole fill: the places go to the best later words
    that fill them exactly; only where none do does the cut stay inside the word, and then the words ranked
    before it stay too (a number counted first in every head never gives way to a plain word)."""
    # Sink 0; words ranked 1 (2 tokens), 2 (5), 3 (3), 4 (2), 5 (2).
    units = torch.tensor([[0, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3, 4, 4, 5, 5]])
    scores = torch.tensor([0.0, 9, 8, 5, 4, 3])[units]
    protected = torch.zeros_like(units, dtype=torch.bool)
    protected[0, 0] = True
    # Budget 7 ends 4 tokens into word 2: word 3 fits first but leaves a place no word fills; words 4 and 5 fill 4.
    assert select_tokens(scores, protected, 7, units)[0].tolist() == [0, 1, 2, 11, 12, 13, 14]
    # Budget 14 ends one token into word 5, the last: nothing later fills its place, so the cut stays (the word's
    # later token kept), and word 1 of two tokens ranked before it is not given up to complete it.
    assert select_tokens(scores, protected, 14, units)[0].tolist() == [*range(13), 14]
    # A number ranked first (word 1 of one token here, as InfoKV's numbers "everywhere" lift it) stays the same way.
    number_first = torch.tensor([[0, 1, 2, 2, 3, 3, 4, 4, 5]])
    lifted = torch.tensor([0.0, 9, 0.9, 0.5, 0.4, 0.0])[number_first]
    protected_ends = torch.tensor([[True, False, False, False, False, False, False, False, True]])
    assert select_tokens(lifted, protected_ends, 4, number_first)[0].tolist() == [0, 1, 3, 8]


@pytest.mark.parametrize(("keep", "chunk_size"), [(0.3, 4096), (0.5, 4096), (0.3, 320)])
def test_ingestion_keeps_every_number_whole_or_not_at_all(
    random_engine: InfoKVEngine, keep: float, chunk_size: int
) -> None:
    """Every word outside the sinks and the window, in every (layer, KV head) (a layer at its smallest budget holds
    no more than those, so a word across their edge may keep only its protected part there). Read in chunks too:
    each compression but the last protects the word its window's edge runs through whole (it kept the word's tail,
    protected, and evicted its head)."""
    text = " ".join(
        f"Item {i} costs {i * 37 % 1000},{i * 13 % 1000:03d} EUR on 2024-0{i % 9 + 1}-1{i % 10}." for i in range(30)
    )
    ids = torch.tensor(random_engine.prompt.document_ids(text))
    words = torch.cumsum(random_engine.word_starts[ids].long(), 0)
    sizes = torch.bincount(words)
    for numbers in ("scored", "everywhere"):
        config = CompressionConfig(method="infokv", keep=keep, chunk_size=chunk_size, settings={"numbers": numbers})
        cache = random_engine.ingest_text(text, config).cache
        edge = words[[cache.sink_tokens - 1, len(ids) - config.window]]
        for layer in range(len(cache.lengths)):
            for positions in cache.kept_positions(layer):
                held = torch.zeros(len(sizes), dtype=torch.long).index_add_(
                    0, words[positions], torch.ones_like(positions)
                )
                split = ((held > 0) & (held < sizes)).nonzero().flatten()
                assert set(split.tolist()) <= set(edge.tolist()), (numbers, layer, split)


def test_a_chunk_edge_protects_a_word_whole_but_not_a_long_run(random_engine: InfoKVEngine) -> None:
    """Before the last compression the window reaches back to the start of the word its edge runs through, by at
    most the window's length again (deep inside a URL or an encoded blob, protecting the whole of it took the
    budget's places from every scored token before it), and not where the method keeps tokens, not words; the last
    compression keeps its window."""
    blob = "".join(f"{i * 7919 % 65536:04x}" for i in range(200))  # 800 characters, no space
    text = " ".join(f"Item {i} costs 96165974 EUR." for i in range(20)) + f" {blob} " + "The end. " * 20
    ids = torch.tensor(random_engine.prompt.document_ids(text))
    words = torch.cumsum(random_engine.word_starts[ids].long(), 0)
    ingestion = Ingestion(random_engine, CompressionConfig(keep=0.9), ids)
    window = ingestion.config.window
    starts = [p for p in range(1, len(ids)) if int(words[p]) != int(words[p - 1])]
    sizes = {int(words[p]): int((words == words[p]).sum()) for p in starts}
    number = next(p for p in starts if 2 <= sizes[int(words[p])] <= window and p > 100)  # a word of a few tokens
    inside = number + 1  # the edge one token into that word
    assert ingestion.protected_window(inside + window, False, True) == window + 1
    assert ingestion.protected_window(inside + window, True, True) == window
    assert ingestion.protected_window(inside + window, False, False) == window
    longest = max(starts, key=lambda p: sizes[int(words[p])])
    assert sizes[int(words[longest])] > 2 * window  # the blob
    # Its first tokens are protected as the word's (a few more places); deep inside, none more than the window.
    assert ingestion.protected_window(longest + 5 + window, False, True) == window + 5
    assert ingestion.protected_window(longest + 2 * window + window, False, True) == window


@pytest.mark.parametrize("units", ["clause", "sentence"])
def test_clause_and_sentence_units_rank_by_the_resident_mean(units: str) -> None:
    signals = synthetic_signals(SIGNALS)
    by_token = scorer_of("infokv", units="token").score(signals)
    by_unit = scorer_of("infokv", units=units).score(signals)
    index = (signals.clauses if units == "clause" else signals.sentences)[signals.positions]
    for head in range(KV_HEADS):
        for unit in index[head].unique():
            members = index[head] == unit
            expected = by_token[head, members].mean()
            assert torch.allclose(by_unit[head, members], expected.expand(int(members.sum())))
    assert not torch.equal(by_unit, by_token)


def test_value_weighting_scales_scores_by_relative_value_norms() -> None:
    signals = synthetic_signals(SIGNALS)
    norms = signals.values.float().norm(dim=-1)
    relative = signals.relative_value_norms
    assert torch.allclose(relative, norms / norms.mean(dim=1, keepdim=True))
    plain = scorer_of("infokv", units="token")
    weighted = scorer_of("infokv", units="token", value_weighting=True)
    assert torch.allclose(weighted.score(signals), plain.score(signals) * relative)
    assert torch.allclose(weighted.comparable_scores(signals), plain.comparable_scores(signals) * relative)
    # With word units a word keeps its best score and its largest value norm, so it stays whole.
    by_word = scorer_of("infokv", value_weighting=True).score(signals)
    words = signals.words[signals.positions]
    best = scorer_of("infokv").score(signals)
    for head in range(KV_HEADS):
        for word in words[head].unique():
            members = words[head] == word
            expected = best[head, members][0] * relative[head, members].max()
            assert torch.allclose(by_word[head, members], expected.expand(int(members.sum())))


def test_numbers_rank_first_within_a_head_and_everywhere_also_in_the_budgets() -> None:
    signals = synthetic_signals(SIGNALS)
    words = signals.words[signals.positions]
    numeric_words = signals.words[signals.numerals].unique()
    numbers = torch.isin(words, numeric_words)
    assert torch.equal(signals.number_words, numbers)
    assert 0 < int(numbers.sum()) < numbers.numel()
    scored = scorer_of("infokv", numbers="scored")
    first = scorer_of("infokv", numbers="first")
    everywhere = scorer_of("infokv", numbers="everywhere")
    plain = scored.score(signals)
    lifted = first.score(signals)
    for head in range(KV_HEADS):
        assert lifted[head, numbers[head]].min() > lifted[head, ~numbers[head]].max()
        # Each group keeps its own order.
        for group in (numbers[head], ~numbers[head]):
            assert torch.equal(lifted[head, group].argsort(stable=True), plain[head, group].argsort(stable=True))
    assert torch.equal(everywhere.score(signals), lifted)
    assert torch.equal(first.comparable_scores(signals), scored.comparable_scores(signals))
    budgets = everywhere.comparable_scores(signals)
    assert torch.isinf(budgets[numbers]).all()
    assert torch.equal(budgets[~numbers], scored.comparable_scores(signals)[~numbers])


@pytest.mark.parametrize("name", ["infokv", "infokv_quality"])
@pytest.mark.parametrize(
    ("keep", "resolved"), [(0.25, "scored"), (0.49, "scored"), (0.5, "everywhere"), (0.9, "everywhere")]
)
def test_default_numbers_go_everywhere_from_half_the_cache(name: str, keep: float, resolved: str) -> None:
    signals = synthetic_signals(SIGNALS, keep=keep)
    default, explicit = scorer_of(name), scorer_of(name, numbers=resolved)
    assert isinstance(default, InfoKVScorer) and default.numbers(signals) == resolved
    assert torch.equal(default.score(signals), explicit.score(signals))
    assert torch.equal(default.comparable_scores(signals), explicit.comparable_scores(signals))


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("infokv", {"value_weighting": "false"}),  # a truthy string would turn it on
        ("infokv", {"accumulated_attention": "no"}),
        ("snapkv", {"pooling_kernel": 5.0}),
        ("infokv", {"entropy_top_k": 20.0, "information": "entropy"}),
        ("infokv", {"entropy_vocabulary": 100.5}),
        ("infokv", {"entropy_vocabulary": True}),
        ("infokv", {"tau": "0.5"}),
        ("infokv", {"layer_floor": None}),
        ("kvzip", {"layer_floor": False}),
    ],
)
def test_settings_are_checked_against_their_types_on_construction(name: str, settings: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=f"^{next(iter(settings))} must be "):
        CompressionConfig(method=name, settings=settings)


def test_a_float_setting_takes_an_int_and_an_optional_one_takes_none() -> None:
    assert CompressionConfig(settings={"tau": 1, "lam": 0.7, "layer_floor": 0}).settings == CompressionConfig().settings
    assert matches(None, int | None) and matches(3, int | None) and not matches(3.0, int | None)
    assert described(int | None) == "a whole number or None"


def test_random_takes_any_64_bit_seed_and_draws_as_before_for_small_ones() -> None:
    scorer = scorer_of("random")
    for seed in (2**40, 2**62, -(2**63)):
        assert scorer.score(synthetic_signals(frozenset(), seed=seed)).shape == (KV_HEADS, 70)
    # The seed torch took before folding (it reads a negative one modulo 2**64): the same draws.
    before = torch.Generator().manual_seed(-3 * 1_000_003 + 1 * 7919 + TOKENS_READ)
    expected = torch.rand((KV_HEADS, 70), generator=before)
    assert torch.equal(scorer.score(synthetic_signals(frozenset(), seed=-3)), expected)
    with pytest.raises(ConfigError, match="seed must fit in a signed 64-bit integer"):
        CompressionConfig(method="random", seed=2**63)


@pytest.mark.parametrize(
    ("name", "settings", "unread"),
    [
        ("infokv", {"pooling_kernel": 31}, "pooling_kernel"),  # the predicted attention is not pooled
        ("infokv", {"head_reduction": "max"}, "head_reduction"),  # nor reduced over a group's query heads
        ("infokv", {"evolution": "mean"}, "evolution"),  # tau=1: no evolution term
        ("infokv", {"entropy_top_k": 1}, "entropy_top_k"),  # surprisal
        ("infokv", {"lam": 1.0, "tau": 0.5}, "tau"),
        ("infokv", {"lam": 1.0, "aggregation": "sentence"}, "aggregation"),
        ("infokv", {"lam": 0.0, "accumulated_attention": True}, "accumulated_attention"),
        ("infokv", {"lam": 0.0, "layer_budgets": "uniform", "attention": "reconstruction"}, "attention"),
        ("infokv", {"layer_budgets": "uniform", "layer_floor": 0.5}, "layer_floor"),
        ("kvzip", {"layer_budgets": "uniform", "layer_floor": 0.5}, "layer_floor"),
        ("infokv_information", {"accumulated_attention": True}, "accumulated_attention"),
        ("infokv_information", {"pooling_kernel": 31}, "pooling_kernel"),
        ("infokv_evolution", {"information": "entropy"}, "information"),
        ("infokv_evolution", {"attribution": "outgoing"}, "attribution"),
    ],
)
def test_a_setting_the_configuration_never_reads_is_refused(name: str, settings: dict[str, Any], unread: str) -> None:
    with pytest.raises(ConfigError, match=f"method '{name}' never reads {unread}="):
        CompressionConfig(method=name, settings=settings)


@pytest.mark.parametrize(
    "settings",
    [
        {"attention": "window", "layer_budgets": "uniform", "pooling_kernel": 3, "head_reduction": "max"},
        {"information": "entropy", "entropy_top_k": 5},
        {"tau": 0.75, "evolution": "mean"},
        {"lam": 0.0, "layer_budgets": "global"},  # the attention still sets the layers' budgets
    ],
)
def test_settings_the_configuration_reads_are_accepted(settings: dict[str, Any]) -> None:
    assert CompressionConfig(method="infokv", settings=settings).settings != CompressionConfig().settings


def test_every_published_quality_ablation_is_still_accepted() -> None:
    from benchmarks.quality import ABLATIONS

    for change in ABLATIONS.values():
        CompressionConfig(method="infokv", **change)


@pytest.mark.parametrize(("name", "settings"), [("snapkv", {}), ("infokv", {"attention": "window", "lam": 0.5})])
def test_window_0_is_refused_where_the_window_s_attention_is_read(name: str, settings: dict[str, Any]) -> None:
    window = {"layer_budgets": "uniform"} if name == "infokv" else {}
    with pytest.raises(ConfigError, match="ranks by the observation window.s attention: window must be >= 1"):
        CompressionConfig(method=name, window=0, settings={**settings, **window})
    for other in ("infokv", "tova", "h2o", "knorm", "streaming_llm", "random"):
        assert CompressionConfig(method=other, window=0).window == 0, "no window attention, no window needed"
    with pytest.raises(ValueError, match="needs a window of at least one query"):
        SignalCapture(0, frozenset({WINDOW_ATTENTION}))


def test_rank_normalisation_gives_tied_scores_their_average_rank() -> None:
    """Tied values share the mean of the ranks they span: breaking ties by position would turn a constant signal
    (layer 0's predicted attention gives every occurrence of a token the same value) into recency."""
    scores = torch.tensor([[3.0, 1.0, 1.0, 2.0, 3.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    expected = torch.tensor([[4.0, 0.5, 0.5, 2.0, 4.0, 4.0], [2.5] * 6]) / 5
    torch.testing.assert_close(normalize(scores, "rank"), expected)
    distinct = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(average_ranks(distinct), distinct.argsort(dim=-1).argsort(dim=-1).float())
    one = torch.tensor([[0.3], [0.7]])  # one token per head: rank 0, as minmax gives 0
    assert torch.equal(normalize(one, "rank"), torch.zeros(2, 1)) and torch.equal(normalize(one), torch.zeros(2, 1))


def test_a_nan_score_normalises_lowest_and_leaves_its_head_alone() -> None:
    """A NaN score (a NaN query's attention) is ranked lowest, as selection ranks it: rank normalisation sorted it
    highest (kept first) and minmax turned its whole head to NaN; adaptive budgets failed on it."""
    scores = torch.tensor([[0.1, float("nan"), 0.5, 0.3], [0.2, 0.4, 0.6, 0.8]])
    torch.testing.assert_close(
        normalize(scores, "rank"), torch.tensor([[1.0, 0.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0]]) / 3
    )
    torch.testing.assert_close(normalize(scores), torch.tensor([[0.0, 0.0, 1.0, 0.5], [0.0, 1 / 3, 2 / 3, 1.0]]))
    nothing = torch.full((1, 3), float("nan"))  # as a constant head: tied
    assert torch.equal(normalize(nothing), torch.zeros(1, 3))
    assert torch.equal(normalize(nothing, "rank"), torch.full((1, 3), 0.5))
    budgets = adaptive_budgets([normalize(scores), scores], total=5, minimum=1)
    assert sum(budgets) == 5 and all(1 <= budget <= 4 for budget in budgets)


def test_adaptive_budgets_sum_to_the_total_beside_a_one_token_layer() -> None:
    """A layer of one token has flatness 0: its share was counted as 1 in the numerator and 0 in the sum, so the
    budgets passed the total (11 of 10)."""
    generator = torch.Generator().manual_seed(0)
    one = torch.tensor([[0.7]])
    cases = (
        ([one, torch.rand(1, 25, generator=generator)], 10),
        ([one, one, torch.rand(2, 30, generator=generator)], 12),
    )
    for layers, total in cases:
        budgets = adaptive_budgets(layers, total=total, minimum=0)
        assert sum(budgets) == total and all(b <= layer.shape[1] for b, layer in zip(budgets, layers, strict=True))


def _minmax(x: torch.Tensor) -> torch.Tensor:
    low, high = x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    return (x - low) / (high - low)


@pytest.mark.parametrize("head_reduction", ["mean", "max"])
@pytest.mark.parametrize("evolution", ["per_layer", "mean"])
@pytest.mark.parametrize("attribution", ["incoming", "outgoing"])
@pytest.mark.parametrize("accumulated", [False, True])
def test_infokv_score_is_the_documented_formula_computed_apart(
    head_reduction: str, evolution: str, attribution: str, accumulated: bool
) -> None:
    """s = lam N(A) + (1 - lam)(tau N(E) + (1 - tau) N(R)) (INFOKV.md 1-5), computed apart from the scorer: a
    weight swapped or a setting ignored (head_reduction, evolution, accumulated attention) changed no test."""
    tau, lam = 0.3, 0.4
    settings = dict(
        attention="window",
        layer_budgets="uniform",
        normalization="minmax",
        aggregation="token",
        units="token",
        numbers="scored",
        pooling_kernel=1,
        head_reduction=head_reduction,
        evolution=evolution,
        attribution=attribution,
        accumulated_attention=accumulated,
        tau=tau,
        lam=lam,
    )
    config = CompressionConfig(method="infokv", settings=settings)
    scorer = config.method_spec.build(config.settings)
    s = synthetic_signals(SIGNALS, seed=5)
    # synthetic_signals' mean_evolution is an affine map of evolution: identical after minmax, so draw it apart.
    s = dataclasses.replace(s, mean_evolution=torch.rand(s.tokens_read, generator=torch.Generator().manual_seed(9)))
    assert s.window_attention is not None and s.accumulated_attention is not None and s.information is not None
    assert s.evolution is not None and s.mean_evolution is not None
    grouped = s.window_attention.reshape(KV_HEADS, HEADS // KV_HEADS, -1)
    a = _minmax(grouped.amax(dim=1) if head_reduction == "max" else grouped.mean(dim=1))
    if accumulated:
        a = 0.5 * (a + _minmax(s.accumulated_attention))
    info = s.information
    if attribution == "incoming":
        info = torch.cat([info.new_zeros(1), info[:-1]])
    e = _minmax(info[s.positions])
    r = _minmax((s.evolution if evolution == "per_layer" else s.mean_evolution)[s.positions])
    expected = lam * a + (1 - lam) * (tau * e + (1 - tau) * r)
    torch.testing.assert_close(scorer.score(s), expected)


def test_a_budget_below_the_protected_count_keeps_the_most_recent_protected_tokens() -> None:
    """select_tokens' docstring: 'A budget below the protected count keeps the protected tokens with the highest
    positions (the most recent window) first.'"""
    positions = torch.arange(64).expand(2, -1)
    protected = protected_mask(positions, tokens_read=64, sink_tokens=4, window=16)
    scores = torch.rand(2, 64, generator=torch.Generator().manual_seed(0))
    kept = select_tokens(scores, protected, budget=10)
    assert kept.tolist() == [list(range(54, 64))] * 2


def test_a_nan_score_is_ranked_lowest_by_selection() -> None:
    """normalize's docstring: 'A NaN score (a NaN query's attention) is the lowest, as selection ranks it'
    (h2o, snapkv and tova hand raw attention to selection)."""
    scores = torch.tensor([[0.1, float("nan"), 0.5, 0.3], [float("nan"), 0.4, 0.6, 0.8]])
    kept = select_tokens(scores, torch.zeros(2, 4, dtype=torch.bool), budget=3)
    assert kept.tolist() == [[0, 2, 3], [1, 2, 3]]


def test_adaptive_budgets_give_more_to_the_flatter_layer() -> None:
    """INFOKV.md 7 / adaptive_budgets' docstring: more tokens where the score distribution is flat."""
    generator = torch.Generator().manual_seed(0)
    flat = 0.9 + 0.1 * torch.rand(2, 100, generator=generator)
    peaked = torch.rand(2, 100, generator=generator) ** 8
    budgets = adaptive_budgets([peaked, flat], total=100, minimum=10)
    assert sum(budgets) == 100 and budgets[1] > budgets[0]
