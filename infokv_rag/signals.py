"""The signals scorers read, by name, and how one prefill chunk captures them.

A scorer declares the names it needs (`Scorer.signals`); ingestion produces only those:
  window_attention       (heads, length) mean attention of the observation window (the last `window`
                         positions read so far) over every resident key
  last_query_attention   (heads, length) the attention of the last position read
  accumulated_attention  (kv_heads, length) attention summed over every document query (H2O)
  information            (tokens_read,) entropy or surprisal per position, from the final hidden states
                         and the LM head (`InformationSettings` says which)
  evolution              (tokens_read,) each layer's relative change of the residual stream R^l
  reconstruction_attention (kv_heads, length) the most attention each resident token received while the
                         model repeated the document back, chunk by chunk (KVzip; `reconstruction.py`):
                         an extra pass over each chunk
  predicted_reconstruction (kv_heads, length) the same, predicted from each layer's input residual stream
                         by the model's fitted linear surrogate (`surrogate.py`): no extra pass
Positions, keys, sentences, words and the seed are always there.

A new signal is a name here, a field of `LayerSignals` and its producer in `ingestion.py` (captured
during the prefill's forward pass like attention, or computed by an extra pass over each chunk);
scorers that do not name it are untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, Protocol

import torch
from torch import Tensor

from .config import MethodSettings
from .errors import ConfigError
from .kernels import accumulated_attention, window_attention

WINDOW_ATTENTION = "window_attention"
LAST_QUERY_ATTENTION = "last_query_attention"
ACCUMULATED_ATTENTION = "accumulated_attention"
INFORMATION = "information"
EVOLUTION = "evolution"
RECONSTRUCTION_ATTENTION = "reconstruction_attention"
PREDICTED_RECONSTRUCTION = "predicted_reconstruction"
SIGNALS = frozenset(
    {
        WINDOW_ATTENTION,
        LAST_QUERY_ATTENTION,
        ACCUMULATED_ATTENTION,
        INFORMATION,
        EVOLUTION,
        RECONSTRUCTION_ATTENTION,
        PREDICTED_RECONSTRUCTION,
    }
)

Information = Literal["entropy", "surprisal"]


@dataclass(frozen=True)
class InformationSettings(MethodSettings):
    """How the information signal is computed: the settings of every method that reads it derive from these.

    Decoding ranks generated tokens for eviction by the same measure.
    """

    information: Information = "surprisal"
    """"entropy", the predictive entropy H(p(. | x_<t)) over the top-k probabilities (INFOKV.md), or
    "surprisal", -log p(x_t | x_<t), the information the token itself carried. Both come from the same
    LM-head pass. Read, like `entropy_vocabulary`, only where the method computes the information signal."""
    entropy_top_k: int = 20
    """The k of the top-k entropy (0: every probability); read only with `information="entropy"`."""
    entropy_vocabulary: int = 16384
    """0: the information signal over the whole vocabulary; N: over the N lowest token ids (BPE's most
    frequent merges) plus every token of the document, a cheaper estimate (on CPU, surprisal over the
    full vocabulary added 16-19% to the default model's prefill at 1K-4K tokens, this subset nothing
    measurable; benchmarks/overhead.py)."""

    def validate(self) -> None:
        super().validate()
        for name in ("entropy_top_k", "entropy_vocabulary"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")

    def unread(self) -> frozenset[str]:
        return super().unread() | ({"entropy_top_k"} if self.information != "entropy" else set())


LayerBudgets = Literal["uniform", "global", "neediest_head", "per_head"]


@dataclass(frozen=True)
class LayerBudgetSettings(MethodSettings):
    """The settings of a method whose scores can be compared across layers, so that layers may differ."""

    layer_budgets: LayerBudgets = "uniform"
    """"uniform": every layer keeps the same number of tokens; "global": one threshold over every
    layer's `Scorer.comparable_scores` decides, so layers whose tokens matter more keep more (KVzip),
    the total staying (layers x budget): a layer keeps the mean over its KV heads of what passes;
    "neediest_head": the same, but a layer keeps what its neediest KV head wants (a layer's heads share one
    length, so the others keep as many of their own best): within one layer one head often wants nearly
    every token and another almost none, and the mean cuts the first to half; "per_head": each (layer, KV
    head) keeps what passes the one threshold (KVzip's head budgets): the layer holds as many per head as its
    least needy head keeps, and the other heads' further tokens are held exactly as its extras
    (`infokv_rag.cache.HeadExtras`). Chunked ingestion's earlier compressions cut layers as "neediest_head"
    does (so each head's tokens are still there), the last one per head. A cold tier holds what no part of
    the hot cache does: a question that recalls reads each head's cold entries and its extras together, every
    entry once, and its answer reads the extras beside the layer and the recalled entries in it
    (`infokv_rag.recall.Recall`)."""
    layer_floor: float = 0.0
    """With layers that differ: every layer (with "per_head", every layer's KV head) keeps at least this share
    of the mean layer budget (the budget of `keep`), the difference taken from the layers above that floor in
    proportion to how far above they are; read only when layers differ (`layer_budgets` not "uniform").
    One threshold leaves a third of the default model's layers at sinks + window on real documents; 0 (off)
    because a 0.5 floor, which kept more dev answers, kept fewer held-out ones (README, "The layer floor on
    held-out documents")."""

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.layer_floor <= 1.0:
            raise ConfigError(f"layer_floor must be in [0, 1], got {self.layer_floor}")

    def unread(self) -> frozenset[str]:
        return super().unread() | ({"layer_floor"} if self.layer_budgets == "uniform" else set())


class ForwardCapture(Protocol):
    """What the model runner feeds during a forward pass."""

    def record_attention(self, layer: int, queries: Tensor, keys: Tensor, scaling: float) -> None:
        """queries: (heads, q, head_dim) of the tokens being run; keys: (kv_heads, resident + q, head_dim)."""

    def record_layer_change(self, layer: int, before: Tensor, after: Tensor) -> None:
        """before, after: (q, hidden) residual stream around one decoder layer."""


ReconstructionPredictor = Callable[[int, Tensor], Tensor]
"""(layer, (q, hidden) residual stream entering it) -> (kv_heads, q) predicted reconstruction importance."""


class SignalCapture:
    """Collects per-layer signals during one chunk's forward pass (fed by the model runner)."""

    def __init__(self, window: int, signals: frozenset[str], predictor: ReconstructionPredictor | None = None) -> None:
        if PREDICTED_RECONSTRUCTION in signals and predictor is None:
            raise ValueError(f"{PREDICTED_RECONSTRUCTION} needs a predictor")
        if WINDOW_ATTENTION in signals and window < 1:
            raise ValueError(f"{WINDOW_ATTENTION} needs a window of at least one query, got {window}")
        self.window = window
        self.signals = signals
        self.predictor = predictor
        self.window_attention: dict[int, Tensor] = {}
        self.last_query_attention: dict[int, Tensor] = {}
        self.accumulated_attention: dict[int, Tensor] = {}
        self.layer_change: dict[int, Tensor] = {}
        self.predicted_reconstruction: dict[int, Tensor] = {}

    def record_attention(self, layer: int, queries: Tensor, keys: Tensor, scaling: float) -> None:
        """queries: (heads, q, head_dim) for this chunk; keys: (kv_heads, resident + q, head_dim)."""
        if WINDOW_ATTENTION in self.signals:
            window = min(self.window, queries.shape[1])
            self.window_attention[layer] = window_attention(queries[:, -window:], keys, scaling)
        if LAST_QUERY_ATTENTION in self.signals:
            self.last_query_attention[layer] = window_attention(queries[:, -1:], keys, scaling)
        if ACCUMULATED_ATTENTION in self.signals:
            self.accumulated_attention[layer] = accumulated_attention(queries, keys, scaling)

    def record_layer_change(self, layer: int, before: Tensor, after: Tensor) -> None:
        """before, after: (q, hidden) residual stream around one decoder layer -> R^l (q,) and the
        predicted reconstruction importance (kv_heads, q)."""
        if self.predictor is not None and PREDICTED_RECONSTRUCTION in self.signals:
            self.predicted_reconstruction[layer] = self.predictor(layer, before)
        if EVOLUTION not in self.signals:
            return
        delta = (after.float() - before.float()).norm(dim=-1)
        self.layer_change[layer] = delta / (before.float().norm(dim=-1) + 1e-6)


@dataclass
class LayerSignals:
    """Everything a scorer may use for one layer's resident tokens; a signal it did not ask for is None.

    positions: (kv_heads, length) original positions of the resident tokens; keys, values: (kv_heads,
    length, head_dim); sentences, clauses, words: (tokens_read,) int64 index of the sentence / clause / word each
    position belongs to (non-decreasing); numerals: (tokens_read,) bool, True where the token's text holds a digit;
    keep: the share of the document's tokens a (layer, KV head) keeps on average (the config's keep ratio, or its
    token count over the document's tokens);
    window_attention, last_query_attention: (heads, length); accumulated_attention,
    reconstruction_attention, predicted_reconstruction: (kv_heads, length);
    information: (tokens_read,) outgoing information per position: the entropy of the distribution at t,
    or the surprisal of token t + 1; evolution: (tokens_read,) this layer's R^l; mean_evolution:
    (tokens_read,) R averaged over layers.
    """

    layer: int
    tokens_read: int
    positions: Tensor
    keys: Tensor
    values: Tensor
    sentences: Tensor
    clauses: Tensor
    words: Tensor
    numerals: Tensor
    keep: float
    window_attention: Tensor | None = None
    last_query_attention: Tensor | None = None
    accumulated_attention: Tensor | None = None
    reconstruction_attention: Tensor | None = None
    predicted_reconstruction: Tensor | None = None
    information: Tensor | None = None
    evolution: Tensor | None = None
    mean_evolution: Tensor | None = None
    seed: int = 0
    kv_heads: int = field(init=False)

    def __post_init__(self) -> None:
        self.kv_heads = int(self.positions.shape[0])

    def at_positions(self, per_position: Tensor) -> Tensor:
        """(tokens_read,) -> (kv_heads, length) values of the resident tokens."""
        return per_position[self.positions]

    def sentence_mean(self, per_position: Tensor) -> Tensor:
        """(tokens_read,) -> (tokens_read,): each position gets the mean over its sentence."""
        count = int(self.sentences[-1]) + 1
        sums = per_position.new_zeros(count).index_add_(0, self.sentences, per_position)
        sizes = torch.bincount(self.sentences, minlength=count).clamp_min(1)
        return (sums / sizes)[self.sentences]

    def word_max(self, scores: Tensor) -> Tensor:
        """(kv_heads, length) -> (kv_heads, length): each resident token gets the best score of the resident
        tokens of its word, so a word (a number, a code) is kept or dropped whole."""
        words = self.words[self.positions]
        best = scores.new_full((self.kv_heads, int(self.words[-1]) + 1), float("-inf"))
        best.scatter_reduce_(1, words, scores, reduce="amax")
        return best.gather(1, words)

    @cached_property
    def number_words(self) -> Tensor:
        """(kv_heads, length) bool: True for the resident tokens of a word that holds a digit ("$7,400", "2373")
        (computed once: both the score and the scores compared across layers read it)."""
        count = int(self.words[-1]) + 1
        digits = self.numerals.new_zeros(count, dtype=torch.long).index_add_(0, self.words, self.numerals.long())
        return (digits > 0)[self.words][self.positions]

    def unit_mean(self, scores: Tensor, units: Tensor) -> Tensor:
        """(kv_heads, length) -> (kv_heads, length): each resident token gets the mean score of the resident
        tokens of its unit (`units`: `sentences` or `clauses`), so a unit ranks, and is kept, as a whole."""
        index = units[self.positions]
        count = int(units[-1]) + 1
        sums = scores.new_zeros(self.kv_heads, count).scatter_add_(1, index, scores)
        sizes = scores.new_zeros(self.kv_heads, count).scatter_add_(1, index, torch.ones_like(scores))
        return (sums / sizes.clamp_min(1)).gather(1, index)

    @cached_property
    def relative_value_norms(self) -> Tensor:
        """(kv_heads, length): each resident token's value norm over its (layer, KV head)'s mean (computed once:
        both the score and the scores compared across layers read it)."""
        norms = self.values.float().norm(dim=-1)
        return norms / norms.mean(dim=1, keepdim=True).clamp_min(1e-12)

    def incoming_information(self) -> Tensor:
        """(tokens_read,): the information of p(. | x_<t) credited to token t (for surprisal, -log p(x_t |
        x_<t)); 0 for the first token."""
        return torch.cat([self._information().new_zeros(1), self._information()[:-1]])

    def outgoing_information(self) -> Tensor:
        """(tokens_read,): the information of p(. | x_<=t) credited to token t."""
        return self._information()

    def _information(self) -> Tensor:
        if self.information is None:
            raise RuntimeError("the information signal was not computed for this compression")
        return self.information
