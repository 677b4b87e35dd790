"""infokv_evolution: an ablation, InfoKV's layer-change signal R alone (tau = 0, lam = 0)."""

from __future__ import annotations

from .base import Method
from .infokv import WHOLE_WORDS_REVISION, InfoKVScorer, InfoKVSignalSettings


def _scorer(settings: InfoKVSignalSettings) -> InfoKVScorer:
    return InfoKVScorer(settings.weighted(tau=0.0, lam=0.0))


METHOD = Method(
    "infokv_evolution",
    InfoKVSignalSettings,
    _scorer,
    "ablation: InfoKV's layer-change signal R alone",
    revision=WHOLE_WORDS_REVISION,
)
