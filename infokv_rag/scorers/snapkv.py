"""snapkv: observation-window attention, pooled along the sequence, averaged over each KV group."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..config import MethodSettings
from ..signals import WINDOW_ATTENTION, LayerSignals
from .base import Method, Scorer, check_pooling_kernel, pool, reduce_groups


@dataclass(frozen=True)
class SnapKVSettings(MethodSettings):
    pooling_kernel: int = 5

    def validate(self) -> None:
        check_pooling_kernel(self.pooling_kernel)


class SnapKVScorer(Scorer[SnapKVSettings]):
    signals = frozenset({WINDOW_ATTENTION})

    def score(self, signals: LayerSignals) -> Tensor:
        assert signals.window_attention is not None
        pooled = pool(signals.window_attention, self.settings.pooling_kernel)
        return reduce_groups(pooled, signals.kv_heads, "mean")


METHOD = Method(
    "snapkv",
    SnapKVSettings,
    SnapKVScorer,
    "observation-window attention, pooled (kernel `pooling_kernel`, 5), mean over each KV group",
)
