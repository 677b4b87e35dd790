from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer, recency


@dataclass
class FullScorer(Scorer):
    """No compression at ingestion (the budget is the whole document); recency orders decode-time eviction."""

    needs_window_attention = False

    def score(self, signals: LayerSignals) -> Tensor:
        return recency(signals)
