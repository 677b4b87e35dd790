"""tova: the attention of the last document query, averaged over each KV group."""

from __future__ import annotations

from torch import Tensor

from ..signals import LAST_QUERY_ATTENTION, LayerSignals
from .base import Method, NoSettings, Scorer, reduce_groups


class TOVAScorer(Scorer[NoSettings]):
    signals = frozenset({LAST_QUERY_ATTENTION})

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.last_query_attention is not None
        return reduce_groups(signals.last_query_attention, signals.kv_heads, "mean")


METHOD = Method("tova", NoSettings, TOVAScorer, "attention of the last document query")
