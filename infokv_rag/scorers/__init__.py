"""One scorer per compression method; `scorer_for(config)` picks and parameterises it."""

from __future__ import annotations

from ..config import CompressionConfig
from .base import Scorer, normalize, pool, reduce_groups
from .full import FullScorer
from .h2o import H2OScorer
from .infokv import InfoKVScorer
from .knorm import KnormScorer
from .random import RandomScorer
from .snapkv import SnapKVScorer
from .streaming_llm import StreamingLLMScorer
from .tova import TOVAScorer

__all__ = [
    "FullScorer",
    "H2OScorer",
    "InfoKVScorer",
    "KnormScorer",
    "RandomScorer",
    "Scorer",
    "SnapKVScorer",
    "StreamingLLMScorer",
    "TOVAScorer",
    "normalize",
    "pool",
    "reduce_groups",
    "scorer_for",
]


def _infokv(config: CompressionConfig, tau: float, lam: float) -> InfoKVScorer:
    return InfoKVScorer(
        tau=tau,
        lam=lam,
        attribution=config.attribution,
        evolution=config.evolution,
        normalization=config.normalization,
        head_reduction=config.head_reduction,
        pooling_kernel=config.pooling_kernel,
        accumulated=config.accumulated_attention,
        aggregation=config.aggregation,
    )


def scorer_for(config: CompressionConfig) -> Scorer:
    """The scorer of `config.method` with its knobs from the config."""
    simple: dict[str, Scorer] = {
        "full": FullScorer(),
        "streaming_llm": StreamingLLMScorer(),
        "snapkv": SnapKVScorer(pooling_kernel=config.pooling_kernel),
        "h2o": H2OScorer(),
        "tova": TOVAScorer(),
        "knorm": KnormScorer(),
        "random": RandomScorer(),
    }
    if config.method in simple:
        return simple[config.method]
    if config.method == "infokv_information":
        return _infokv(config, tau=1.0, lam=0.0)
    if config.method == "infokv_evolution":
        return _infokv(config, tau=0.0, lam=0.0)
    return _infokv(config, tau=config.tau, lam=config.lam)
