"""Benchmark-only tools: several compressions from one prefill, and teacher-forced logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from infokv_rag import CompressedDocument, CompressionConfig, ConfigError, InfoKVEngine
from infokv_rag.cache import DocumentCache
from infokv_rag.decoding import recall_budget, working_session
from infokv_rag.documents import Document
from infokv_rag.ingestion import Ingestion, signal_capture
from infokv_rag.prompt import Turn
from infokv_rag.scorers.base import Scorer

Rescorer = Callable[[DocumentCache, Scorer[Any]], Scorer[Any]]
"""(the full cache, a config's scorer) -> the scorer to compress with instead."""


@torch.inference_mode()
def compress_variants(
    engine: InfoKVEngine,
    document: Document,
    configs: Sequence[CompressionConfig],
    rescorers: Sequence[Rescorer | None] = (),
) -> list[CompressedDocument]:
    """Compresses one document several ways from a single prefill (for benchmarks and ablations).

    Exact only when the document fits one prefill chunk of every config (then chunking never
    interleaves with compression) and all configs share the observation window. `rescorers[i]`, when
    given and not None, replaces config i's scorer before it scores (benchmarks/selection_oracle.py).
    """
    ids = torch.tensor(engine.prompt.document_ids(document.text), device=engine.runner.device)
    if any(len(ids) > c.chunk_size for c in configs) or len({c.window for c in configs}) > 1:
        raise ConfigError("compress_variants needs a document within one chunk and a common window")
    ingestions = [Ingestion(engine, config, ids) for config in configs]
    reference = Ingestion(engine, CompressionConfig(method="full", window=configs[0].window), ids)
    full = engine.runner.new_cache()
    capture = signal_capture(engine, configs[0].window, frozenset().union(*(i.scorer.signals for i in ingestions)))
    with engine.lock:
        hidden = reference.forward_chunk(full, capture, 0, len(ids))
    full_cache = full.freeze(len(ids), reference.sinks)
    informations: dict[object, Tensor] = {}
    results = []
    for index, (config, ingestion) in enumerate(zip(configs, ingestions, strict=True)):
        rescorer = rescorers[index] if index < len(rescorers) else None
        if rescorer is not None:
            ingestion.scorer = rescorer(full_cache, ingestion.scorer)
        ingestion.timings["prefill"] = reference.timings["prefill"]
        information = None
        if ingestion.information is not None:
            settings = ingestion.information_settings
            key = (settings.information, settings.entropy_top_k, settings.entropy_vocabulary)
            if key not in informations:
                informations[key] = ingestion.chunk_information(hidden, 0, len(ids))
            information = informations[key]
        cache = full_cache.working_cache(0)
        cache.materialise()  # compression changes the layers
        ingestion.score_and_compress(cache, capture, hidden, 0, len(ids), information)
        result = ingestion.finish(cache)
        result.stats.pages = len(document.pages)
        results.append(
            CompressedDocument(
                engine, result.cache, config, document, result.stats, result.information_reference, result.cold_tier
            )
        )
    return results


@torch.inference_mode()
def teacher_forced_logits(document: CompressedDocument, turns: Sequence[Turn], continuation: Sequence[int]) -> Tensor:
    """Next-token logits (len(continuation) + 1, vocab) after the conversation, fed `continuation`.

    Row i is the distribution of continuation token i (the last row, of the token after it). The
    conversation recalls from the cold tier as an answer would (`config.recall`), the continuation does not.
    """
    engine = document.engine
    runner = engine.runner
    suffix = engine.prompt.conversation_ids(turns)
    n = document.cache.document_tokens
    with engine.lock:
        session, recall = working_session(document, len(suffix) + len(continuation), recall_budget(document, None))
        hidden = runner.forward(
            torch.tensor(suffix, device=runner.device),
            torch.arange(n, n + len(suffix), device=runner.device),
            session,
            recall=recall,
        )
        rows = [hidden[-1:]]
        if continuation:
            start = n + len(suffix)
            positions = torch.arange(start, start + len(continuation), device=runner.device)
            rows.append(runner.forward(torch.tensor(list(continuation), device=runner.device), positions, session))
        return runner.logits(torch.cat(rows))
