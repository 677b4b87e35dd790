"""full: no compression, the reference every method is measured against."""

from __future__ import annotations

from torch import Tensor

from ..signals import LayerSignals
from .base import Method, NoSettings, Scorer, recency


class FullScorer(Scorer[NoSettings]):
    """No compression at ingestion (the budget is the whole document); recency orders decode-time eviction."""

    def score(self, signals: LayerSignals) -> Tensor:
        return recency(signals)


METHOD = Method("full", NoSettings, FullScorer, "no compression", compresses=False)
