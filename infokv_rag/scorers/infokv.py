from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer, normalize, pool, reduce_groups


@dataclass
class InfoKVScorer(Scorer):
    """InfoKV: s = lam * N(A) + (1 - lam) * (tau * N(E) + (1 - tau) * N(R)) within each (layer, KV head).

    E is the information signal, predictive entropy or surprisal (credited to the token it predicted,
    "incoming", or to the token whose distribution it is, "outgoing"); R is the relative change the
    layer makes to the token's residual stream (this layer's, or the mean over layers); A is the pooled
    observation-window attention reduced over each KV group, optionally averaged with attention
    accumulated over all queries.
    """

    needs_information = True

    tau: float = 1.0
    lam: float = 0.25
    attribution: Literal["incoming", "outgoing"] = "incoming"
    evolution: Literal["per_layer", "mean"] = "per_layer"
    normalization: Literal["minmax", "rank"] = "minmax"
    head_reduction: Literal["mean", "max"] = "mean"
    pooling_kernel: int = 5
    accumulated: bool = False
    aggregation: Literal["token", "sentence"] = "sentence"

    def __post_init__(self) -> None:
        self.needs_information = self.tau > 0 and self.lam < 1
        self.needs_window_attention = self.lam > 0
        self.needs_accumulated_attention = self.accumulated

    def attention_term(self, signals: LayerSignals) -> Tensor:
        assert signals.window_attention is not None
        pooled = pool(signals.window_attention, self.pooling_kernel)
        attention = normalize(reduce_groups(pooled, signals.kv_heads, self.head_reduction), self.normalization)
        if self.accumulated:
            assert signals.accumulated_attention is not None
            attention = 0.5 * (attention + normalize(signals.accumulated_attention, self.normalization))
        return attention

    def information_term(self, signals: LayerSignals) -> Tensor:
        """S = tau * N(E) + (1 - tau) * N(R); a signal with weight 0 is not evaluated."""
        term = torch.zeros(signals.positions.shape, device=signals.positions.device)
        if self.tau > 0:
            incoming = self.attribution == "incoming"
            information = signals.incoming_information() if incoming else signals.outgoing_information()
            term += self.tau * normalize(self._resident(signals, information), self.normalization)
        if self.tau < 1:
            evolution = signals.evolution if self.evolution == "per_layer" else signals.mean_evolution
            term += (1 - self.tau) * normalize(self._resident(signals, evolution), self.normalization)
        return term

    def _resident(self, signals: LayerSignals, per_position: Tensor) -> Tensor:
        """(tokens_read,) signal -> (kv_heads, length) for the resident tokens, sentence-averaged if asked."""
        if self.aggregation == "sentence":
            per_position = signals.sentence_mean(per_position)
        return signals.at_positions(per_position)

    def score(self, signals: LayerSignals) -> Tensor:
        if self.lam == 1.0:
            return self.attention_term(signals)
        if self.lam == 0.0:
            return self.information_term(signals)
        return self.lam * self.attention_term(signals) + (1 - self.lam) * self.information_term(signals)
