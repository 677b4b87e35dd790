from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer, pool, reduce_groups


@dataclass
class SnapKVScorer(Scorer):
    """SnapKV: observation-window attention, pooled along the sequence, averaged over each KV group."""

    pooling_kernel: int = 5

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.window_attention is not None
        return reduce_groups(pool(signals.window_attention, self.pooling_kernel), signals.kv_heads, "mean")
