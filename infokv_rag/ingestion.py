"""Reading one document: chunked prefill, the signals its method needs, scoring and compression.

Per chunk: the forward pass captures attention and layer change (`SignalCapture`), the final hidden
states give the information signal, the surrogate predicts reconstruction importance from each layer's
input (when the method reads it), a reconstruction pass (when the method reads it) scores the chunk's
tokens by how much the model needs them to repeat it, and when the resident cache exceeds the budget
(always after the last chunk) every layer is scored by the method's scorer and cut to its budget. A last
remainder shorter than the observation window joins the chunk before it (`chunk_bounds`). So a layer never
holds more than budget + chunk tokens (a chunk: at most chunk_size + window - 1), and while a reconstruction
pass repeats the chunk, budget + 2 x chunk + the repeat prompt; with global layer budgets the layers together
never hold more than layers times that. What each compression drops is folded
into the layer's summaries (`infokv_rag.summaries`) when the config keeps them. A config that keeps a cold
tier holds every entry until the end, and is compressed once, after the last chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .cache import EvictedSummary, HeadExtras, KVCache, LayerBuffer, ResidentCache, gather_tokens
from .coded_cache import CodedCache
from .cold_tier import ColdTier, HeadEvictions
from .config import CompressionConfig
from .kernels import predictive_entropy, predictive_surprisal
from .reconstruction import reconstruction_attention
from .scorers.base import Scorer, normalize
from .selection import (
    adaptive_budgets,
    global_budgets,
    per_head_budgets,
    protected_mask,
    select_per_head,
    select_tokens,
)
from .signals import (
    EVOLUTION,
    INFORMATION,
    PREDICTED_RECONSTRUCTION,
    RECONSTRUCTION_ATTENTION,
    InformationSettings,
    LayerBudgetSettings,
    LayerSignals,
    SignalCapture,
)
from .summaries import absorb

if TYPE_CHECKING:
    from .engine import InfoKVEngine

ProgressCallback = Callable[[int, int], None]
"""Called with (tokens read, total tokens) after each prefill chunk."""


@dataclass
class DocumentStats:
    """What ingestion measured. Bytes are counted from the stored tensors."""

    document_tokens: int
    kept_tokens_per_layer: list[int]
    cache_bytes: int
    full_cache_bytes: int
    prefill_seconds: float
    scoring_seconds: float
    """Computing the method's signals beyond the prefill (a reconstruction pass among them) and its scores."""
    compression_seconds: float
    method: str
    keep: float | int
    pages: int = 1
    peak_resident_tokens: int = 0
    """Most tokens held over all layers (per KV head) at any time during ingestion."""
    cold_bytes: int = 0
    """Bytes of the cold tier (evicted entries, quantised), when one is kept; `cache_bytes` is the hot cache."""
    mean_kept_tokens: float | None = None
    """Tokens kept over all layers per KV head, unrounded (`ResidentCache.mean_kept_tokens`); None in stats saved
    before it was recorded."""

    @property
    def kept_tokens(self) -> int:
        """Tokens kept over all layers per KV head, rounded once (each of `kept_tokens_per_layer` is rounded)."""
        if self.mean_kept_tokens is None:
            return sum(self.kept_tokens_per_layer)
        return round(self.mean_kept_tokens)

    @property
    def compression_ratio(self) -> float:
        return self.cache_bytes / self.full_cache_bytes if self.full_cache_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kept_tokens": self.kept_tokens, "compression_ratio": self.compression_ratio}


@dataclass
class IngestionResult:
    """What reading one document produced."""

    cache: ResidentCache
    stats: DocumentStats
    information_reference: Tensor | None
    """(n,) the sorted information values of the document tokens, when the method computed them."""
    cold_tier: ColdTier | None
    """The evicted entries, when the config keeps a cold tier."""


def chunk_bounds(tokens: int, chunk_size: int, window: int) -> list[tuple[int, int]]:
    """[start, end) of each prefill chunk of a `tokens`-token document: `chunk_size` tokens each, but a last
    remainder shorter than `window` joins the chunk before it (up to chunk_size + window - 1 tokens). The
    observation window is the last `window` queries of the chunk just read, so every compression then ranks by
    `window` queries; only a document shorter than the window is read with fewer."""
    starts = list(range(0, tokens, chunk_size))
    if len(starts) > 1 and tokens - starts[-1] < window:
        starts.pop()
    return list(zip(starts, [*starts[1:], tokens], strict=True))


def signal_capture(engine: InfoKVEngine, window: int, signals: frozenset[str]) -> SignalCapture:
    """A capture of `signals` for one chunk; the model's reconstruction surrogate when they include it."""
    predictor = engine.reconstruction_surrogate.predict if PREDICTED_RECONSTRUCTION in signals else None
    return SignalCapture(window, signals, predictor)


class Ingestion:
    """One document's chunked prefill, scoring and compression; `run` does it all.

    The steps are public so that a benchmark can prefill once and compress several ways
    (benchmarks/variants.py).
    """

    def __init__(self, engine: InfoKVEngine, config: CompressionConfig, ids: Tensor) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.config = config
        self.ids = ids
        """(n,) the document prefix's token ids."""
        self.n = len(ids)
        self.scorer: Scorer[Any] = config.method_spec.build(config.settings)
        self.sinks = max(config.sink_tokens, engine.prompt.head_tokens if config.protect_prompt else 0)
        self.budget = config.budget_for(self.n, self.sinks)
        self.summary_entries = config.summaries_for(self.n)
        self.keep = config.keep_ratio(self.n)
        self.information: Tensor | None = None
        """(n,) outgoing information per position, when the scorer reads it."""
        if INFORMATION in self.scorer.signals:
            assert isinstance(config.settings, InformationSettings)
            self.information_settings = config.settings
            self.information = torch.zeros(self.n, device=ids.device)
            self.head_rows, self.information_head = self._information_head()
        self.sentences = engine.segments(ids, engine.sentence_marks)
        self.clauses = engine.segments(ids, engine.clause_marks)
        self.words = torch.cumsum(engine.word_starts[ids].long(), 0)
        self.numerals = engine.numerals[ids]
        self.evolution: Tensor | None = None
        """(layers, n) R^l per layer and position, when the scorer reads it."""
        if EVOLUTION in self.scorer.signals:
            self.evolution = torch.zeros(self.runner.num_layers, self.n, device=ids.device)
        self.accumulated: list[Tensor | None] = [None] * self.runner.num_layers
        """Per layer (kv_heads, length) attention summed over every query, aligned with the resident tokens."""
        self.aligned: dict[str, list[Tensor]] = {
            name: [ids.new_empty(self.runner.kv_heads, 0, dtype=torch.float32)] * self.runner.num_layers
            for name in (RECONSTRUCTION_ATTENTION, PREDICTED_RECONSTRUCTION)
            if name in self.scorer.signals
        }
        """Per signal, per layer (kv_heads, length) values aligned with the resident tokens."""
        settings = config.settings
        # A method whose layers cannot differ has the uniform defaults.
        budget_settings = settings if isinstance(settings, LayerBudgetSettings) else LayerBudgetSettings()
        self.layer_budgets = budget_settings.layer_budgets
        self.layer_floor = round(budget_settings.layer_floor * self.budget)
        """Tokens every layer keeps at least when layers differ (`LayerBudgetSettings.layer_floor`)."""
        self.global_budgets = self.layer_budgets != "uniform"
        self.timings = {"prefill": 0.0, "scoring": 0.0, "compression": 0.0}
        self.peak_resident = 0
        self.evicted: list[list[list[HeadEvictions]]] | None = (
            [[[] for _ in range(self.runner.kv_heads)] for _ in range(self.runner.num_layers)]
            if config.keeps_cold_tier
            else None
        )
        """Per layer and KV head, what each compression dropped from that head, when a cold tier is kept."""
        self.summaries: list[EvictedSummary | None] | None = (
            [None] * self.runner.num_layers if config.summaries else None  # 0 for a method that evicts nothing
        )
        """Per layer, the summary of what compressions dropped so far, when the config keeps summaries."""
        self.extras: list[HeadExtras] | None = None
        """Per layer, the tokens some KV heads keep beyond the layer's common length, after a last compression
        with per-head budgets."""

    @torch.inference_mode()
    def run(self, progress: ProgressCallback | None) -> IngestionResult:
        cache = self.runner.new_cache()
        if PREDICTED_RECONSTRUCTION in self.scorer.signals:
            with self.engine.lock:
                # A model's first ingestion fits its surrogate (minutes) before the reading starts, so that the
                # reading's progress, its rate and what is left, count the reading alone.
                _ = self.engine.reconstruction_surrogate
        if progress is not None:  # before the first chunk, which may take minutes on a CPU
            progress(0, self.n)
        for start, end in chunk_bounds(self.n, self.config.chunk_size, self.config.window):
            with self.engine.lock:  # answers about other documents may run between chunks
                capture = signal_capture(self.engine, self.config.window, self.scorer.signals)
                hidden = self.forward_chunk(cache, capture, start, end)
                self.note_peak(cache)  # the chunk is in and nothing of it evicted yet: the most ever held
                self.score_and_compress(cache, capture, hidden, start, end)
            if progress is not None:
                progress(end, self.n)
        return self.finish(cache)

    def note_peak(self, cache: KVCache) -> None:
        held = sum(summary.length for summary in self.summaries or [] if summary is not None)
        self.peak_resident = max(self.peak_resident, cache.resident_tokens + held)

    def finish(self, cache: KVCache) -> IngestionResult:
        summaries = None
        if self.summaries is not None:
            kv_heads, head_dim = self.runner.kv_heads, self.runner.head_dim
            empty = EvictedSummary.empty(kv_heads, head_dim, self.runner.dtype, self.runner.device)
            summaries = [summary if summary is not None else empty for summary in self.summaries]
        frozen = cache.freeze(self.n, self.sinks, summaries, self.extras)
        clock = time.perf_counter()
        cold = None
        if self.evicted is not None:
            for heads, layer in zip(self.evicted, frozen.layers, strict=True):
                for head, pieces in enumerate(heads):
                    if not pieces:  # the head never dropped anything: its cold entries are empty, not missing
                        pieces.append((layer.keys[head, :0], layer.values[head, :0], layer.positions[head, :0]))
            cold = ColdTier.build(self.evicted, self.config.cold_tier_bits(self.runner.dtype.itemsize))
        held: ResidentCache = frozen
        if self.config.stored_bits is not None:
            held = CodedCache.encode(frozen, self.config.stored_bits)
        self.timings["compression"] += time.perf_counter() - clock
        stats = DocumentStats(
            document_tokens=self.n,
            kept_tokens_per_layer=frozen.kept_per_layer,
            cache_bytes=held.nbytes,
            full_cache_bytes=self.n * self.engine.bytes_per_token,
            prefill_seconds=self.timings["prefill"],
            scoring_seconds=self.timings["scoring"],
            compression_seconds=self.timings["compression"],
            method=self.config.method,
            keep=self.config.keep,
            peak_resident_tokens=self.peak_resident,
            cold_bytes=cold.nbytes if cold is not None else 0,
            mean_kept_tokens=frozen.mean_kept_tokens,
        )
        information = self.information.sort().values if self.information is not None else None
        return IngestionResult(held, stats, information, cold)

    def forward_chunk(self, cache: KVCache, capture: SignalCapture, start: int, end: int) -> Tensor:
        """Prefills tokens [start, end) into `cache`; returns their final hidden states (end - start, hidden)."""
        clock = time.perf_counter()
        positions = torch.arange(start, end, device=self.ids.device)
        hidden = self.runner.forward(self.ids[start:end], positions, cache, capture)
        self.timings["prefill"] += time.perf_counter() - clock
        return hidden

    def score_and_compress(
        self,
        cache: KVCache,
        capture: SignalCapture,
        hidden: Tensor,
        start: int,
        end: int,
        information: Tensor | None = None,
    ) -> None:
        """Records the chunk's signals and compresses when over budget (always after the last chunk).

        `information` (end - start,) may be given when it was already computed with these settings.
        """
        clock, compression_before = time.perf_counter(), self.timings["compression"]
        if self.information is not None:
            self.information[start:end] = (
                self.chunk_information(hidden, start, end) if information is None else information
            )
        if self.evolution is not None:
            for layer, change in capture.layer_change.items():
                self.evolution[layer, start:end] = change
        self._accumulate(capture, cache)
        if PREDICTED_RECONSTRUCTION in self.aligned:
            chunk = [capture.predicted_reconstruction[layer] for layer in range(self.runner.num_layers)]
            self._append_aligned(PREDICTED_RECONSTRUCTION, chunk)
        if RECONSTRUCTION_ATTENTION in self.aligned:
            chunk = reconstruction_attention(
                self.runner, self.engine.prompt, cache, self.ids, start, end, self.sinks, self.note_peak
            )
            self._append_aligned(RECONSTRUCTION_ATTENTION, chunk)
        final = end == self.n
        over = (
            sum(cache.lengths) > self.budget * len(cache.lengths)
            if self.global_budgets
            else max(cache.lengths) > self.budget
        )
        # With a cold tier every entry stays in memory until the end anyway, so compressing early would
        # save nothing: later chunks then attend to the whole document, as in the full cache, and
        # recalling every cold entry restores the full cache (up to the codes' precision).
        if final or (over and self.evicted is None):
            self._compress(cache, capture, end, final)
        compression = self.timings["compression"] - compression_before
        self.timings["scoring"] += time.perf_counter() - clock - compression

    def chunk_information(self, hidden: Tensor, start: int, end: int) -> Tensor:
        """(end - start,) outgoing information of positions [start, end) from their final hidden states.

        Entropy of each position's next-token distribution, or the surprisal of the token that follows
        it (0 for the document's last position, which predicts nothing of the document).
        """
        settings = self.information_settings
        if settings.information == "entropy":
            return predictive_entropy(hidden, self.information_head, settings.entropy_top_k)
        following = self.ids[start + 1 : end + 1]
        values = torch.zeros(end - start, device=hidden.device)
        targets = torch.searchsorted(self.head_rows, following)
        values[: len(following)] = predictive_surprisal(hidden[: len(following)], self.information_head, targets)
        return values

    def _information_head(self) -> tuple[Tensor, Tensor]:
        """The vocabulary the information signal is computed over: sorted token ids (rows,) and their
        LM-head rows (rows, hidden). Every document token is among them, so its surprisal is defined."""
        weight = self.runner.lm_head.weight
        size = self.information_settings.entropy_vocabulary
        if not size or size >= weight.shape[0]:
            return torch.arange(weight.shape[0], device=weight.device), weight
        rows = torch.cat([torch.arange(size, device=weight.device), self.ids]).unique()
        return rows, weight[rows]

    def _append_aligned(self, name: str, chunk: list[Tensor]) -> None:
        """Appends one chunk's per-layer (kv_heads, chunk) values after the resident tokens' values."""
        self.aligned[name] = [torch.cat(pair, dim=1) for pair in zip(self.aligned[name], chunk, strict=True)]

    def _accumulate(self, capture: SignalCapture, cache: KVCache) -> None:
        for layer, chunk_sums in capture.accumulated_attention.items():
            per_kv_head = chunk_sums.reshape(self.runner.kv_heads, -1, chunk_sums.shape[-1]).sum(dim=1)
            previous = self.accumulated[layer]
            if previous is not None:
                per_kv_head[:, : previous.shape[1]] += previous
            self.accumulated[layer] = per_kv_head
            assert per_kv_head.shape[1] == cache.layers[layer].length

    def _aligned(self, name: str, layer: int) -> Tensor | None:
        values = self.aligned.get(name)
        return values[layer] if values is not None else None

    def protected_window(self, tokens_read: int, final: bool, whole_words: bool) -> int:
        """How many of the last tokens read a compression protects: `window`, or before the last compression of a
        method that keeps words whole, back to the start of the word the window's edge runs through: its protected
        tail would outlive its evicted head and rank as a word of its own at the next compression ("4." of
        " 96165974."). By at most the window's length again (deep inside a URL or an encoded blob, protecting the
        whole run would take the budget's places from the scored tokens before it), and only where the budget holds
        it beside the sinks."""
        window = self.config.window
        if final or not whole_words:
            return window
        edge = min(max(tokens_read - window, 0), len(self.words) - 1)
        whole = tokens_read - int((self.words[: edge + 1] == self.words[edge]).nonzero()[0])
        return whole if whole <= 2 * window and self.sinks + whole <= self.budget else window

    def _compress(self, cache: KVCache, capture: SignalCapture, tokens_read: int, final: bool) -> None:
        evolution = self.evolution[:, :tokens_read] if self.evolution is not None else None
        mean_evolution = evolution.mean(dim=0) if evolution is not None else None
        scores, comparable, units = [], [], []
        for index, layer in enumerate(cache.layers):
            signals = LayerSignals(
                layer=index,
                tokens_read=tokens_read,
                positions=layer.live("positions"),
                keys=layer.live("keys"),
                values=layer.live("values"),
                sentences=self.sentences[:tokens_read],
                clauses=self.clauses[:tokens_read],
                words=self.words[:tokens_read],
                numerals=self.numerals[:tokens_read],
                keep=self.keep,
                window_attention=capture.window_attention.get(index),
                last_query_attention=capture.last_query_attention.get(index),
                accumulated_attention=self.accumulated[index],
                reconstruction_attention=self._aligned(RECONSTRUCTION_ATTENTION, index),
                predicted_reconstruction=self._aligned(PREDICTED_RECONSTRUCTION, index),
                information=self.information[:tokens_read] if self.information is not None else None,
                evolution=evolution[index] if evolution is not None else None,
                mean_evolution=mean_evolution,
                seed=self.config.seed,
            )
            scores.append(self.scorer.score(signals))
            units.append(self.scorer.whole_units(signals))
            if self.global_budgets:
                comparable.append(self.scorer.comparable_scores(signals))
        clock = time.perf_counter()
        window = self.protected_window(tokens_read, final, units[0] is not None)
        protected = [protected_mask(layer.live("positions"), tokens_read, self.sinks, window) for layer in cache.layers]
        if any(bool(layer_scores.isinf().any()) for layer_scores in comparable):
            # What a scorer counts first in the budgets (+inf: numbers "everywhere") is kept first, and so are the
            # protected tokens: a head's budget counts both, or its protected tokens take the places sized for
            # the rest (a head near its protected floor kept few of its numbers).
            comparable = [
                layer_scores.masked_fill(mask, torch.inf)
                for layer_scores, mask in zip(comparable, protected, strict=True)
            ]
        minimum = min(self.sinks + window, self.budget)
        head_budgets: list[list[int]] | None = None
        if self.config.heads_differ and final:
            head_budgets = per_head_budgets(comparable, self.budget * len(scores), minimum, self.layer_floor)
            budgets = [min(heads) for heads in head_budgets]
            self.extras = []
        elif self.global_budgets:
            # Before the last compression, per-head budgets keep what the neediest head wants: its tokens
            # are all still there when the last one cuts each head to its own.
            neediest = self.layer_budgets in ("neediest_head", "per_head")
            budgets = global_budgets(
                comparable, self.budget * len(scores), minimum, "max" if neediest else "mean", self.layer_floor
            )
        elif self.config.adaptive_budget and self.config.method_spec.compresses:
            normalized = [normalize(s, "minmax") for s in scores]
            budgets = adaptive_budgets(normalized, self.budget * len(scores), minimum)
        else:
            budgets = [self.budget] * len(scores)
        layers = zip(cache.layers, scores, budgets, protected, units, strict=True)
        for index, (layer, layer_scores, budget, layer_protected, layer_units) in enumerate(layers):
            if final:
                layer.live("scores").copy_(normalize(layer_scores, "rank"))
            held_extra: Tensor | None = None
            if head_budgets is not None:
                keep, extra = select_per_head(layer_scores, layer_protected, head_budgets[index], layer_units)
                held_extra = self._hold_extras(layer, keep, extra)
                if keep.shape[1] == layer.length:  # every head keeps every token
                    continue
            elif layer.length <= budget:
                continue
            else:
                keep = select_tokens(layer_scores, layer_protected, budget, layer_units)
            if self.evicted is None and self.summaries is None:
                layer.retain(keep)
            else:
                dropped = layer.evict(keep)
                if self.evicted is not None:
                    # A head's extras stay hot: the cold tier holds what no part of the cache does.
                    for head, pieces in enumerate(self.evicted[index]):
                        cold = slice(None) if held_extra is None else ~held_extra[head]
                        pieces.append((dropped[0][head, cold], dropped[1][head, cold], dropped[2][head, cold]))
                if self.summaries is not None and self.summary_entries:
                    # What a head holds as extras is not evicted from it: it joins no summary.
                    weights = None if held_extra is None else (~held_extra).float()
                    self.summaries[index] = absorb(
                        self.summaries[index], *dropped[:2], self.summary_entries, self.config.seed + index, weights
                    )
            accumulated = self.accumulated[index]
            if accumulated is not None:
                self.accumulated[index] = gather_tokens(accumulated, keep)
            for values in self.aligned.values():
                values[index] = gather_tokens(values[index], keep)
        self.timings["compression"] += time.perf_counter() - clock

    def _hold_extras(self, layer: LayerBuffer, keep: Tensor, extra: list[Tensor]) -> Tensor:
        """Copies each head's tokens `extra[h]` (indices into the layer, beyond the common `keep`) into
        `self.extras`. Returns which of the entries `layer.evict(keep)` drops they are: (kv_heads, length -
        kept) bool, in the order it drops them."""
        assert self.extras is not None
        self.extras.append(
            HeadExtras.gathered(layer.live("keys"), layer.live("values"), layer.live("positions"), extra)
        )
        held = torch.zeros(layer.live("keys").shape[:2], dtype=torch.bool, device=keep.device)
        for head, indices in enumerate(extra):
            held[head, indices] = True
        kept = torch.zeros_like(held).scatter_(1, keep, True)
        return held[~kept].reshape(held.shape[0], -1)
