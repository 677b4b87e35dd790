"""What both framework adapters share: lazily loaded engines, resolved documents, async stepping.

Nothing here knows LangChain or LlamaIndex, and nothing here does model work: it only decides which
`InfoKVEngine` and which `CompressedDocument` a call uses, so that each adapter stays a thin mapping
between its framework's types and `CompressedDocument.generate`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.documents import Document
from infokv_rag.errors import ConfigError
from infokv_rag.generation import Generation, GenerationOptions, Usage
from infokv_rag.loaded import LoadOnceCache
from infokv_rag.placement import dtype_name
from infokv_rag.prompt import Turn
from infokv_rag.store import MANIFEST

DEFAULT_MODEL = "default"

DocumentSource = Union[str, "os.PathLike[str]", CompressedDocument, Document]
"""A file (.pdf .txt .md), a saved cache directory, an ingested document or a loaded `Document`."""

# Engines -------------------------------------------------------------------------------------------

_ENGINES: dict[tuple[str, str | None, str | None], InfoKVEngine] = {}
_ENGINES_LOCK = threading.Lock()


def get_engine(model: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None) -> InfoKVEngine:
    """The engine for `model` on `device` in `dtype` (None: the defaults), loaded on first use and shared by
    every adapter in the process."""
    key = (model, device, dtype_name(dtype))
    engine = _ENGINES.get(key)
    if engine is None:
        with _ENGINES_LOCK:  # one load per model, even when several threads ask at once
            engine = _ENGINES.get(key)
            if engine is None:
                engine = InfoKVEngine.from_pretrained(model, device=device, dtype=key[2])
                _ENGINES[key] = engine
    return engine


def loaded_models() -> list[str]:
    """Names of the models loaded so far (for tests and diagnostics)."""
    return sorted({name for name, _, _ in _ENGINES})


# Documents -----------------------------------------------------------------------------------------

_DOCUMENTS: LoadOnceCache[tuple[Any, ...], CompressedDocument] = LoadOnceCache(capacity=8)


def coerce_config(config: CompressionConfig | dict[str, Any] | None) -> CompressionConfig:
    if config is None:
        return CompressionConfig()
    if isinstance(config, CompressionConfig):
        return config
    return CompressionConfig(**config)


def coerce_dtype(value: Any) -> str | None:
    """An adapter's `dtype` field: a name (bf16, fp16, fp32, auto) or a torch dtype -> the canonical name."""
    return dtype_name(None if value is None else str(value))


def optional_config(config: CompressionConfig | dict[str, Any] | None) -> CompressionConfig | None:
    """An adapter's `compression` field: None (the defaults, applied per call) or a config."""
    return None if config is None else coerce_config(config)


def _is_saved_cache(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _source_key(source: DocumentSource | None, text: str | None) -> tuple[Any, ...]:
    if text is not None:
        return ("text", hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest())
    if isinstance(source, Document):
        # The pages too: the same text cut into other pages (other numbers) cites other pages.
        layout = json.dumps(source.layout(), sort_keys=True)
        content = hashlib.sha256(f"{layout}\n{source.text}".encode("utf-8", "surrogatepass")).hexdigest()
        return ("document", source.sha256, content)
    path = Path(os.fspath(source)).expanduser().resolve()  # type: ignore[arg-type]
    if _is_saved_cache(path):
        stat = (path / MANIFEST).stat()
        return ("cache", str(path), stat.st_mtime_ns, stat.st_size)
    if not path.is_file():
        raise FileNotFoundError(
            f"document {os.fspath(source)!r} not found: pass a .pdf/.txt/.md file, a saved cache directory "  # type: ignore[arg-type]
            "(from doc.save()), or the text itself"
        )
    stat = path.stat()
    return ("file", str(path), stat.st_mtime_ns, stat.st_size)


def document_identity(source: DocumentSource | None, text: str | None) -> str | None:
    """What an adapter's answers depend on in its document, as text for answer caches and traces: the content
    (digests, or a file's path, size and modification time) and, for a `CompressedDocument`, its config and
    model. None when no document is bound."""
    if source is None and text is None:
        return None
    if isinstance(source, CompressedDocument) and text is None:
        key: tuple[Any, ...] = (
            *_source_key(source.document, None),
            source.config.to_dict(),
            source.engine.fingerprint,
        )
        return json.dumps(key, sort_keys=True)
    try:
        return json.dumps(_source_key(source, text))
    except FileNotFoundError:  # refused when a call opens it; until then, named as given
        return os.fspath(source)  # type: ignore[arg-type]


def open_document(
    source: DocumentSource | None = None,
    *,
    text: str | None = None,
    model: str | None = None,
    config: CompressionConfig | dict[str, Any] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    password: str | None = None,
) -> CompressedDocument:
    """The compressed document for a source, ingested (or loaded) once per model and config.

    `model` None means the source's own model for a `CompressedDocument`, else `DEFAULT_MODEL`.
    Asking for another model than the one a `CompressedDocument` was read with is an error: its
    cache belongs to that model. `password` opens an encrypted PDF file; it is no part of the key (a file read
    once is shared in the process, as its text is).
    """
    if isinstance(source, CompressedDocument) and text is None:
        if model is not None and model != source.engine.name:
            raise ValueError(
                f"the document was read by model {source.engine.name!r}; it cannot be answered by {model!r}. "
                "Pass the file (or its text) instead, so that it is read by the requested model"
            )
        return source
    if source is None and text is None:
        raise ValueError(
            "no document bound: pass document= (a .pdf/.txt/.md path, a saved cache directory or a "
            "CompressedDocument) or document_text=, at construction or per call with .bind(document=...)"
        )
    config = coerce_config(config)
    model = model or DEFAULT_MODEL
    kind, *identity = _source_key(source, text)
    key = (model, device, dtype_name(dtype), config, kind, *identity)

    def ingest() -> CompressedDocument:
        engine = get_engine(model, device, dtype)
        if text is not None:
            return engine.ingest_text(text, config)
        if isinstance(source, Document):
            return engine.ingest_document(source, config)
        if kind == "cache":
            return engine.load(identity[0])
        return engine.ingest(identity[0], config, password=password)

    return _DOCUMENTS.get_or_load(key, ingest)


class AdapterFields(Protocol):
    """The fields both adapters declare: what a call resolves its document and options from."""

    model: str | None
    document: Any
    document_text: str | None
    compression: CompressionConfig | None
    device: str | None
    dtype: str | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    max_cache_tokens: int | None
    recall: float | int | None


def adapter_model_name(model: str | None, document: Any) -> str:
    """The model an adapter answers with: its own `model`, else a `CompressedDocument`'s, else the default."""
    if model:
        return model
    if isinstance(document, CompressedDocument):
        return document.engine.name
    return DEFAULT_MODEL


DOCUMENT_OPTIONS = ("document", "document_text", "model", "compression")
"""The call kwargs that choose another document than the adapter's own."""


def open_call_document(
    adapter: AdapterFields, kwargs: dict[str, Any], password: str | None = None
) -> CompressedDocument:
    """The document of one call: the call's `DOCUMENT_OPTIONS` over the adapter's fields (a per-call
    `document` replaces the adapter's `document_text`); `password` opens an encrypted PDF."""
    text = kwargs.get("document_text", adapter.document_text if "document" not in kwargs else None)
    return open_document(
        kwargs.get("document", adapter.document),
        text=text,
        model=kwargs.get("model") or adapter.model,
        config=kwargs.get("compression", adapter.compression),
        device=adapter.device,
        dtype=adapter.dtype,
        password=password,
    )


# Generation ----------------------------------------------------------------------------------------


CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "max_cache_tokens", "recall")
"""Generation settings an adapter holds as fields, each of which a call's kwargs may override."""

CALL_KWARGS = frozenset((*CALL_OPTIONS, *DOCUMENT_OPTIONS, "stop"))
"""Every kwarg a call takes: a misspelt option (or the core's `max_new_tokens`) must not pass unseen."""


def call_options(adapter: AdapterFields, kwargs: dict[str, Any], stop: Sequence[str] | None) -> GenerationOptions:
    """The generation options of one call: its kwargs over the adapter's fields (`CALL_OPTIONS`); ConfigError
    for a kwarg that no call takes (`CALL_KWARGS`)."""
    unknown = sorted(set(kwargs) - CALL_KWARGS)
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; a call takes {', '.join(sorted(CALL_KWARGS))}")
    options = {name: kwargs.get(name, getattr(adapter, name)) for name in CALL_OPTIONS}
    return GenerationOptions.build(
        max_new_tokens=options["max_tokens"],
        temperature=options["temperature"],
        top_p=options["top_p"],
        stop=[s for s in (stop or ()) if s],
        seed=options["seed"],
        max_cache_tokens=options["max_cache_tokens"],
        recall=options["recall"],
    )


_DONE = object()


def _step(iterator: Iterator[str]) -> Any:
    return next(iterator, _DONE)


async def aiter_pieces(generation: Generation) -> AsyncIterator[str]:
    """Yields a generation's pieces, running each blocking decoding step in a worker thread."""
    iterator = iter(generation)
    try:
        while True:
            piece = await asyncio.to_thread(_step, iterator)
            if piece is _DONE:
                return
            yield piece
    finally:
        try:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        except ValueError:  # cancelled while a step still runs in its thread: it ends with that step
            pass


@dataclass(frozen=True)
class AnswerInfo:
    """What an adapter reports beside the text of an answer."""

    model_name: str
    usage: Usage
    stats: dict[str, Any]
    source: str | None
    pages: int

    @property
    def input_tokens(self) -> int:
        """Question tokens plus the document tokens served from the cache."""
        return self.usage.prompt_tokens + self.usage.cached_tokens

    def metadata(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "finish_reason": self.usage.finish_reason,
            "time_to_first_token": self.usage.time_to_first_token,
            "recalled_tokens": self.usage.recalled_tokens,
            "document": {"source": self.source, "pages": self.pages, "tokens": self.usage.cached_tokens},
            "compression": self.stats,
        }


def answer_info(document: CompressedDocument, usage: Usage) -> AnswerInfo:
    return AnswerInfo(
        model_name=document.engine.name,
        usage=usage,
        stats=document.stats.to_dict(),
        source=document.document.source,
        pages=len(document.document.pages),
    )


def check_turns(turns: Sequence[Turn]) -> list[Turn]:
    turns = [(role, content) for role, content in turns]
    if not turns:
        raise ValueError("no messages: ask a question about the document")
    return turns
