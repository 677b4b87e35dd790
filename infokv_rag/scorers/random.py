from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..signals import LayerSignals
from .base import Scorer, seeded_uniform


@dataclass
class RandomScorer(Scorer):
    """Uniformly random scores (seeded): the floor every method must beat."""

    needs_window_attention = False

    def score(self, signals: LayerSignals) -> Tensor:
        return seeded_uniform(signals)
