"""kvzip: context reconstruction (arXiv 2505.23416), the attention each token receives while the model
repeats the document, with one threshold over every (layer, KV head), as KVzip allocates."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import RECONSTRUCTION_ATTENTION, LayerBudgets, LayerBudgetSettings, LayerSignals
from .base import Method, Scorer


@dataclass(frozen=True)
class KVzipSettings(LayerBudgetSettings):
    # KVzip's own allocation (head-level eviction); "global" was the default until 2026-12-03.
    layer_budgets: LayerBudgets = "per_head"


class KVzipScorer(Scorer[KVzipSettings]):
    signals = frozenset({RECONSTRUCTION_ATTENTION})

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.reconstruction_attention is not None
        return signals.reconstruction_attention

    def comparable_scores(self, signals: LayerSignals) -> Tensor:
        return self.score(signals)


METHOD = Method(
    "kvzip",
    KVzipSettings,
    KVzipScorer,
    "the most attention a token receives while the model repeats the document (an extra pass per chunk);"
    ' one threshold over every (layer, KV head) (`layer_budgets`, "per_head")',
)
