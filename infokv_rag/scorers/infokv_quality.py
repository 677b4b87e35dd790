"""infokv_quality: InfoKV's quality mode, the reconstruction attention as A, ranked per token, with one
threshold over every (layer, KV head); a reconstruction pass per chunk more than `infokv`."""

from __future__ import annotations

from dataclasses import dataclass

from ..signals import LayerBudgets
from .base import Method
from .infokv import WHOLE_WORDS_REVISION, Aggregation, Attention, InfoKVScorer, InfoKVSettings, Normalization, Units


@dataclass(frozen=True)
class InfoKVQualitySettings(InfoKVSettings):
    # Chosen on the dev documents of benchmarks/realdocs (README, "Real documents"); `numbers="auto"`, every
    # number in every head from half the cache up, is inherited from `infokv` and was screened for this mode too.
    attention: Attention = "reconstruction"
    layer_budgets: LayerBudgets = "per_head"
    lam: float = 0.7
    normalization: Normalization = "rank"
    aggregation: Aggregation = "token"
    units: Units = "token"


METHOD = Method(
    "infokv_quality",
    InfoKVQualitySettings,
    InfoKVScorer,
    'InfoKV with `attention="reconstruction"`, `lam=0.7`, rank-normalised per token, per-head budgets, '
    "every number in every head from keep 0.5",
    revision=WHOLE_WORDS_REVISION,
)
