from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer


@dataclass
class H2OScorer(Scorer):
    """H2O: attention accumulated over every document query (heavy hitters) plus the recent window."""

    needs_window_attention = False
    needs_accumulated_attention = True

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.accumulated_attention is not None
        return signals.accumulated_attention
