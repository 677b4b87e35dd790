"""InfoKVEngine (a model ready to read documents) and CompressedDocument (one read document)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .cache import DocumentCache, KVCache, gather_tokens
from .config import CompressionConfig
from .documents import Document, document_from_text, load_document
from .errors import ConfigError, ContextLengthError
from .generation import GenerationOptions, TextAssembler, TokenSampler, logits_entropy
from .kernels import predictive_entropy, predictive_surprisal
from .model_runner import ModelRunner
from .models import model_fingerprint, resolve_model_dir
from .prompt import PromptFormat, Turn, question_turns
from .scorers import Scorer, normalize, scorer_for
from .selection import adaptive_budgets, protected_mask, select_tokens
from .signals import LayerSignals, SignalCapture

ProgressCallback = Callable[[int, int], None]
"""Called with (tokens read, total tokens) after each prefill chunk."""


@dataclass
class DocumentStats:
    """What ingestion measured. Bytes are counted from the stored tensors."""

    document_tokens: int
    kept_tokens_per_layer: list[int]
    cache_bytes: int
    full_cache_bytes: int
    prefill_seconds: float
    scoring_seconds: float
    compression_seconds: float
    method: str
    keep: float | int
    pages: int = 1
    peak_resident_tokens: int = 0
    """Most tokens held over all layers (per KV head) at any time during ingestion."""

    @property
    def kept_tokens(self) -> int:
        return sum(self.kept_tokens_per_layer)

    @property
    def compression_ratio(self) -> float:
        return self.cache_bytes / self.full_cache_bytes if self.full_cache_bytes else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kept_tokens": self.kept_tokens, "compression_ratio": self.compression_ratio}


@dataclass
class Usage:
    """Token counts of one answer; `cached_tokens` are document tokens served from the cache."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    time_to_first_token: float | None = None
    max_resident_tokens: int = 0
    """Most tokens held by any layer (per KV head) while answering."""


class Generation:
    """An answer being generated: iterate for text pieces; `usage` is complete once exhausted."""

    def __init__(self, pieces: Iterator[str], usage: Usage, token_ids: list[int]) -> None:
        self._pieces = pieces
        self.usage = usage
        self.token_ids = token_ids
        """Generated token ids (without the end-of-turn token), filled as the answer is generated."""

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def text(self) -> str:
        return "".join(self._pieces)


class InfoKVEngine:
    """A causal LM that reads documents into compressed caches and answers questions against them."""

    def __init__(self, model: Any, tokenizer: Any, model_dir: Path, name: str) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.name = name
        self.runner = ModelRunner(model)
        self.prompt = PromptFormat(tokenizer)
        self.fingerprint = model_fingerprint(model_dir)
        # One forward pass at a time; separate answers interleave step by step.
        self.lock = threading.RLock()
        self.stop_ids = self._collect_stop_ids()
        """Token ids that end an answer (the model's end-of-turn and end-of-text ids)."""

    @classmethod
    def from_pretrained(
        cls, name_or_path: str = "default", device: str | torch.device | None = None, dtype: torch.dtype | None = None
    ) -> InfoKVEngine:
        """Loads `default`, `tiny`, a local HF directory or a `.gguf` file (converted once, then cached)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = resolve_model_dir(name_or_path)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
        return cls(model, tokenizer, model_dir, name_or_path)

    def _collect_stop_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        return frozenset(ids)

    @functools.cached_property
    def sentence_boundaries(self) -> Tensor:
        """(vocab,) True for tokens that end a sentence or line (their text holds . ; : ! ? or a newline)."""
        size = max(len(self.tokenizer), self.runner.lm_head.weight.shape[0])
        texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
        flags = torch.zeros(size, dtype=torch.bool)
        flags[: len(texts)] = torch.tensor([any(c in text for c in ".;:!?\n") for text in texts])
        return flags.to(self.runner.device)

    @property
    def context_window(self) -> int:
        return self.runner.max_positions

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers and KV heads."""
        runner = self.runner
        element = torch.empty(0, dtype=runner.dtype).element_size()
        return 2 * runner.num_layers * runner.kv_heads * runner.head_dim * element

    # Ingestion -------------------------------------------------------------------------------------

    def ingest(
        self,
        path: str | os.PathLike[str],
        config: CompressionConfig | None = None,
        *,
        password: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> CompressedDocument:
        """Reads a .pdf, .txt or .md file and compresses its cache."""
        return self.ingest_document(load_document(path, password=password), config, progress=progress)

    def ingest_text(
        self, text: str, config: CompressionConfig | None = None, *, progress: ProgressCallback | None = None
    ) -> CompressedDocument:
        return self.ingest_document(document_from_text(text), config, progress=progress)

    def ingest_document(
        self, document: Document, config: CompressionConfig | None = None, *, progress: ProgressCallback | None = None
    ) -> CompressedDocument:
        config = config or CompressionConfig()
        ids = self.prompt.document_ids(document.text)
        reserve = 64
        if len(ids) + reserve > self.context_window:
            raise ContextLengthError(
                f"the document is {len(ids)} tokens but the model's context window is {self.context_window} "
                f"tokens (and questions need room too); split the document or use a model with a longer context"
            )
        cache, stats, information = _Ingestion(self, config, torch.tensor(ids, device=self.runner.device)).run(progress)
        stats.pages = len(document.pages)
        return CompressedDocument(self, cache, config, document, stats, information_reference=information)

    def load(self, directory: str | os.PathLike[str]) -> CompressedDocument:
        """Loads a cache saved with `CompressedDocument.save`; refuses another model's or a damaged one."""
        from .store import load_document as load_saved

        return load_saved(self, directory)

    # Answering -------------------------------------------------------------------------------------

    def generate(self, document: CompressedDocument, turns: Sequence[Turn], options: GenerationOptions) -> Generation:
        """Answers a conversation about `document`; the document's cache is never modified."""
        suffix = self.prompt.conversation_ids(turns)
        n = document.cache.document_tokens
        needed = n + len(suffix) + options.max_new_tokens
        if needed > self.context_window:
            raise ContextLengthError(
                f"the document ({n} tokens) plus the question ({len(suffix)} tokens) plus max_new_tokens "
                f"({options.max_new_tokens}) is {needed} tokens, more than the model's context window of "
                f"{self.context_window}; shorten the question or lower max_new_tokens"
            )
        config = document.config
        protected = document.cache.sink_tokens + len(suffix) + config.window
        if options.max_cache_tokens is not None and options.max_cache_tokens < protected + options.eviction_slack:
            raise ConfigError(
                f"max_cache_tokens={options.max_cache_tokens} is too small: the sinks, the question "
                f"({len(suffix)} tokens) and the recent window need {protected + options.eviction_slack}"
            )
        usage = Usage(prompt_tokens=len(suffix), cached_tokens=n)
        assembler = TextAssembler(self.tokenizer, options.stop)
        return Generation(self._decode(document, suffix, options, usage, assembler), usage, assembler.ids)

    def _decode(
        self,
        document: CompressedDocument,
        suffix: list[int],
        options: GenerationOptions,
        usage: Usage,
        assembler: TextAssembler,
    ) -> Iterator[str]:
        runner = self.runner
        n = document.cache.document_tokens
        started = time.perf_counter()
        with self.lock:
            session = document.cache.working_copy(len(suffix) + options.max_new_tokens)
        sampler = TokenSampler(options, runner.device)
        question_end = n + len(suffix)
        pending = torch.tensor(suffix, device=runner.device)
        pending_scores = torch.ones(len(suffix), device=runner.device)
        position = n
        usage.finish_reason = "length"
        for _ in range(options.max_new_tokens):
            with self.lock:
                if options.max_cache_tokens is not None:
                    self._evict(session, document, options, position, len(pending), question_end)
                positions = torch.arange(position, position + len(pending), device=runner.device)
                hidden = runner.forward(pending, positions, session, token_scores=pending_scores)
                logits = runner.logits(hidden[-1])
            usage.max_resident_tokens = max(usage.max_resident_tokens, *session.lengths)
            position += len(pending)
            token = sampler(logits)
            if usage.time_to_first_token is None:
                usage.time_to_first_token = time.perf_counter() - started
            if token in self.stop_ids:
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
            pending_scores = document.information_rank(logits, token).reshape(1)
        tail = assembler.flush()
        if tail:
            yield tail

    @staticmethod
    def _evict(
        session: KVCache,
        document: CompressedDocument,
        options: GenerationOptions,
        position: int,
        incoming: int,
        question_end: int,
    ) -> None:
        """Evicts the lowest-scored tokens of each layer so that `incoming` more fit under the cap."""
        cap = options.max_cache_tokens
        assert cap is not None
        if max(session.lengths) + incoming <= cap:
            return
        target = max(cap - incoming - options.eviction_slack + 1, 0)
        for layer in session.layers:
            if layer.length <= target:
                continue
            positions = layer.live("positions")
            protected = (
                (positions < document.cache.sink_tokens)
                | ((positions >= document.cache.document_tokens) & (positions < question_end))
                | (positions >= position - document.config.window)
            )
            layer.retain(select_tokens(layer.live("scores"), protected, target))


class _Ingestion:
    """One document's chunked prefill, scoring and compression."""

    def __init__(self, engine: InfoKVEngine, config: CompressionConfig, ids: Tensor) -> None:
        self.engine = engine
        self.runner = engine.runner
        self.config = config
        self.ids = ids
        self.n = len(ids)
        self.scorer: Scorer = scorer_for(config)
        self.sinks = max(config.sink_tokens, engine.prompt.head_tokens if config.protect_prompt else 0)
        self.budget = config.budget_for(self.n, self.sinks)
        self.information = torch.zeros(self.n, device=ids.device) if self.scorer.needs_information else None
        if self.information is not None:
            self.head_rows, self.information_head = self._information_head()
        boundaries = engine.sentence_boundaries[ids]
        self.sentences = torch.cumsum(boundaries.long(), 0) - boundaries.long()
        self.evolution = torch.zeros(self.runner.num_layers, self.n, device=ids.device)
        self.accumulated: list[Tensor | None] = [None] * self.runner.num_layers
        self.timings = {"prefill": 0.0, "scoring": 0.0, "compression": 0.0}
        self.peak_resident = 0

    @torch.inference_mode()
    def run(self, progress: ProgressCallback | None) -> tuple[DocumentCache, DocumentStats, Tensor | None]:
        cache = self.runner.new_cache()
        chunk = self.config.chunk_size
        for start in range(0, self.n, chunk):
            end = min(self.n, start + chunk)
            with self.engine.lock:  # answers about other documents may run between chunks
                self._read_chunk(cache, start, end)
            self.peak_resident = max(self.peak_resident, cache.resident_tokens)
            if progress is not None:
                progress(end, self.n)
        return self.finish(cache)

    def finish(self, cache: KVCache) -> tuple[DocumentCache, DocumentStats, Tensor | None]:
        frozen = cache.freeze(self.n, self.sinks)
        stats = DocumentStats(
            document_tokens=self.n,
            kept_tokens_per_layer=frozen.lengths,
            cache_bytes=frozen.nbytes,
            full_cache_bytes=self.n * self.engine.bytes_per_token,
            prefill_seconds=self.timings["prefill"],
            scoring_seconds=self.timings["scoring"],
            compression_seconds=self.timings["compression"],
            method=self.config.method,
            keep=self.config.keep,
            peak_resident_tokens=self.peak_resident,
        )
        information = self.information.sort().values if self.information is not None else None
        return frozen, stats, information

    def _read_chunk(self, cache: KVCache, start: int, end: int) -> None:
        scorer = self.scorer
        capture = SignalCapture(self.config.window, scorer.needs_window_attention, scorer.needs_accumulated_attention)
        hidden = self.forward_chunk(cache, capture, start, end)
        self.score_and_compress(cache, capture, hidden, start, end)

    def forward_chunk(self, cache: KVCache, capture: SignalCapture, start: int, end: int) -> Tensor:
        """Prefills tokens [start, end) into `cache`; returns their final hidden states (end - start, hidden)."""
        clock = time.perf_counter()
        positions = torch.arange(start, end, device=self.ids.device)
        hidden = self.runner.forward(self.ids[start:end], positions, cache, capture)
        self.timings["prefill"] += time.perf_counter() - clock
        return hidden

    def score_and_compress(
        self, cache: KVCache, capture: SignalCapture, hidden: Tensor, start: int, end: int, information: Tensor | None = None
    ) -> None:
        """Records the chunk's signals and compresses when over budget (always after the last chunk).

        `information` (end - start,) may be given when it was already computed with this config's settings.
        """
        clock, compression_before = time.perf_counter(), self.timings["compression"]
        if self.information is not None:
            self.information[start:end] = self.chunk_information(hidden, start, end) if information is None else information
        for layer, change in capture.layer_change.items():
            self.evolution[layer, start:end] = change
        self._accumulate(capture, cache)
        final = end == self.n
        if final or max(cache.lengths) > self.budget:
            self._compress(cache, capture, end, final)
        compression = self.timings["compression"] - compression_before
        self.timings["scoring"] += time.perf_counter() - clock - compression

    def chunk_information(self, hidden: Tensor, start: int, end: int) -> Tensor:
        """(end - start,) outgoing information of positions [start, end) from their final hidden states.

        Entropy of each position's next-token distribution, or the surprisal of the token that follows
        it (0 for the document's last position, which predicts nothing of the document).
        """
        if self.config.information == "entropy":
            return predictive_entropy(hidden, self.information_head, self.config.entropy_top_k)
        following = self.ids[start + 1 : end + 1]
        values = torch.zeros(end - start, device=hidden.device)
        targets = torch.searchsorted(self.head_rows, following)
        values[: len(following)] = predictive_surprisal(hidden[: len(following)], self.information_head, targets)
        return values

    def _information_head(self) -> tuple[Tensor, Tensor]:
        """The vocabulary the information signal is computed over: sorted token ids (rows,) and their
        LM-head rows (rows, hidden). Every document token is among them, so its surprisal is defined."""
        weight = self.runner.lm_head.weight
        size = self.config.entropy_vocabulary
        if not size or size >= weight.shape[0]:
            return torch.arange(weight.shape[0], device=weight.device), weight
        rows = torch.cat([torch.arange(size, device=weight.device), self.ids]).unique()
        return rows, weight[rows]

    def _accumulate(self, capture: SignalCapture, cache: KVCache) -> None:
        for layer, chunk_sums in capture.accumulated_attention.items():
            per_kv_head = chunk_sums.reshape(self.runner.kv_heads, -1, chunk_sums.shape[-1]).sum(dim=1)
            previous = self.accumulated[layer]
            if previous is not None:
                per_kv_head[:, : previous.shape[1]] += previous
            self.accumulated[layer] = per_kv_head
            assert per_kv_head.shape[1] == cache.layers[layer].length

    def _compress(self, cache: KVCache, capture: SignalCapture, tokens_read: int, final: bool) -> None:
        mean_evolution = self.evolution[:, :tokens_read].mean(dim=0)
        scores = []
        for index, layer in enumerate(cache.layers):
            signals = LayerSignals(
                layer=index,
                tokens_read=tokens_read,
                positions=layer.live("positions"),
                keys=layer.live("keys"),
                window_attention=capture.window_attention.get(index),
                last_query_attention=capture.last_query_attention.get(index),
                accumulated_attention=self.accumulated[index],
                information=self.information[:tokens_read] if self.information is not None else None,
                evolution=self.evolution[index, :tokens_read],
                mean_evolution=mean_evolution,
                sentences=self.sentences[:tokens_read],
                seed=self.config.seed,
            )
            scores.append(self.scorer.score(signals))
        clock = time.perf_counter()
        if self.config.adaptive_budget and self.config.method != "full":
            minimum = min(self.sinks + self.config.window, self.budget)
            normalized = [normalize(s, "minmax") for s in scores]
            budgets = adaptive_budgets(normalized, self.budget * len(scores), minimum)
        else:
            budgets = [self.budget] * len(scores)
        for index, (layer, layer_scores, budget) in enumerate(zip(cache.layers, scores, budgets)):
            if final:
                layer.live("scores").copy_(normalize(layer_scores, "rank"))
            if layer.length <= budget:
                continue
            protected = protected_mask(layer.live("positions"), tokens_read, self.sinks, self.config.window)
            keep = select_tokens(layer_scores, protected, budget)
            layer.retain(keep)
            accumulated = self.accumulated[index]
            if accumulated is not None:
                self.accumulated[index] = gather_tokens(accumulated, keep)
        self.timings["compression"] += time.perf_counter() - clock


@torch.inference_mode()
def compress_variants(
    engine: InfoKVEngine, document: Document, configs: Sequence[CompressionConfig]
) -> list[CompressedDocument]:
    """Compresses one document several ways from a single prefill (for benchmarks and ablations).

    Exact only when the document fits one prefill chunk of every config (then chunking never
    interleaves with compression) and all configs share the observation window.
    """
    ids = torch.tensor(engine.prompt.document_ids(document.text), device=engine.runner.device)
    if any(len(ids) > c.chunk_size for c in configs) or len({c.window for c in configs}) > 1:
        raise ConfigError("compress_variants needs a document within one chunk and a common window")
    reference = _Ingestion(engine, CompressionConfig(method="full", window=configs[0].window), ids)
    full = engine.runner.new_cache()
    scorers = [scorer_for(c) for c in configs]
    capture = SignalCapture(
        configs[0].window,
        any(s.needs_window_attention for s in scorers),
        any(s.needs_accumulated_attention for s in scorers),
    )
    with engine.lock:
        hidden = reference.forward_chunk(full, capture, 0, len(ids))
    full_cache = full.freeze(len(ids), reference.sinks)
    informations: dict[tuple[str, int, int], Tensor] = {}
    results = []
    for config in configs:
        ingestion = _Ingestion(engine, config, ids)
        ingestion.timings["prefill"] = reference.timings["prefill"]
        information = None
        if ingestion.information is not None:
            key = (config.information, config.entropy_top_k, config.entropy_vocabulary)
            if key not in informations:
                informations[key] = ingestion.chunk_information(hidden, 0, len(ids))
            information = informations[key]
        cache = full_cache.working_copy(0)
        ingestion.score_and_compress(cache, capture, hidden, 0, len(ids), information)
        frozen, stats, information_reference = ingestion.finish(cache)
        stats.pages = len(document.pages)
        results.append(CompressedDocument(engine, frozen, config, document, stats, information_reference))
    return results


@dataclass
class CompressedDocument:
    """A document read once into a compressed cache; answers any number of questions against it."""

    engine: InfoKVEngine
    cache: DocumentCache
    config: CompressionConfig
    document: Document
    stats: DocumentStats
    information_reference: Tensor | None = None
    """Sorted information values (entropy or surprisal, as configured) of the document tokens, when the
    method computed them."""

    def information_rank(self, logits: Tensor, token: int) -> Tensor:
        """Eviction priority of a generated `token` sampled from `logits` (vocab,): where its information
        falls among the document's, in [0, 1] (0.5 when the method computed none)."""
        reference = self.information_reference
        if reference is None or len(reference) == 0:
            return torch.full((), 0.5, device=logits.device)
        if self.config.information == "surprisal":
            value = -torch.log_softmax(logits.float(), dim=-1)[token].reshape(1)
        else:
            value = logits_entropy(logits.reshape(1, -1), self.config.entropy_top_k)
        rank = torch.searchsorted(reference, value.to(reference.device))
        return (rank.float() / len(reference)).reshape(()).to(logits.device)

    @torch.inference_mode()
    def teacher_forced_logits(self, turns: Sequence[Turn], continuation: Sequence[int]) -> Tensor:
        """Next-token logits (len(continuation) + 1, vocab) after the conversation, fed `continuation`.

        Row i is the distribution of continuation token i (the last row, of the token after it).
        """
        runner = self.engine.runner
        suffix = self.engine.prompt.conversation_ids(turns)
        ids = torch.tensor([*suffix, *continuation], device=runner.device)
        n = self.cache.document_tokens
        with self.engine.lock:
            session = self.cache.working_copy(len(ids))
            hidden = runner.forward(ids, torch.arange(n, n + len(ids), device=runner.device), session)
            return runner.logits(hidden[len(suffix) - 1 :])

    def generate(self, turns: Sequence[Turn], options: GenerationOptions | None = None) -> Generation:
        """Answers a conversation ((role, content) turns after the document); see `ask` for options."""
        return self.engine.generate(self, turns, options or GenerationOptions())

    def stream(
        self,
        question: str,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        max_cache_tokens: int | None = None,
    ) -> Iterator[str]:
        """Yields the answer's text pieces as they are generated."""
        options = GenerationOptions.build(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            stop=stop,
            seed=seed,
            max_cache_tokens=max_cache_tokens,
        )
        yield from self.generate(question_turns(question), options)

    def ask(self, question: str, **options: Any) -> str:
        """Answers one question (greedy unless `temperature` > 0); options as for `stream`."""
        return "".join(self.stream(question, **options))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Writes this cache to `directory` atomically (see `infokv_rag.store`); returns its path."""
        from .store import save_document

        return save_document(self, directory)
