"""Compression settings, validated on construction: the shared ones here, each method's own in its module."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from . import scorers
from .errors import ConfigError

if TYPE_CHECKING:
    from .scorers.base import Method

DEFAULT_METHOD = "infokv"
COLD_BITS = (4, 8)
SETTINGS_ADDED: dict[str, Any] = {
    "attention": "window",
    "layer_budgets": "uniform",
    "layer_floor": 0.0,
    "numbers": "scored",
    "units": "token",
    "value_weighting": False,
}
"""Method settings added after their method's caches were first saved, with the value every cache saved before
them was made with (a default may change later, what such a cache holds does not). `CompressionConfig.to_dict`
leaves a setting out at that value and `from_dict` puts it back, so adding a setting changes no saved config
and no store key."""


def check_recall(recall: float | int) -> None:
    """A recall budget is a ratio in [0, 1] of the document's tokens or a token count >= 0."""
    if isinstance(recall, bool) or not isinstance(recall, (int, float)):
        raise ConfigError(f"recall must be a ratio in [0, 1] or a token count, not {recall!r}")
    if isinstance(recall, float) and not 0.0 <= recall <= 1.0:
        raise ConfigError(f"recall ratio must be in [0, 1], got {recall}")
    if isinstance(recall, int) and recall < 0:
        raise ConfigError(f"recall token count must be >= 0, got {recall}")


def parse_ratio_or_count(raw: str | float | int, name: str) -> float | int:
    """`0.25` is a ratio, `512` a token count (as on the command line); `name` is the option's, for errors."""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return raw
    text = str(raw).strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{name} must be a ratio like 0.25 or a token count like 512, not {text!r}") from None


def parse_keep(raw: str, name: str) -> float | int:
    """A keep budget written as text (`parse_ratio_or_count`), refusing `1`: read as a ratio it would keep every
    token, but it is a count of one token, which compresses harder than any ratio (a Python caller tells `1` from
    `1.0`; a command line, a form field or an environment variable, and a JavaScript client writing 1.0, hardly)."""
    keep = parse_ratio_or_count(raw, name)
    if keep == 1 and isinstance(keep, int):
        raise ConfigError(
            f"{name} 1 is a count of one token per layer and KV head, not the whole document: write 1.0 to keep "
            f"every token, or a count above the {ALWAYS_KEPT} and more always kept (the sinks, at least the prompt's "
            "head, and the window)"
        )
    return keep


MOST_TOKENS = 2**31 - 1
"""The largest token count a config may name: far beyond any model's context window."""


def check_count(name: str, value: object, smallest: int | None, largest: int | None = None) -> None:
    """Refuses (`ConfigError`) a `value` that is not a whole number (a bool or a float is not), or is below
    `smallest` or above `largest` (None: any)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, not {value!r}")
    if smallest is not None and value < smallest:
        raise ConfigError(f"{name} must be >= {smallest}, got {value}")
    if largest is not None and value > largest:
        raise ConfigError(f"{name} must be at most {largest:,}, got {value}")


def recall_tokens(recall: float | int, document_tokens: int) -> int:
    """Entries recalled per (layer, KV head) for a `recall` budget (see `check_recall`)."""
    return round(recall * document_tokens) if isinstance(recall, float) else min(recall, document_tokens)


def matches(value: object, hint: Any) -> bool:
    """Whether `value` is of the type annotation `hint`, strictly: only a bool is a bool ("false" would read as
    True), a bool is no int, a float is no int, an int is a float; `X | None` also takes None; a `Literal` takes
    its choices."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, member) for member in typing.get_args(hint))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def described(hint: Any) -> str:
    """What `matches(value, hint)` takes, in words, for an error message."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return f"one of {typing.get_args(hint)}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(described(member) for member in typing.get_args(hint))
    return {bool: "True or False", int: "a whole number", float: "a number", type(None): "None"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


@dataclass(frozen=True)
class MethodSettings:
    """Base of a method's own settings: a frozen dataclass whose fields all have defaults.

    Every field is checked against its annotation on construction (`matches`); a subclass checks anything
    else in `validate`.
    """

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for item in dataclasses.fields(self):
            hint, value = hints[item.name], getattr(self, item.name)
            if not matches(value, hint):
                raise ConfigError(f"{item.name} must be {described(hint)}, got {value!r}")
        self.validate()

    def validate(self) -> None:
        """Raises `ConfigError` for values that the field types do not rule out."""

    def unread(self) -> frozenset[str]:
        """The settings that these values leave unread, whatever the scorer (`Scorer.unread_settings` adds what
        the scorer's configuration leaves unread)."""
        return frozenset()


@dataclass(frozen=True)
class CompressionConfig:
    """How a document's KV cache is compressed.

    `keep` is a float ratio in (0, 1] of the document's tokens or an int token count per (layer, KV head): `1.0`
    keeps every token, `1` one token (raised to the sinks and window that are always kept).
    `settings` are the method's own (`infokv_rag.scorers.<method>`): a mapping of the fields to change,
    e.g. `CompressionConfig(method="infokv", settings={"tau": 0.5})`; once constructed, always an
    instance of the method's settings class, defaults filled in.
    """

    method: str = DEFAULT_METHOD
    keep: float | int = 0.25
    sink_tokens: int = 4
    protect_prompt: bool = True
    """Also keep the chat template's head and the instruction before the document, like sinks."""
    window: int = 32
    """The observation window: the last `window` document tokens, always kept; their attention is a signal."""
    chunk_size: int = 2048
    """Tokens prefilled between compressions (at least `window`); a last remainder shorter than `window` joins the
    chunk before it, so that every compression's observation window holds `window` queries."""
    adaptive_budget: bool = False
    """Redistribute the total budget across layers: more where scores are flat (per-layer lengths differ)."""
    seed: int = 0
    """Seeds the random choices (the `random` method, the summaries' k-means); a signed 64-bit integer."""
    recall: float | int = 0
    """Keep what compression evicts in a cold tier and, per question, recall this much of it: a ratio of the
    document's tokens or a token count per (layer, KV head); 0: no cold tier. Each ask may change it."""
    cold_bits: int | None = None
    """Width of the cold tier's codes: 4 or 8; None: by the model's cache dtype (`cold_tier_bits`)."""
    stored_bits: int | None = None
    """Hold the kept entries in codes of 4 or 8 bits between answers, in memory and on disk
    (`infokv_rag.coded_cache`), each answer decoding them into its working cache; None: at the model's dtype."""
    summaries: int = 16
    """Entries per (layer, KV head) that stand in for the evicted ones (`infokv_rag.summaries`: centroids of
    their keys, weighted by how many each stands for), taken from the keep budget; 0: none."""
    settings: MethodSettings | Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        method = scorers.method(self.method)
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)):
            raise ConfigError(f"keep must be a ratio in (0, 1] or a positive token count, not {self.keep!r}")
        if isinstance(self.keep, float) and not 0.0 < self.keep <= 1.0:
            raise ConfigError(f"keep ratio must be in (0, 1], got {self.keep}")
        if isinstance(self.keep, int) and self.keep < 1:
            raise ConfigError(f"keep token count must be positive, got {self.keep}")
        for name, smallest in (("sink_tokens", 0), ("window", 0), ("chunk_size", 1), ("summaries", 0)):
            # At most MOST_TOKENS: compared with token positions in int64 tensors, a larger count fails mid-ingestion.
            check_count(name, getattr(self, name), smallest, MOST_TOKENS)
        check_count("seed", self.seed, None)
        if not -(2**63) <= self.seed < 2**63:
            # Seeds derived from it (per layer, per summary) must still fit torch's 64-bit generator seed.
            raise ConfigError(f"seed must fit in a signed 64-bit integer, got {self.seed}")
        for name in ("protect_prompt", "adaptive_budget"):
            if not isinstance(getattr(self, name), bool):  # "no" would read as True
                raise ConfigError(f"{name} must be True or False, not {getattr(self, name)!r}")
        check_recall(self.recall)
        if self.recall and not method.compresses:
            # Nothing is evicted, so no answer could ever recall anything: every ask would fail instead.
            raise ConfigError(f"recall needs a method that evicts tokens; {self.method} keeps every token")
        for name in ("cold_bits", "stored_bits"):
            bits = getattr(self, name)
            # Not a float, though 4.0 == 4: the width sizes the codes' tensors, so every answer would fail.
            if bits is not None and not (matches(bits, int) and bits in COLD_BITS):
                raise ConfigError(f"{name} must be one of {COLD_BITS}, got {bits!r}")
        if self.cold_bits is not None and not self.recall:
            # Without a cold tier the width would be dropped unseen: the caller asked for something not done.
            raise ConfigError("cold_bits sets the width of the cold tier's codes; it needs recall > 0")
        if self.chunk_size < max(1, self.window):
            raise ConfigError(f"chunk_size ({self.chunk_size}) must be at least the window ({self.window})")
        if not method.compresses:
            object.__setattr__(self, "summaries", 0)  # nothing is evicted, so nothing to stand in for
        if not isinstance(self.settings, (MethodSettings, Mapping)):
            raise ConfigError(
                f"settings must be a mapping of the settings of method {self.method!r} to change (e.g. "
                f"{{'tau': 0.5}} for infokv) or an instance of its settings class, not {self.settings!r}"
            )
        object.__setattr__(self, "settings", method.settings_from(self.settings))
        method.build(self.settings, self.window)  # refuses settings its scorer never reads, and a missing window
        layer_budgets = getattr(self.settings, "layer_budgets", "uniform")
        if self.adaptive_budget and layer_budgets != "uniform":
            # Budgets over layers (and heads) are then the method's own: adaptive_budget would be ignored.
            raise ConfigError(
                f"adaptive_budget redistributes uniform layer budgets; {self.method} sets them with "
                f"layer_budgets={layer_budgets!r}: pass settings={{'layer_budgets': 'uniform'}} with it, or drop it"
            )

    @property
    def method_spec(self) -> Method[Any]:
        return scorers.method(self.method)

    def budget_for(self, document_tokens: int, sink_tokens: int | None = None) -> int:
        """Tokens kept per (layer, KV head) for a document of `document_tokens` tokens.

        `sink_tokens` is the effective number of protected leading tokens (at least `self.sink_tokens`).
        """
        if not self.method_spec.compresses:
            return document_tokens
        wanted = self._wanted(document_tokens)
        if wanted < document_tokens:
            wanted -= self.summaries_for(document_tokens)  # they take their place in the budget
        protected = max(sink_tokens or 0, self.sink_tokens) + self.window
        return min(document_tokens, max(wanted, protected, 1))

    def summaries_for(self, document_tokens: int) -> int:
        """Summary entries per (layer, KV head) for a document of `document_tokens` tokens: `summaries`, at most the
        budget less one token of the document's own, or the protected tokens' count where that is more (as the
        budget is then). Unbounded, summaries beyond the budget made the cache as large as the full one, each
        evicted entry its own summary; no more than the protected tokens, they leave every budget as it was."""
        return min(self.summaries, max(self._wanted(document_tokens) - 1, self.sink_tokens + self.window))

    def _wanted(self, document_tokens: int) -> int:
        return round(self.keep * document_tokens) if isinstance(self.keep, float) else self.keep

    def keep_ratio(self, document_tokens: int) -> float:
        """The share of a `document_tokens`-token document a (layer, KV head) keeps on average: `keep` itself, or
        its token count over the document's (at most 1)."""
        return self.keep if isinstance(self.keep, float) else min(1.0, self.keep / document_tokens)

    @property
    def heads_differ(self) -> bool:
        """Whether a layer's KV heads may keep different numbers of tokens (`layer_budgets="per_head"`)."""
        return getattr(self.settings, "layer_budgets", None) == "per_head"

    @property
    def keeps_cold_tier(self) -> bool:
        return bool(self.recall)

    def cold_tier_bits(self, cache_element_bytes: int) -> int:
        """The cold tier's code width for a cache of `cache_element_bytes` per element: `cold_bits` if set,
        else 8 for a 32-bit cache and 4 for a narrower one. Either way the hot cache at keep 0.25 plus the
        cold tier stays within half the full cache on disk; 8 bits gave the full cache's verdict on more of
        the held-out questions than 4 bits (README, "Cold tier")."""
        if self.cold_bits is not None:
            return self.cold_bits
        return 8 if cache_element_bytes >= 4 else 4

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the shared fields and `settings`, a dict of the method's settings.

        Without a cold tier its fields are left out, and so are `stored_bits` when None, `summaries` when 0,
        and each of `SETTINGS_ADDED` at the value it stands for: such a config reads as it did before they
        existed (saved caches and their store keys keep their meaning).
        """
        data = dataclasses.asdict(self)
        if not self.recall:
            del data["recall"], data["cold_bits"]
        if not self.summaries:
            del data["summaries"]
        if self.stored_bits is None:
            del data["stored_bits"]
        settings = data["settings"]
        for name, before in SETTINGS_ADDED.items():
            if name in settings and settings[name] == before:
                del settings[name]
        return data

    def cache_identity(self) -> dict[str, Any]:
        """What the compressed cache's bytes depend on: `to_dict` with the recall budget, only each answer's
        default, reduced to whether a cold tier is kept."""
        data = self.to_dict()
        if self.recall:
            data["recall"] = True
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompressionConfig:
        """The config `to_dict` gave; a dict without `summaries` was written before they existed (none), and one
        without a setting of `SETTINGS_ADDED` stands for the value every config had before it."""
        if not isinstance(data, Mapping):  # a list's names would pass as fields, and fail later on `.get`
            raise ConfigError(f"a CompressionConfig is read from a mapping of its fields (to_dict), not {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown CompressionConfig fields: {sorted(unknown)}")
        own = scorers.method(data.get("method", DEFAULT_METHOD)).setting_names
        added = {name: value for name, value in SETTINGS_ADDED.items() if name in own}
        settings = data.get("settings", {})
        if not isinstance(settings, Mapping):  # as the constructor says it, not a bare TypeError from the merge
            raise ConfigError(f"settings must be a mapping of the method's settings, not {settings!r}")
        return cls(**{"summaries": 0, **data, "settings": {**added, **settings}})


ALWAYS_KEPT = CompressionConfig.sink_tokens + CompressionConfig.window
"""Tokens per layer and KV head that every compression keeps by default at least, whatever `keep` says (the sinks
and the window; with `protect_prompt`, the default, the sinks are the prompt's head where it is longer)."""
