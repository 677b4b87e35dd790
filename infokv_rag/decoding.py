"""Answering against a compressed document: decoding on a working cache, with decode-time eviction.

The document's cache is never modified: each answer reads its entries in place and decodes on a growable cache
of its own (`ResidentCache.working_cache`). When `GenerationOptions.max_cache_tokens` is set, the lowest-scored
tokens of each layer are evicted before a step would exceed it (never the sinks, the question or the recent
window), from the answer's own copy of the layer; a generated token is scored by where its information falls
among the document's (`information_rank`).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .cache import KVCache
from .config import recall_tokens
from .errors import ConfigError
from .generation import Generation, GenerationOptions, TextAssembler, TokenSampler, Usage, logits_entropy
from .prompt import Turn
from .recall import Recall
from .selection import select_tokens
from .signals import InformationSettings

if TYPE_CHECKING:
    from .document import CompressedDocument


def generate(document: CompressedDocument, turns: Sequence[Turn], options: GenerationOptions) -> Generation:
    """Answers a conversation about `document`; raises before any model work when it cannot fit."""
    engine = document.engine
    suffix = engine.check_question_fits(document.cache.document_tokens, turns, options.max_new_tokens)
    wanted = recall_budget(document, options.recall)
    check_cold_source(document, wanted)
    protected = document.cache.sink_tokens + len(suffix) + document.config.window
    extras = document.cache.beside_tokens(summaries=False)
    budget = wanted
    if options.max_cache_tokens is not None:
        # No more than fits beside what eviction must keep, and the heads' extras, which every answer reads.
        budget = max(0, min(wanted, options.max_cache_tokens - protected - extras - options.eviction_slack))
    # The answer reads the summaries exactly when it recalls nothing (`working_session`), so they count then.
    beside = document.cache.beside_tokens(summaries=not budget)
    summaries = document.cache.beside_tokens() - extras
    # The least cap: room for one recalled entry in place of the summaries, when the answer may recall.
    least = protected + extras + options.eviction_slack + (min(1, summaries) if wanted else summaries)
    # An answer that fits whole under the cap never evicts, whatever eviction would have to keep: what the layers
    # hold (not the document's length: a compressed cache holds less), beside them, recalled, asked and answered.
    held = max(document.cache.lengths, default=0)
    whole = held + beside + budget + len(suffix) + options.max_new_tokens
    if options.max_cache_tokens is not None and options.max_cache_tokens < min(least, whole):
        instead = (
            f"one recalled entry (with no room to recall, the answer reads the {summaries} summaries instead)"
            if wanted
            else f"the summaries ({summaries})"
        )
        raise ConfigError(
            f"max_cache_tokens={options.max_cache_tokens} is too small: per (layer, KV head) an answer keeps the "
            f"sinks, the question ({len(suffix)} tokens) and the recent window ({protected} in all), what the heads "
            f"keep beside their layer's own entries ({extras}: eviction does not cut a head's extras, which per-head "
            f"budgets keep; settings={{'layer_budgets': 'uniform'}} keeps none), {instead} and "
            f"{options.eviction_slack} tokens of eviction slack: at least {least}, or {whole}, where the whole answer "
            "fits"
        )
    usage = Usage(prompt_tokens=len(suffix), cached_tokens=document.cache.document_tokens)
    assembler = TextAssembler(engine.tokenizer, options.stop)
    return Generation(_decode(document, suffix, options, budget, usage, assembler), usage, assembler.ids)


ANSWER_ROOM = 256
"""Answer tokens a working cache has room for before its buffers first grow."""


def recall_budget(document: CompressedDocument, recall: float | int | None) -> int:
    """Cold entries per (layer, KV head) an answer recalls for `recall` (None: the document's default)."""
    tokens = recall_tokens(document.config.recall if recall is None else recall, document.cache.document_tokens)
    if tokens and document.cold_tier is None:
        raise ConfigError(
            "this document has no cold tier to recall from: ingest it with CompressionConfig(recall=...) > 0, "
            "or ask with recall=0"
        )
    return tokens


def check_cold_source(document: CompressedDocument, recall: int) -> None:
    """Refuses (`CacheStoreError`) an answer that would recall from a cold tier changed in place on disk since it
    was verified (`ColdTier.check_source`)."""
    if recall and document.cold_tier is not None:
        document.cold_tier.check_source()


def working_session(document: CompressedDocument, extra_tokens: int, recall: int) -> tuple[KVCache, Recall | None]:
    """A working cache over the document's cache with room for `extra_tokens` and `recall` cold entries per
    layer, and the recall that fills it during the next forward pass (None when nothing is recalled)."""
    cold = document.cold_tier if recall > 0 else None
    # A question that reads the cold tier itself has no use for its summaries (they would count it twice); it
    # still reads the heads' extras beside each layer, which recall then leaves alone.
    session = document.cache.working_cache(extra_tokens + recall, summaries=cold is None)
    return session, None if cold is None else Recall(cold, session, recall)


def _decode(
    document: CompressedDocument,
    suffix: list[int],
    options: GenerationOptions,
    budget: int,
    usage: Usage,
    assembler: TextAssembler,
) -> Generator[str, None, None]:
    engine = document.engine
    runner = engine.runner
    n = document.cache.document_tokens
    started = time.perf_counter()
    with engine.lock:
        # Checked again here, where the cold tier is about to be read: an answer may start long after `generate`
        # (queued by the service), and a map over a file truncated since would kill the process.
        check_cold_source(document, budget)
        # Room for the start of the answer only: the buffers double as it grows, and most answers stop far
        # short of `max_new_tokens` (reserving it all would take that much memory per layer, on a GPU at once).
        answer_room = min(options.max_new_tokens, ANSWER_ROOM)
        session, recall = working_session(document, len(suffix) + answer_room, budget)
    sampler = TokenSampler(options)
    question_end = n + len(suffix)
    pending = torch.tensor(suffix, device=runner.device)
    pending_scores = torch.ones(len(suffix), device=runner.device)
    position = n
    usage.finish_reason = "length"
    for _ in range(options.max_new_tokens):
        with engine.lock:
            incoming = len(pending) + (recall.tokens if recall is not None else 0)
            if options.max_cache_tokens is not None:
                _evict(session, document, options, position, incoming, question_end)
            positions = torch.arange(position, position + len(pending), device=runner.device)
            hidden = runner.forward(pending, positions, session, token_scores=pending_scores, recall=recall)
            if recall is not None:
                # The pass just read the cold tier, after the check above (other answers may have run between): a
                # change in place that landed meanwhile was read too, so it is checked again before anything of the
                # answer is given. (A truncation read through the map kills the process: no check can follow it.)
                check_cold_source(document, budget)
            logits = runner.logits(hidden[-1])
        if recall is not None:
            usage.recalled_tokens, recall = sum(recall.recalled), None
        usage.max_resident_tokens = max(usage.max_resident_tokens, *session.attended)
        usage.peak_cache_bytes = max(usage.peak_cache_bytes, session.nbytes)
        position += len(pending)
        token = sampler(logits.masked_fill(engine.never_sampled, -torch.inf))
        if usage.time_to_first_token is None:
            usage.time_to_first_token = time.perf_counter() - started
        if token in engine.stop_ids:
            usage.finish_reason = "stop"
            break
        usage.completion_tokens += 1
        piece = assembler.push(token)
        if piece:
            yield piece
        if assembler.stopped:
            usage.finish_reason = "stop"
            break
        pending = torch.tensor([token], device=runner.device)
        pending_scores = information_rank(document, logits, token).reshape(1)
    tail = assembler.flush()
    if tail:
        yield tail


@torch.inference_mode()  # the session's buffers may have been (re)made inside a forward pass, as inference tensors
def _evict(
    session: KVCache,
    document: CompressedDocument,
    options: GenerationOptions,
    position: int,
    incoming: int,
    question_end: int,
) -> None:
    """Evicts the lowest-scored tokens of each layer so that `incoming` more fit under the cap, which counts what
    the layer attends beside its own entries (its own: another layer may hold more beside it)."""
    assert options.max_cache_tokens is not None
    if max(session.attended) + incoming <= options.max_cache_tokens:
        return
    for layer, attended in zip(session.layers, session.attended, strict=True):
        cap = options.max_cache_tokens - (attended - layer.total_length)
        target = max(cap - incoming - options.eviction_slack + 1, 0)
        if layer.total_length <= target:
            continue
        layer.materialise()  # eviction cuts the document's entries too: this answer's own copy of them
        positions = layer.live("positions")
        protected = (
            (positions < document.cache.sink_tokens)
            | ((positions >= document.cache.document_tokens) & (positions < question_end))
            | (positions >= position - document.config.window)
        )
        layer.retain(select_tokens(layer.live("scores"), protected, target))


def information_rank(document: CompressedDocument, logits: Tensor, token: int) -> Tensor:
    """Eviction priority of a generated `token` sampled from `logits` (vocab,): where its information
    falls among the document's, a scalar in [0, 1] (0.5 when the method computed none)."""
    reference = document.information_reference
    settings = document.config.settings
    if reference is None or len(reference) == 0 or not isinstance(settings, InformationSettings):
        return torch.full((), 0.5, device=logits.device)
    if settings.information == "surprisal":
        value = -torch.log_softmax(logits.float(), dim=-1)[token].reshape(1)
    else:
        value = logits_entropy(logits.reshape(1, -1), settings.entropy_top_k)
    rank = torch.searchsorted(reference, value.to(reference.device))
    return (rank.float() / len(reference)).reshape(()).to(logits.device)
