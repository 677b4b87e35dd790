"""kvzip: context reconstruction (arXiv 2505.23416), the attention each token receives while the model
repeats the document, with one threshold over all layers."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import RECONSTRUCTION_ATTENTION, LayerBudgets, LayerBudgetSettings, LayerSignals
from .base import Method, Scorer


@dataclass(frozen=True)
class KVzipSettings(LayerBudgetSettings):
    layer_budgets: LayerBudgets = "global"


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
    ' one threshold over all layers (`layer_budgets`, "global")',
)
