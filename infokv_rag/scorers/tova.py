from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer, reduce_groups


@dataclass
class TOVAScorer(Scorer):
    """TOVA: the attention of the last document query, averaged over each KV group."""

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.last_query_attention is not None
        return reduce_groups(signals.last_query_attention, signals.kv_heads, "mean")
