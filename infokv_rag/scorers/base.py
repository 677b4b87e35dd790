"""What a method module declares (`Method`, its `Scorer`) and the small tensor helpers scorers share."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, Literal, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..config import MethodSettings
from ..errors import ConfigError
from ..signals import SIGNALS, WINDOW_ATTENTION, LayerSignals

S = TypeVar("S", bound=MethodSettings)


@dataclass(frozen=True)
class NoSettings(MethodSettings):
    """The settings of a method that has none of its own."""


class Scorer(Generic[S]):
    """One compression method's ranking: `score()` ranks one layer's resident tokens; higher is kept.

    Scorers see only `LayerSignals`; protected tokens (sinks, observation window), budgets and cache
    surgery are handled once, in `selection` and the ingestion.
    """

    signals: frozenset[str] = frozenset()
    """Names of the signals `score` reads (`infokv_rag.signals`); ingestion produces only these."""

    def __init__(self, settings: S) -> None:
        self.settings = settings

    def score(self, signals: LayerSignals) -> Tensor:
        """Returns (kv_heads, length) scores for the resident tokens of one layer."""
        raise NotImplementedError

    def whole_units(self, signals: LayerSignals) -> Tensor | None:
        """(kv_heads, length) the unit of each resident token where this method keeps a unit whole or not at all
        (its scores tie within the unit, and the budget must not cut one); None: every token stands alone."""
        return None

    def comparable_scores(self, signals: LayerSignals) -> Tensor:
        """(kv_heads, length) scores on one scale for every layer, for `layer_budgets="global"`.

        Only methods whose settings derive from `LayerBudgetSettings` are asked, and only when global.
        """
        raise NotImplementedError(f"{type(self).__name__} has no scores comparable across layers")

    def unread_settings(self) -> frozenset[str]:
        """Names of the settings this configuration never reads, so that their values change nothing."""
        return self.settings.unread()


@dataclass(frozen=True)
class Method(Generic[S]):
    """A compression method as its module declares it."""

    name: str
    settings: type[S]
    scorer: Callable[[S], Scorer[Any]]
    summary: str
    """How it scores a token, in one line (the README's table of methods repeats it)."""
    compresses: bool = True
    """False for the uncompressed baseline: its budget is the whole document."""
    revision: int = 1
    """Raised when what the method keeps for the same settings changes (a fix of its selection): a cache store
    (`infokv_rag.store.CacheStore`) keys its entries by it, so that it reads a document again rather than serve a
    cache made before the change. Revision 1 adds nothing to the key (caches stored before revisions existed)."""

    @property
    def setting_names(self) -> tuple[str, ...]:
        """The fields of the method's settings class, in declaration order."""
        return tuple(item.name for item in fields(self.settings))

    def settings_from(self, given: MethodSettings | Mapping[str, Any]) -> S:
        """The method's settings from an instance of its settings class or a mapping of changed fields."""
        # The exact class: another method's settings may subclass this one's (the quality mode's InfoKV's) and
        # would pass as them while meaning that method.
        if type(given) is self.settings:
            return given
        if isinstance(given, MethodSettings):
            raise ConfigError(f"method {self.name!r} takes {self.settings.__name__}, not {type(given).__name__}")
        named = [key for key in given if not isinstance(key, str)]
        if named:
            raise ConfigError(f"method {self.name!r} takes settings by name (a string), not {named[0]!r}")
        unknown = sorted(set(given) - set(self.setting_names))
        if unknown:
            takes = ", ".join(self.setting_names) or "no settings"
            raise ConfigError(f"method {self.name!r} has no setting {', '.join(unknown)}; it takes {takes}")
        return self.settings(**given)

    def build(self, settings: MethodSettings | Mapping[str, Any], window: int | None = None) -> Scorer[Any]:
        """The method's scorer for `settings`. Refuses (`ConfigError`) a setting given a value other than its
        default that the scorer never reads (it would change nothing), and, when the config's observation
        `window` is given, a window of 0 for a scorer that reads its attention (`queries[:, -0:]` is every query)."""
        own = self.settings_from(settings)
        scorer = self.scorer(own)
        unknown = scorer.signals - SIGNALS
        if unknown:
            raise ConfigError(f"method {self.name!r} needs signals nobody produces: {sorted(unknown)}")
        defaults, unread = self.settings(), scorer.unread_settings()
        ignored = [
            name for name in self.setting_names if name in unread and getattr(own, name) != getattr(defaults, name)
        ]
        if ignored:
            given = ", ".join(f"{name}={getattr(own, name)!r}" for name in ignored)
            raise ConfigError(
                f"method {self.name!r} never reads {given} with the other settings given (each setting says when "
                "it is read): leave it at its default"
            )
        if window == 0 and WINDOW_ATTENTION in scorer.signals:
            raise ConfigError(f"method {self.name!r} ranks by the observation window's attention: window must be >= 1")
        return scorer


def check_pooling_kernel(kernel: int) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise ConfigError(f"pooling_kernel must be a positive odd number, got {kernel}")


def normalize(scores: Tensor, mode: Literal["minmax", "rank"] = "minmax") -> Tensor:
    """Normalises (kv_heads, length) scores to [0, 1] within each head ("rank": tied values share their
    average rank). A NaN score (a NaN query's attention) is the lowest, as selection ranks it, without touching the
    rest of its head: minmax gives it 0, "rank" the lowest rank (NaNs tie among themselves)."""
    scores = scores.float()
    missing = scores.isnan()
    if mode == "rank":
        return average_ranks(scores.masked_fill(missing, float("-inf"))) / max(scores.shape[-1] - 1, 1)
    low = scores.masked_fill(missing, float("inf")).amin(dim=-1, keepdim=True)
    span = scores.masked_fill(missing, float("-inf")).amax(dim=-1, keepdim=True) - low
    return ((scores - low) / span.clamp_min(1e-12)).masked_fill_(missing, 0.0)


def average_ranks(scores: Tensor) -> Tensor:
    """(rows, length) -> (rows, length) float ranks 0 .. length - 1 within each row, tied values sharing the mean
    of the ranks they span: breaking ties by position would turn a constant signal into recency. Without ties,
    exactly `scores.argsort().argsort()`."""
    values, order = scores.sort(dim=-1)
    index = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    differs = values[..., 1:] != values[..., :-1]
    edge = torch.ones(*values.shape[:-1], 1, dtype=torch.bool, device=values.device)
    first = torch.where(torch.cat([edge, differs], dim=-1), index, 0).cummax(dim=-1).values
    last = torch.where(torch.cat([differs, edge], dim=-1), index, index.shape[-1]).flip(-1).cummin(dim=-1).values
    return torch.empty_like(values).scatter_(-1, order, (first + last.flip(-1)) / 2)


def pool(scores: Tensor, kernel: int) -> Tensor:
    """1-D average pooling along the sequence: (rows, length) -> (rows, length)."""
    if kernel <= 1:
        return scores
    return F.avg_pool1d(scores.unsqueeze(1), kernel, stride=1, padding=kernel // 2, count_include_pad=False).squeeze(1)


def reduce_groups(per_head: Tensor, kv_heads: int, mode: Literal["mean", "max", "sum"] = "mean") -> Tensor:
    """(heads, length) query-head scores -> (kv_heads, length), over the query heads of each KV group."""
    grouped = per_head.reshape(kv_heads, per_head.shape[0] // kv_heads, per_head.shape[-1])
    if mode == "max":
        return grouped.amax(dim=1)
    return grouped.sum(dim=1) if mode == "sum" else grouped.mean(dim=1)


def recency(signals: LayerSignals) -> Tensor:
    """(kv_heads, length) original positions as floats: later is higher."""
    return signals.positions.float()


def seeded_uniform(signals: LayerSignals) -> Tensor:
    """(kv_heads, length) uniform noise, a function of the seed, the layer and the tokens read."""
    # Folded into the generator's unsigned 64-bit seed (a large config seed would overflow it); every value it
    # took before maps to the same seed, for torch reads a negative one modulo 2**64 too.
    combined = signals.seed * 1_000_003 + signals.layer * 7919 + signals.tokens_read
    generator = torch.Generator().manual_seed(combined % 2**64)
    return torch.rand(signals.positions.shape, generator=generator).to(signals.positions.device)
