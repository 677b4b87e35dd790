"""h2o: attention accumulated over every document query (heavy hitters) plus the recent window."""

from __future__ import annotations

from torch import Tensor

from ..signals import ACCUMULATED_ATTENTION, LayerSignals
from .base import Method, NoSettings, Scorer


class H2OScorer(Scorer[NoSettings]):
    signals = frozenset({ACCUMULATED_ATTENTION})

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.accumulated_attention is not None
        return signals.accumulated_attention


METHOD = Method("h2o", NoSettings, H2OScorer, "attention accumulated over every document query")
