from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer


@dataclass
class KnormScorer(Scorer):
    """Knorm: keys with a low L2 norm draw more attention, so they are kept."""

    needs_window_attention = False

    def score(self, signals: LayerSignals) -> Tensor:
        return -signals.keys.float().norm(dim=-1)
