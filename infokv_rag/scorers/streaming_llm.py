"""streaming_llm: attention sinks (always protected) plus the most recent tokens."""

from __future__ import annotations

from torch import Tensor

from ..signals import LayerSignals
from .base import Method, NoSettings, Scorer, recency


class StreamingLLMScorer(Scorer[NoSettings]):
    def score(self, signals: LayerSignals) -> Tensor:
        return recency(signals)


METHOD = Method("streaming_llm", NoSettings, StreamingLLMScorer, "recency")
