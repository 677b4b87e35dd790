"""Decoding options, token sampling, incremental detokenisation with stop strings, and the answer being generated."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .config import check_count, check_recall
from .errors import ConfigError

DEFAULT_MAX_NEW_TOKENS = 256
"""The longest answer decoded when a caller does not say; every document a model reads leaves room for one."""


@dataclass(frozen=True)
class GenerationOptions:
    """How an answer is decoded. Greedy unless `temperature` > 0.

    max_cache_tokens caps the tokens held per (layer, KV head) while answering: past it, the lowest
    scored tokens are evicted (never the sinks, the question or the recent window).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    max_cache_tokens: int | None = None
    eviction_slack: int = 16
    recall: float | int | None = None
    """Cold-tier entries the question may recall per (layer, KV head): a ratio of the document's tokens or
    a count; 0: none; None: the document's `CompressionConfig.recall`."""

    def __post_init__(self) -> None:
        if self.recall is not None:
            check_recall(self.recall)
        check_count("max_new_tokens", self.max_new_tokens, 1)
        check_count("eviction_slack", self.eviction_slack, 1)
        if self.max_cache_tokens is not None:
            check_count("max_cache_tokens", self.max_cache_tokens, 1)
        if self.seed is not None:
            check_count("seed", self.seed, None)
            if not -(2**63) <= self.seed < 2**64:  # a signed or an unsigned 64-bit integer
                raise ConfigError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            # An int past float's range (10**400) is no finite float: isfinite would raise OverflowError on it.
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1e308 < value < 1e308:
                raise ConfigError(f"{name} must be a finite number, not {value!r}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop", stop_sequences(self.stop))

    @classmethod
    def build(cls, stop: str | Sequence[str] | None = None, **options: Any) -> GenerationOptions:
        """The options of a call (`CompressedDocument.stream`): None leaves an option at its default; `stop` is one
        string or a list or tuple of them."""
        return cls(stop=stop_sequences(stop), **{k: v for k, v in options.items() if v is not None})


def stop_sequences(stop: object) -> tuple[str, ...]:
    """`stop` as the tuple of sequences it names: a string is one sequence (not each of its characters), a list or
    tuple holds several, None none; `ConfigError` for anything else (any other iterable would be taken apart: a
    dict into its keys, bytes into ints) and for a sequence that is no non-empty string."""
    if isinstance(stop, str):
        return (stop,)
    if stop is not None and not isinstance(stop, (list, tuple)):
        raise ConfigError(f"stop must be a string or a list of strings, not {type(stop).__name__}")
    stops = tuple(stop or ())
    if any(not isinstance(each, str) or not each for each in stops):
        raise ConfigError(f"stop sequences must be non-empty strings, got {stops!r}")
    return stops


def logits_entropy(logits: Tensor, top_k: int) -> Tensor:
    """(rows, vocab) logits -> (rows,) entropy over the top-k probabilities renormalised (0: all)."""
    logits = logits.float()
    if 0 < top_k < logits.shape[-1]:
        logits = logits.topk(top_k, dim=-1).values
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


class TokenSampler:
    """Greedy or nucleus sampling from float32 logits (vocab,).

    A sampled token is where the distribution's running sum passes a uniform number drawn from the seed and the
    step (blake2b of the two): every bit of a seed counts, where torch's CPU generator reads only its low 32 (seeds
    1 and 2**32 + 1 gave the same answers)."""

    def __init__(self, options: GenerationOptions) -> None:
        self.options = options
        seed = options.seed if options.seed is not None else secrets.randbits(64)
        self._seed = seed.to_bytes(9, "little", signed=True)
        self._step = 0

    def _uniform(self) -> float:
        """The next number of the seed's sequence, in [0, 1) with 53 random bits."""
        step = self._step.to_bytes(8, "little")
        self._step += 1
        return (int.from_bytes(hashlib.blake2b(self._seed + step, digest_size=8).digest(), "little") >> 11) * 2.0**-53

    def __call__(self, logits: Tensor) -> int:
        if self.options.temperature <= 0:
            return int(logits.argmax())
        # Shifted and in float64: a temperature near zero underflows float32 (and softmax turns to NaN);
        # then the most likely token alone is left, as the limit of sampling at temperature 0.
        probs = torch.softmax((logits - logits.max()).double() / self.options.temperature, dim=-1).float()
        if self.options.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs >= self.options.top_p
            # The most likely token always stays: a top_p below float32's range compares as 0.
            outside[0] = False
            sorted_probs[outside] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        running = probs.double().cumsum(0)
        point = torch.tensor([self._uniform() * float(running[-1])], dtype=running.dtype, device=running.device)
        # The first token whose running sum passes the point has a probability above 0, unless rounding put the
        # point at the total: then the last token that has one.
        passed = int(torch.searchsorted(running, point, right=True))
        return min(passed, int((probs > 0).nonzero()[-1]))


@dataclass
class TextAssembler:
    """Turns generated token ids into text pieces, holding back what may still become a stop string."""

    tokenizer: Any
    stop: tuple[str, ...]
    ids: list[int] = field(default_factory=list)
    emitted: int = 0
    stopped: bool = False

    def _held_back(self, text: str) -> int:
        held = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

    def push(self, token_id: int) -> str:
        """Adds a token; returns the new text that is safe to show (may be empty)."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        # A character whose bytes are still arriving reads as U+FFFD: not text yet, so it can neither complete a
        # stop string nor be shown.
        complete = text.rstrip("\ufffd")
        cut = min((complete.find(s) for s in self.stop if s in complete), default=-1)
        if cut >= 0:
            self.stopped = True
            piece, self.emitted = text[self.emitted : cut], cut
            return piece
        if len(complete) < len(text):
            return ""
        safe = len(text) - self._held_back(text)
        piece = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return piece

    def flush(self) -> str:
        """The text held back at the end of generation (no stop string completed)."""
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        piece, self.emitted = text[self.emitted :], len(text)
        return piece


@dataclass
class Usage:
    """Token counts of one answer; `cached_tokens` are document tokens served from the cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    time_to_first_token: float | None = None
    max_resident_tokens: int = 0
    """Most tokens held by any layer (per KV head) while answering, its summaries included."""
    peak_cache_bytes: int = 0
    """Most bytes of keys and values the answer's working cache held of its own over all layers (recalled
    entries, the question and the answer so far, a decode of a cache held in codes, and its log counts beside
    each layer), counted from its live tensors. The document's entries it reads in place are not counted: they
    are the document's (`DocumentStats.cache_bytes`), shared by every answer."""
    recalled_tokens: int = 0
    """Entries the question recalled into the layers, per KV head, summed over layers: cold-tier entries and, once a
    head's cold entries are all in, the head's extras (entries kept beside the layer when heads' budgets differ),
    which the recall budget counts too."""


class Generation:
    """An answer being generated: iterate for text pieces; `usage` is complete once exhausted.

    It is its own iterator (one answer, read once, in whatever steps the caller takes): `text()` gives the whole
    answer whatever was iterated before, as often as it is called. `close()` stops generating and frees the answer's
    working cache at once (an abandoned one frees it when it is collected)."""

    def __init__(self, pieces: Generator[str, None, None], usage: Usage, token_ids: list[int]) -> None:
        self._pieces = pieces
        self._given: list[str] = []
        self.usage = usage
        self.token_ids = token_ids
        """Generated token ids (without the end-of-turn token), filled as the answer is generated."""

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        piece = next(self._pieces)
        self._given.append(piece)
        return piece

    def text(self) -> str:
        """The whole answer: what was iterated already and the rest, generated now."""
        self._given.extend(self._pieces)
        return "".join(self._given)

    def close(self) -> None:
        """Stops generating: `text()` is then what was generated before."""
        self._pieces.close()
