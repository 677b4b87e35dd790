"""random: uniformly random scores (seeded by `CompressionConfig.seed`), the floor every method must beat."""

from __future__ import annotations

from torch import Tensor

from ..signals import LayerSignals
from .base import Method, NoSettings, Scorer, seeded_uniform


class RandomScorer(Scorer[NoSettings]):
    def score(self, signals: LayerSignals) -> Tensor:
        return seeded_uniform(signals)


METHOD = Method("random", NoSettings, RandomScorer, "seeded uniform")
