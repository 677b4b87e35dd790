"""InfoKVEngine: a model ready to read documents into compressed caches (and to load saved ones)."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import store
from .architectures import check_loaded_model, check_tokenizer, check_vocabulary, load_checked, load_weights
from .config import CompressionConfig
from .document import CompressedDocument
from .documents import Document, document_from_text, load_document, text_as_read
from .errors import AnswerRoom, AnswerRoomError, ConfigError, ContextLengthError, ModelError
from .generation import DEFAULT_MAX_NEW_TOKENS
from .ingestion import Ingestion, ProgressCallback
from .kernels import KernelBackendError, check_kernel_backend
from .model_runner import ModelRunner
from .models import files_stamp, loaded_model_fingerprint, resolve_model
from .placement import resolve_placement
from .prompt import PromptFormat, Turn, conversation_messages
from .surrogate import ReconstructionSurrogate, surrogate_for

TOKENIZE_PIECE_CHARS = 16_384
"""A document's text is counted in pieces of about this many characters, so that counting a huge one stops early."""
END_TOKENS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|end_of_text|>",
        "<|end|>",
        "<|eot|>",
        "<end_of_turn>",
        "</s>",
        "<eos>",
    }
)
"""Special tokens that end an answer wherever a tokenizer holds them, besides the ids its model's config names."""
PADDING_SLOT = re.compile(r"\[PAD\d+\]")
"""The name llama.cpp's conversion gives the vocabulary's unused rows (`[PAD151665]`)."""
QUESTION_RESERVE = 64
"""Context tokens a document must leave free for a question, beside an answer of the default length."""


class InfoKVEngine:
    """A causal LM that reads documents into compressed caches and answers questions against them."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        fingerprint: Callable[[], str],
        model_dir: Path | None = None,
    ) -> None:
        """Use `from_pretrained` or `from_model`. `fingerprint` computes, on first use, the hash that saved
        caches are checked against; `model_dir` is where the weights were read from (None: a model in memory)."""
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.name = name
        self.runner = ModelRunner(model)
        try:
            check_kernel_backend(self.runner.device)
        except KernelBackendError as exc:
            raise ConfigError(str(exc)) from None  # before any work, not at the first kernel call deep into a job
        self.prompt = PromptFormat(tokenizer)
        self._fingerprint = fingerprint
        # One forward pass at a time; separate answers interleave step by step. The service swaps in a fair lock.
        self.lock: AbstractContextManager[Any] = threading.RLock()
        self.stop_ids = self._collect_stop_ids()
        """Token ids that end an answer (the model's end-of-turn and end-of-text ids, `END_TOKENS`)."""

    @functools.cached_property
    def fingerprint(self) -> str:
        """Identifies the model to saved caches (a model in memory: computed on first use, hashing its weights)."""
        return self._fingerprint()

    @functools.cached_property
    def reconstruction_surrogate(self) -> ReconstructionSurrogate:
        """The model's fitted predictor of reconstruction importance (`surrogate.py`): shipped, cached or
        fitted on first use."""
        return surrogate_for(self).on(self.runner.device)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike[str] = "default",
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        *,
        revision: str | None = None,
    ) -> InfoKVEngine:
        """Loads `default`, `tiny`, a local HF directory, a `.gguf` file (converted once, then cached) or a
        Hugging Face hub id (`org/name`, at `revision` or `org/name@revision`; downloaded into the HF cache,
        or read from it when HF_HUB_OFFLINE=1).

        `device` defaults to CUDA when available, else CPU; `dtype` (a torch dtype or a name: bf16, fp16,
        fp32) to bfloat16 on CUDA (float16 where unsupported) and float32 elsewhere. An unsupported
        architecture or a tokenizer without a chat template is refused before the weights load.
        """
        place, precision = resolve_placement(device, dtype)  # a bad option fails before anything downloads
        source = resolve_model(name_or_path, revision)
        read = set(files_stamp(source.directory))
        config, tokenizer = load_checked(source.directory, source.name, source.remedy)
        weights = source.weights_directory()  # a hub model's download adds its weights beside its config
        directories = {source.directory, weights}  # one directory for a converted or local model
        read |= set(files_stamp(weights))
        # Computed from the files as they are read, not at the first save: caches saved later must not be signed by
        # weights written over the directory meanwhile (a new checkpoint), which this engine does not hold.
        fingerprint = source.fingerprint()
        model = load_weights(weights, config, precision, source.name, source.remedy).to(place)
        if not read <= set(files_stamp(*directories)):  # a file read was written or removed since
            raise ModelError(f"the files of {source.name} ({source.directory}) changed while it loaded; load it again")
        return cls(model, tokenizer, source.name, lambda: fingerprint, model_dir=source.directory)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, name: str | None = None) -> InfoKVEngine:
        """An engine over a transformers causal LM already in memory, on whatever single device and in
        whatever dtype it is. The same checks as `from_pretrained` apply (supported architecture, a chat
        template, a tokenizer whose tokens the weights embed). The model is put in eval mode without gradients,
        and its attention is routed through infokv-rag's hook (other callers, e.g. `model.generate`, fall through
        to transformers' SDPA).

        `name` (default: the model's `name_or_path`) labels it in saved caches and answers; saved caches
        are checked against a hash of its weights as they are in memory (computed on first save or load).
        """
        label = name or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        check_loaded_model(model, label)
        check_tokenizer(tokenizer, label)
        embedded = int(model.get_input_embeddings().num_embeddings)
        check_vocabulary(tokenizer, embedded, label, "pass the tokenizer of this model")
        return cls(model, tokenizer, label, functools.partial(loaded_model_fingerprint, model, tokenizer))

    def _collect_stop_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (getattr(self.model.generation_config, "eos_token_id", None), self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(int(i) for i in source)
        # A model converted from GGUF names one end id (Qwen's <|im_end|>), where its own config lists every one: a
        # sampled <|endoftext|> was read as nothing and the answer went on.
        ids.update(
            int(i)
            for i, token in self.tokenizer.added_tokens_decoder.items()
            if token.special and token.content in END_TOKENS
        )
        return frozenset(ids)

    @functools.cached_property
    def never_sampled(self) -> Tensor:
        """(LM-head rows,) True for the ids no answer may hold: rows past the tokenizer's ids (an embedding padded to
        a round size) and the padding slots a GGUF conversion names "[PAD151665]", never trained; sampling at a high
        temperature drew them (about one answer in 20 at temperature 2 on the default model), and they read as text."""
        rows = int(self.runner.lm_head.weight.shape[0])
        flags = torch.ones(rows, dtype=torch.bool)
        named = self.tokenizer.convert_ids_to_tokens(list(range(min(rows, len(self.tokenizer)))))
        flags[: len(named)] = torch.tensor([PADDING_SLOT.fullmatch(str(token)) is not None for token in named])
        return flags.to(self.runner.device)

    @functools.cached_property
    def word_starts(self) -> Tensor:
        """(vocab,) True for tokens that begin a word (their text starts with whitespace): the tokens up to
        the next such token, e.g. the digits and separators of "1.13.22", form one word."""
        return self._token_flags(lambda text: not text or text[0].isspace())

    @functools.cached_property
    def sentence_marks(self) -> Tensor:
        """(vocab,) True for tokens whose text holds . ; : ! or ?"""
        return self._token_flags(lambda text: any(c in text for c in ".;:!?"))

    @functools.cached_property
    def clause_marks(self) -> Tensor:
        """(vocab,) True for tokens whose text holds a comma or one of `sentence_marks`."""
        return self._token_flags(lambda text: any(c in text for c in ",.;:!?"))

    @functools.cached_property
    def numerals(self) -> Tensor:
        """(vocab,) True for tokens whose text holds a digit."""
        return self._token_flags(lambda text: any(c.isdigit() for c in text))

    @functools.cached_property
    def line_breaks(self) -> Tensor:
        """(vocab,) True for tokens whose text holds a newline."""
        return self._token_flags(lambda text: "\n" in text)

    def segments(self, ids: Tensor, marks: Tensor) -> Tensor:
        """(n,) token ids -> (n,) int64 index of the segment each token belongs to (non-decreasing, from 0).

        A segment ends at a line break, or at a token holding one of `marks` when the next token begins a
        word, so the marks inside "1.13.22" or "3,500,000" end nothing. `marks`: `sentence_marks` gives
        sentences (and clauses ended by ; or :), `clause_marks` clauses.
        """
        starts = self.word_starts[ids]
        next_starts = torch.cat([starts[1:], starts.new_ones(1)])
        ends = ((marks[ids] & next_starts) | self.line_breaks[ids]).long()
        return torch.cumsum(ends, 0) - ends

    @functools.cached_property
    def _token_texts(self) -> list[str]:
        """Each token's text as it reads inside a text. SentencePiece decoders (Llama 2, Mistral, Phi-3) drop the
        space that begins a text's first token ("▁the" reads "the"), which alone would start no word: so each token
        is decoded after an anchor token, whose own text is then cut off (alone where that is not a prefix)."""
        anchor = self.prompt.ids("a", as_text=True)
        prefix = self.tokenizer.decode(anchor)
        after = self.tokenizer.batch_decode([[*anchor, i] for i in range(len(self.tokenizer))])
        return [
            text[len(prefix) :] if text.startswith(prefix) else self.tokenizer.decode([i])
            for i, text in enumerate(after)
        ]

    def _token_flags(self, test: Callable[[str], bool]) -> Tensor:
        """(vocab,) `test` of each token's text; False for ids the tokenizer does not decode (LM-head padding)."""
        size = max(len(self.tokenizer), self.runner.lm_head.weight.shape[0])
        flags = torch.zeros(size, dtype=torch.bool)
        flags[: len(self._token_texts)] = torch.tensor([test(text) for text in self._token_texts])
        return flags.to(self.runner.device)

    @property
    def context_window(self) -> int:
        return self.runner.max_positions

    @property
    def max_document_tokens(self) -> int:
        """The longest document this model reads: its context window less room for a question of `QUESTION_RESERVE`
        tokens and an answer of `DEFAULT_MAX_NEW_TOKENS`, so that every document read can be asked about with the
        defaults."""
        return self.context_window - QUESTION_RESERVE - DEFAULT_MAX_NEW_TOKENS

    def too_long(self, what: str) -> str:
        """Why `what` (the document, a file's name) is refused as longer than `max_document_tokens`, and what to do:
        a model whose window holds no more than a question and its answer reads no document at all."""
        reserve = self.context_window - self.max_document_tokens
        if self.max_document_tokens < 1:
            return (
                f"this model reads no document: its context window of {self.context_window} tokens holds no more than "
                f"the {reserve} kept for a question and its answer; use a model with a longer context"
            )
        return (
            f"{what} is more than {self.max_document_tokens} tokens, the most this model reads: its context window of "
            f"{self.context_window} less {reserve} for a question and its answer; split the document or use a model "
            "with a longer context"
        )

    def count_document_tokens(self, text: str, limit: int | None = None) -> int:
        """The exact token count of `text` as a document prefix when it is at most `limit` (default
        `max_document_tokens`); otherwise a count above `limit`, found after tokenizing about `limit` tokens of the
        text, never all of a huge one (a text file of megabytes takes a minute and gigabytes to tokenize whole).

        Pieces are cut at whitespace, where a cut changes the count by a couple of tokens at most; counting stops
        only once the sum passes `limit` by more than the cuts could explain. `text` is counted as `ingest_text`
        reads it (`text_as_read`: CRLF line endings as LF, no byte-order mark).
        """
        text = text_as_read(text)
        past = self._count_past(text, self.max_document_tokens if limit is None else limit)
        return past if past is not None else len(self.prompt.document_ids(text))  # the exact count

    def _count_past(self, text: str, limit: int, strip: bool = True) -> int | None:
        """A count of `text`'s tokens above `limit`, from pieces of it, as soon as one is certain; None when the
        pieces never certainly pass it (the whole text is then short enough to tokenize whole). `strip`: counted
        as a document reads it, without the whitespace at its ends (a question's is rendered and counted)."""
        body = text.strip() if strip else text
        counted = self.prompt.head_tokens
        start = pieces = 0
        while start < len(body):
            end = min(len(body), start + TOKENIZE_PIECE_CHARS)
            if end < len(body):
                cut = max(body.rfind(" ", start, end), body.rfind("\n", start, end))
                end = cut if cut > start else end
            counted += self.prompt.text_tokens(body[start:end])
            pieces += 1
            if counted > limit + 2 * pieces:
                return counted
            start = end
        return None

    def check_question_fits(self, document_tokens: int, turns: Sequence[Turn], max_new_tokens: int) -> list[int]:
        """The token ids of a conversation asked after a document of `document_tokens` tokens; `AnswerRoomError`
        when they and `max_new_tokens` would not fit the context window beside it (as an answer would refuse them:
        a caller checks its questions this way before it reads the document)."""
        messages = conversation_messages(turns)
        room = self.context_window - document_tokens - max_new_tokens
        text = "\n".join(message["content"] for message in messages)
        # A text of megabytes is counted past the room in pieces, never tokenized whole (seconds and gigabytes);
        # one of a piece or less is counted exactly, with the template's tokens around it, below.
        long = len(text) > max(room, TOKENIZE_PIECE_CHARS)
        past = self._count_past(text, room + self.prompt.head_tokens, strip=False) if long else None
        if past is not None:
            question = past - self.prompt.head_tokens
            room_taken = AnswerRoom(document_tokens, question, max_new_tokens, self.context_window, True)
            raise AnswerRoomError.of(room_taken)
        suffix = self.prompt.conversation_ids(turns)
        if document_tokens + len(suffix) + max_new_tokens > self.context_window:
            raise AnswerRoomError.of(AnswerRoom(document_tokens, len(suffix), max_new_tokens, self.context_window))
        return suffix

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers and KV heads."""
        runner = self.runner
        return 2 * runner.num_layers * runner.kv_heads * runner.head_dim * runner.dtype.itemsize

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

    def resolve_config(self, config: CompressionConfig | None = None) -> CompressionConfig:
        """`config` (default: `CompressionConfig()`) as ingestion applies it to this model: what was left to
        the model is set (the cold tier's width, from the cache's dtype)."""
        if config is None:
            config = CompressionConfig()
        elif not isinstance(config, CompressionConfig):  # a ratio or a dict would fail later, on an attribute
            raise ConfigError(
                "config must be a CompressionConfig, e.g. CompressionConfig(keep=0.5) (a dict: "
                f"CompressionConfig(**it)), not {type(config).__name__}"
            )
        if config.keeps_cold_tier and config.cold_bits is None:
            config = dataclasses.replace(config, cold_bits=config.cold_tier_bits(self.runner.dtype.itemsize))
        return config

    def ingest_document(
        self, document: Document, config: CompressionConfig | None = None, *, progress: ProgressCallback | None = None
    ) -> CompressedDocument:
        """Reads a loaded `Document` (`infokv_rag.documents.load_document`, `document_from_pages`) and compresses its
        cache; a file's path goes to `ingest`."""
        if not isinstance(document, Document):  # a path would fail deep inside on `.text`
            raise TypeError(
                f"ingest_document takes a Document (infokv_rag.documents.load_document(path)), not "
                f"{type(document).__name__}: pass a file's path to engine.ingest(path)"
            )
        config = self.resolve_config(config)
        # The exact ids only of a text the pieces did not already find too long: tokenized whole once, not twice.
        fits = self._count_past(document.text, self.max_document_tokens) is None
        ids = self.prompt.document_ids(document.text) if fits else []
        if not fits or len(ids) > self.max_document_tokens:
            raise ContextLengthError(self.too_long("the document"))
        result = Ingestion(self, config, torch.tensor(ids, device=self.runner.device)).run(progress)
        result.stats.pages = len(document.pages)
        return CompressedDocument(
            self, result.cache, config, document, result.stats, result.information_reference, result.cold_tier
        )

    def load(self, directory: str | os.PathLike[str]) -> CompressedDocument:
        """Loads a cache saved with `CompressedDocument.save`; refuses another model's or a damaged one."""
        return store.read_whole(directory, self.load_files)

    def load_files(self, files: store.CacheFiles) -> CompressedDocument:
        """Loads a saved cache from wherever `files` reads it (a directory, an object store), verified as `load`."""
        saved = store.load_files(self, files)
        return CompressedDocument(
            self, saved.cache, saved.config, saved.document, saved.stats, saved.information_reference, saved.cold_tier
        )
