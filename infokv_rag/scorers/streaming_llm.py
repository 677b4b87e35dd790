from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer, recency


@dataclass
class StreamingLLMScorer(Scorer):
    """StreamingLLM: attention sinks (protected) plus the most recent tokens."""

    needs_window_attention = False

    def score(self, signals: LayerSignals) -> Tensor:
        return recency(signals)
