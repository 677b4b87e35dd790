"""infokv_information: an ablation, InfoKV's information signal E alone (tau = 1, lam = 0)."""

from __future__ import annotations

from .base import Method
from .infokv import WHOLE_WORDS_REVISION, InfoKVScorer, InfoKVSignalSettings


def _scorer(settings: InfoKVSignalSettings) -> InfoKVScorer:
    return InfoKVScorer(settings.weighted(tau=1.0, lam=0.0))


METHOD = Method(
    "infokv_information",
    InfoKVSignalSettings,
    _scorer,
    "ablation: InfoKV's information signal E alone",
    revision=WHOLE_WORDS_REVISION,
)
