"""Compression settings, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigError

METHODS = ("infokv", "full", "streaming_llm", "snapkv", "h2o", "tova", "knorm", "random")
"""Every compression method; `infokv_information` and `infokv_evolution` are InfoKV ablations."""

ABLATION_METHODS = ("infokv_information", "infokv_evolution")

Information = Literal["entropy", "surprisal"]
Attribution = Literal["incoming", "outgoing"]
Normalization = Literal["minmax", "rank"]
HeadReduction = Literal["mean", "max"]
EvolutionMode = Literal["per_layer", "mean"]
Aggregation = Literal["token", "sentence"]


@dataclass(frozen=True)
class CompressionConfig:
    """How a document's KV cache is compressed.

    `keep` is a ratio in (0, 1] of the document's tokens or an int token count per (layer, KV head).
    The InfoKV fields follow `INFOKV.md`; each is an ablation knob of the quality benchmark.
    """

    method: str = "infokv"
    keep: float | int = 0.25
    sink_tokens: int = 4
    protect_prompt: bool = True
    """Also keep the chat template's head and the instruction before the document, like sinks."""
    window: int = 32
    chunk_size: int = 2048
    # InfoKV signals
    information: Information = "surprisal"
    """The per-token information signal E: "entropy", the predictive entropy H(p(. | x_<t)) over the
    top-k probabilities (INFOKV.md), or "surprisal", -log p(x_t | x_<t), the information the token
    itself carried. Both come from the same LM-head pass; `attribution` applies to either."""
    entropy_top_k: int = 20
    entropy_vocabulary: int = 16384
    """0: the information signal over the whole vocabulary; N: over the N lowest token ids (BPE's most
    frequent merges) plus every token of the document, a cheaper estimate (on CPU, surprisal over the
    full vocabulary added 16-19% to the default model's prefill at 1K-4K tokens, this subset nothing
    measurable; benchmarks/overhead.py)."""
    attribution: Attribution = "incoming"
    evolution: EvolutionMode = "per_layer"
    # Defaults chosen on the dev split (benchmarks/fact_recall.py, benchmarks/quality.py --ablate).
    tau: float = 1.0
    lam: float = 0.25
    normalization: Normalization = "minmax"
    head_reduction: HeadReduction = "mean"
    pooling_kernel: int = 5
    accumulated_attention: bool = False
    aggregation: Aggregation = "sentence"
    """"sentence": InfoKV's entropy and evolution terms score each token by its sentence's mean,
    so the facts a question needs are kept with their sentence."""
    adaptive_budget: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS + ABLATION_METHODS:
            raise ConfigError(
                f"unknown method {self.method!r}; choose one of {', '.join(METHODS + ABLATION_METHODS)}"
            )
        if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)):
            raise ConfigError(f"keep must be a ratio in (0, 1] or a positive token count, not {self.keep!r}")
        if isinstance(self.keep, float) and not 0.0 < self.keep <= 1.0:
            raise ConfigError(f"keep ratio must be in (0, 1], got {self.keep}")
        if isinstance(self.keep, int) and self.keep < 1:
            raise ConfigError(f"keep token count must be positive, got {self.keep}")
        for name in ("sink_tokens", "window", "entropy_top_k", "entropy_vocabulary"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.chunk_size < max(1, self.window):
            raise ConfigError(f"chunk_size ({self.chunk_size}) must be at least the window ({self.window})")
        for name in ("tau", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        choices: dict[str, tuple[str, ...]] = {
            "information": ("entropy", "surprisal"),
            "attribution": ("incoming", "outgoing"),
            "evolution": ("per_layer", "mean"),
            "normalization": ("minmax", "rank"),
            "head_reduction": ("mean", "max"),
            "aggregation": ("token", "sentence"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.pooling_kernel < 1 or self.pooling_kernel % 2 == 0:
            raise ConfigError(f"pooling_kernel must be a positive odd number, got {self.pooling_kernel}")

    def budget_for(self, document_tokens: int, sink_tokens: int | None = None) -> int:
        """Tokens kept per (layer, KV head) for a document of `document_tokens` tokens.

        `sink_tokens` is the effective number of protected leading tokens (at least `self.sink_tokens`).
        """
        if self.method == "full":
            return document_tokens
        wanted = round(self.keep * document_tokens) if isinstance(self.keep, float) else self.keep
        protected = max(sink_tokens or 0, self.sink_tokens) + self.window
        return min(document_tokens, max(wanted, protected))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompressionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown CompressionConfig fields: {sorted(unknown)}")
        return cls(**data)
