"""knorm: keys with a low L2 norm draw more attention, so they are kept."""

from __future__ import annotations

from torch import Tensor

from ..signals import LayerSignals
from .base import Method, NoSettings, Scorer


class KnormScorer(Scorer[NoSettings]):
    def score(self, signals: LayerSignals) -> Tensor:
        return -signals.keys.float().norm(dim=-1)


METHOD = Method("knorm", NoSettings, KnormScorer, "low key norm")
