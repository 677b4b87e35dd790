"""What both framework adapters share: lazily loaded engines, resolved documents, async stepping.

Nothing here knows LangChain or LlamaIndex, and nothing here does model work: it only decides which
`InfoKVEngine` and which `CompressedDocument` a call uses, so that each adapter stays a thin mapping
between its framework's types and `CompressedDocument.generate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import functools
import hashlib
import json
import numbers
import os
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Protocol, Union

import torch
from pydantic import BaseModel, SecretStr
from pypdf import PdfReader

from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.config import check_count
from infokv_rag.documents import PDF_HEADER_WINDOW, Document, load_document, opens_with, reads_as_pdf
from infokv_rag.errors import AnswerRoomError, ConfigError, InfoKVError, ModelError
from infokv_rag.generation import Generation, GenerationOptions, Usage
from infokv_rag.loaded import LoadOnceCache
from infokv_rag.placement import dtype_name, resolve_placement
from infokv_rag.prompt import Turn
from infokv_rag.store import COLD, MANIFEST, TENSORS, TEXT, read_manifest, saved_model_name

DEFAULT_MODEL = "default"

DocumentSource = Union[str, "os.PathLike[str]", CompressedDocument, Document]
"""A file (.pdf .txt .md), a saved cache directory, an ingested document or a loaded `Document`."""

DOCUMENT_SOURCES = (
    "a .pdf/.txt/.md path (str or os.PathLike), a saved cache directory, a CompressedDocument or an infokv_rag Document"
)
"""What an adapter's `document` is (`DocumentSource`), in words for the errors that refuse anything else."""

# Engines -------------------------------------------------------------------------------------------

_ENGINES: dict[tuple[str, str, str], InfoKVEngine] = {}
_ENGINES_LOCK = threading.Lock()


def placement_key(device: str | None, dtype: str | None) -> tuple[str, str]:
    """The device and dtype a model would load with, as text: every spelling of one placement ("auto", None and
    "cpu" on a CPU machine; "fp32" and "float32") is one key, so it loads the weights and reads a document once."""
    place, precision = resolve_placement(device, dtype)
    if place.type == "cuda" and place.index is None:
        place = torch.device("cuda", torch.cuda.current_device())
    return str(place), str(precision).removeprefix("torch.")


def get_engine(model: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None) -> InfoKVEngine:
    """The engine for `model` on `device` in `dtype` (None: the defaults), loaded on first use and shared by
    every adapter in the process."""
    key = (model, *placement_key(device, dtype))
    engine = _ENGINES.get(key)
    if engine is None:
        with _ENGINES_LOCK:  # one load per model, even when several threads ask at once
            engine = _ENGINES.get(key)
            if engine is None:
                engine = InfoKVEngine.from_pretrained(model, device=key[1], dtype=key[2])
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


def not_a_bool(value: Any) -> Any:
    """An adapter's numeric generation field (`CALL_OPTIONS`), refused when it is a bool (Python's or numpy's):
    pydantic's lax mode reads True as 1 (seed=True the seed 1), where the core refuses it. Another integer (numpy's)
    is an int, so that a recall count stays a count (lax mode made np.int64(1) the ratio 1.0: the whole cold tier);
    other values pydantic converts as it does (a config's "0.2")."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        raise ValueError(f"a number is needed here, not the bool {value}")
    return int(value) if isinstance(value, numbers.Integral) else value


def stop_field(value: Any) -> Any:
    """An adapter's `stop` field: one string is one sequence, as a call's `stop` is (pydantic refused it)."""
    return [value] if isinstance(value, str) else value


def model_field(value: Any) -> Any:
    """An adapter's `model` field: a path (`pathlib.Path`) as its text, as `InfoKVEngine.from_pretrained` takes it."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def optional_config(config: CompressionConfig | dict[str, Any] | None) -> CompressionConfig | None:
    """An adapter's `compression` field: None (the defaults, applied per call) or a config."""
    return None if config is None else coerce_config(config)


def config_fields(config: CompressionConfig | None) -> dict[str, Any] | None:
    """An adapter's `compression` field as its serialisers write it: every field and method setting written out, so
    that `optional_config` makes the same config of it. Not `to_dict`, which leaves out values that a saved cache's
    reader (`CompressionConfig.from_dict`) puts back and the constructor would fill with today's defaults; and not
    pydantic's own, which writes the method's settings as their base class, with no fields: `{}`."""
    return None if config is None else dataclasses.asdict(config)


def _is_saved_cache(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def _saved_cache_stamp(path: Path) -> tuple[str, int, int] | None:
    """(directory, its manifest's modification time and size) when `path` is a saved cache, else None."""
    if not _is_saved_cache(path):
        return None
    stat = (path / MANIFEST).stat()
    return str(path), stat.st_mtime_ns, stat.st_size


def _source_key(source: DocumentSource | None, text: str | None) -> tuple[Any, ...]:
    if text is not None:
        return ("text", hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest())
    if isinstance(source, Document):
        # The pages too: the same text cut into other pages (other numbers) cites other pages.
        layout = json.dumps(source.layout(), sort_keys=True)
        content = hashlib.sha256(f"{layout}\n{source.text}".encode("utf-8", "surrogatepass")).hexdigest()
        return ("document", source.sha256, content)
    name = os.fspath(source)  # type: ignore[arg-type]
    path = _document_path(name)
    saved = _saved_cache_stamp(path)
    if saved is not None:
        return ("cache", *saved)
    if not path.is_file():
        _refuse_source(name, path)
    stat = path.stat()
    return ("file", str(path), stat.st_mtime_ns, stat.st_size)


def _document_path(name: str) -> Path:
    """A document's path, absolute. A name that no file can have (longer than a file name may be, a NUL in it) is
    most likely the document's text given where its path goes: refused saying so (`_text_as_path`), where the
    filesystem's first look at it would raise a bare `OSError` or `ValueError`."""
    try:
        path = Path(name).expanduser().resolve()
        path.exists()  # the filesystem's first look at the name, where it refuses one that no file can have
    except (OSError, ValueError) as exc:
        if isinstance(exc, OSError) and exc.errno != errno.ENAMETOOLONG:
            raise
        _text_as_path(name)
    return path


def _text_as_path(name: str) -> NoReturn:
    """Refuses a document's text given as its path (`document=`), showing its start only."""
    shown = name if len(name) <= 60 else f"{name[:60]}..."
    raise FileNotFoundError(
        f"document {shown!r} is no file: it looks like the document's text, which goes in document_text= "
        "(document= takes a .pdf/.txt/.md file or a saved cache directory)"
    )


def _refuse_source(name: str, path: Path) -> NoReturn:
    """Raises what the core says of a `path` that is neither a file nor a saved cache: not found (a name with a line
    break in it: the document's text, `_text_as_path`); a saved cache's directory without its manifest
    (`CacheStoreError`, as `InfoKVEngine.load`); another directory (`IsADirectoryError`, as `load_document`); a pipe
    or a device (`UnsupportedFormatError`)."""
    if not path.exists():
        if "\n" in name:
            _text_as_path(name)
        raise FileNotFoundError(
            f"document {name!r} not found: pass a .pdf/.txt/.md file, a saved cache directory "
            "(from doc.save()), or the text itself as document_text="
        )
    if path.is_dir() and any((path / part).exists() for part in (TENSORS, TEXT, COLD)):
        read_manifest(path)  # a cache's files without their manifest: "not a saved document cache (no manifest)"
    try:
        load_document(path)
    except IsADirectoryError as exc:
        raise IsADirectoryError(
            f"{exc}, or a saved cache directory (one holding {MANIFEST}, from doc.save(dir))"
        ) from None
    raise FileNotFoundError(f"document {name!r} is neither a file nor a saved cache directory")  # not reached


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
    except (OSError, InfoKVError):  # refused when a call opens it; until then, named as given
        return os.fspath(source)  # type: ignore[arg-type]


@functools.lru_cache(maxsize=64)
def _manifest_model(directory: str, mtime_ns: int, size: int) -> str:
    """The name of the model that made the saved cache in `directory`, as its manifest (at that modification time
    and size) records it; `CacheStoreError` for a manifest that is unreadable, damaged or names no model."""
    return saved_model_name(directory)


def _manifest_stamp(source: Any, text: str | None) -> tuple[str, int, int] | None:
    """`_saved_cache_stamp` of the document a call reads: `source` when that is a path (`text`, when given, is read
    instead of it)."""
    if text is not None or not isinstance(source, (str, os.PathLike)):
        return None
    return _saved_cache_stamp(_document_path(os.fspath(source)))


def answering_model(model: str | None, source: Any, text: str | None, reader: InfoKVEngine | None = None) -> str:
    """The name of the model that answers from a document: `model` when given, else the one that made the document,
    which alone can answer from its cache (a `CompressedDocument`'s; a saved cache directory's, as its manifest
    names it), else `reader`'s (`open_document`) or `DEFAULT_MODEL` (a file, a `Document` or text, which any model
    reads). `text`, when given, is the document instead of `source`. `CacheStoreError` for a saved cache whose
    manifest cannot be read."""
    if model:
        return model
    if text is None and isinstance(source, CompressedDocument):
        return source.engine.name
    saved = _manifest_stamp(source, text)
    if saved is not None:
        return _manifest_model(*saved)
    return DEFAULT_MODEL if reader is None else reader.name


def answering_engine(
    model: str | None, source: Any, text: str | None, device: str | None, dtype: str | None
) -> InfoKVEngine:
    """The engine of `answering_model`: a `CompressedDocument`'s own, else the shared one of that name, loaded on
    first use. A model that only a saved cache's manifest names and that does not load here (a local path since
    moved, a hub id offline) is refused saying where the name came from and how to name it instead."""
    name = answering_model(model, source, text)
    if text is None and isinstance(source, CompressedDocument) and name == source.engine.name:
        return source.engine
    try:
        return get_engine(name, device, dtype)
    except ModelError as exc:
        saved = None if model else _manifest_stamp(source, text)
        if saved is None:
            raise
        raise ModelError(
            f"the saved cache {saved[0]} was made by model {name!r}, which does not load here ({exc}); pass "
            "model= naming that model as it is on this machine (a cache is answered only by the model that made it)"
        ) from exc


def open_document(
    source: DocumentSource | None = None,
    *,
    text: str | None = None,
    model: str | None = None,
    config: CompressionConfig | dict[str, Any] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    password: str | None = None,
    how_to_bind: str = "at construction or per call",
    reader: InfoKVEngine | None = None,
) -> CompressedDocument:
    """The compressed document for a source, ingested (or loaded) once per model and config.

    `model` None means the model that made the source (`answering_model`: a `CompressedDocument`'s, a saved cache
    directory's), else `reader` (an adapter's engine: its bound document's, which may be no model that loads by
    name), else `DEFAULT_MODEL`. Asking for another model than the one a `CompressedDocument` was read with is
    an error: its cache belongs to that model.

    `config` None (an adapter's `compression` left unset) means the defaults for a file or text, and a saved cache
    or a `CompressedDocument` as it was compressed. A config given for either must be the one it was compressed
    with (`ConfigError` naming both otherwise: a cache cannot be compressed again); one that differs only in
    `recall`, each answer's default, is answered with its own, and one whose `cold_bits` is None takes the cache's.

    `password` opens an encrypted PDF file. It is checked against the file on every call (`_check_password`), also
    when the file was read already, and never kept: a document read once is shared in the process whatever password
    opened it, and a wrong or missing one is refused (`EncryptedPDFError`) before any model work.

    `how_to_bind` ends the error for no document: where the caller's framework takes one.
    """
    if isinstance(source, CompressedDocument) and text is None:
        if model is not None and model != source.engine.name:
            raise ValueError(
                f"the document was read by model {source.engine.name!r}; it cannot be answered by {model!r}. "
                "Pass the file (or its text) instead, so that it is read by the requested model"
            )
        if config is None:
            return source
        return _as_compressed("the CompressedDocument given is a cache", source, coerce_config(config))
    if source is None and text is None:
        raise ValueError(f"no document bound: pass document= ({DOCUMENT_SOURCES}) or document_text=, {how_to_bind}")
    kind, *identity = _source_key(source, text)
    name = answering_model(model, source, text, reader)
    if kind == "cache":
        key: tuple[Any, ...] = (name, *placement_key(device, dtype), kind, *identity)
        saved = _DOCUMENTS.get_or_load(
            key, lambda: answering_engine(model, source, text, device, dtype).load(identity[0])
        )
        return (
            saved if config is None else _as_compressed(f"{identity[0]} is a saved cache", saved, coerce_config(config))
        )
    if kind == "file":
        _check_password(Path(identity[0]), identity[1], identity[2], password)
    config = coerce_config(config)
    reads = reader if reader is not None and model is None else None
    engine_key = (reads,) if reads is not None else (name, *placement_key(device, dtype))
    key = (*engine_key, config, kind, *identity)

    def ingest() -> CompressedDocument:
        engine = reads if reads is not None else get_engine(name, device, dtype)
        if text is not None:
            return engine.ingest_text(text, config)
        if isinstance(source, Document):
            return engine.ingest_document(source, config)
        return engine.ingest(identity[0], config, password=password)

    return _DOCUMENTS.get_or_load(key, ingest)


def _as_compressed(described: str, saved: CompressedDocument, given: CompressionConfig) -> CompressedDocument:
    """A cache already compressed (a saved cache, or a `CompressedDocument` given as the source; `described` says
    which, for the error) answered with the compression `given` for it; `ConfigError` naming both when the cache was
    not made with it."""
    if given.recall and saved.config.recall and given.cold_bits is None:  # left to the model: the cache's width
        given = dataclasses.replace(given, cold_bits=saved.config.cold_bits)
    if given.cache_identity() != saved.config.cache_identity():
        differ = _differences(saved.config.to_dict(), given.to_dict())
        raise ConfigError(
            f"{described} compressed with {_describe(saved.config, differ)}, but the compression given has "
            f"{_describe(given, differ)}. A compressed cache is answered as it was compressed: leave compression "
            "unset (None) to use it, or pass the document's file or text to read it again with this compression"
        )
    if given.recall == saved.config.recall:
        return saved
    return dataclasses.replace(saved, config=given)  # the same cache, with another recall for each answer


def _differences(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """The names of the fields (and method settings, as `settings.NAME`) in which two configs' `to_dict()`s differ."""
    flat = [
        {
            **{name: value for name, value in config.items() if name != "settings"},
            **{f"settings.{name}": value for name, value in config.get("settings", {}).items()},
        }
        for config in (saved, given)
    ]
    return [name for name in sorted(set(flat[0]) | set(flat[1])) if flat[0].get(name) != flat[1].get(name)]


def _describe(config: CompressionConfig, names: list[str]) -> str:
    """`config`'s method and its values of the fields `names` (`settings.NAME` for a method setting)."""
    values = [f"method={config.method}"]
    for name in names:
        if name != "method":
            setting = name.removeprefix("settings.")
            owner = config.settings if setting != name else config
            values.append(f"{name}={getattr(owner, setting, None)}")
    return ", ".join(values)


@functools.lru_cache(maxsize=256)
def _encrypted_pdf(path: str, mtime_ns: int, size: int) -> bool:
    """Whether the file at `path`, as it is at that modification time and size, is an encrypted PDF (True also
    when that cannot be told, so that its password is checked). Nothing of a password is involved or kept."""
    try:
        with open(path, "rb") as handle:
            if not reads_as_pdf(handle.read(PDF_HEADER_WINDOW), path):
                return False  # read as text: a password is ignored
            handle.seek(0)
            return bool(PdfReader(handle, strict=False).is_encrypted)
    except Exception:
        return True


def _check_password(path: Path, mtime_ns: int, size: int, password: str | None) -> None:
    """Refuses (`EncryptedPDFError`, as `load_document` says it) a `password` that does not open `path` when that is
    an encrypted PDF, or its absence. Run on every open, so that a file read once with its password is never served
    to a call with another or none; it costs a parse of the file's trailer and one key derivation (pypdf's
    `decrypt`), and keeps nothing of the password, not even a hash."""
    if not _encrypted_pdf(str(path), mtime_ns, size):
        return
    try:
        with path.open("rb") as handle:
            if opens_with(PdfReader(handle, strict=False), password):  # as load_document opens it
                return
    except Exception:
        pass  # whatever went wrong, the core says it below
    load_document(path, password=password)  # raises the core's refusal (needs a password, wrong password, ...)


@dataclass(frozen=True)
class FrameworkDocuments:
    """A framework's own document classes, which no adapter takes as its `document`, and how their text comes in
    instead: for the error that refuses them."""

    classes: tuple[type, ...]
    named: str
    instead: str
    pass_again: str
    """How a dump whose document was described, not written (`document_as_json`), is made whole again."""


NOT_SERIALISED = "not_serialised"
"""The key of the description an adapter's dump gives of a document held in memory (`document_as_json`)."""


def document_as_json(document: Any) -> Any:
    """An adapter's `document` in its dumps (`model_dump`, traces, `InfoKV.to_json`): a path as its text; a document
    held in memory as a description only (`NOT_SERIALISED`): its cache and weights are no JSON, and a dump carrying
    them would put the model into every trace."""
    if isinstance(document, os.PathLike):
        return os.fspath(document)
    if isinstance(document, (CompressedDocument, Document)):
        held = document.document if isinstance(document, CompressedDocument) else document
        described = {"source": held.source, "pages": len(held.pages), "sha256": held.sha256}
        return {NOT_SERIALISED: type(document).__name__, **described}
    return document


def check_document(value: Any, adapter: str, framework: FrameworkDocuments) -> Any:
    """`value` when it can be `adapter`'s document (a `DocumentSource`, or None: none bound yet); TypeError naming
    what it takes otherwise, and for the framework's own documents (one, or a list or tuple of them) how those come
    in: refused where they are given, not later by an opaque `os.fspath`. A dump's description of a document held in
    memory (`document_as_json`) asks for the document again."""
    if value is None or isinstance(value, (str, os.PathLike, CompressedDocument, Document)):
        return value
    if isinstance(value, dict) and NOT_SERIALISED in value:
        raise TypeError(
            f"this {adapter} was serialised with a {value[NOT_SERIALISED]} as its document, which JSON does not "
            f"hold: pass it again ({framework.pass_again})"
        )
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(item, framework.classes) for item in items):
        raise TypeError(f"{adapter}'s document is {DOCUMENT_SOURCES}, not {framework.named}: {framework.instead}")
    raise TypeError(f"{adapter}'s document is {DOCUMENT_SOURCES}; got {type(value).__name__}")


def refuse_unknown_fields(model: type[BaseModel], data: Any) -> Any:
    """`data`, the keyword arguments that make a `model`, when each names one of its fields; TypeError naming the
    others and the fields it takes otherwise: pydantic would drop them unseen (a misspelling, the core's
    `max_new_tokens`), and the adapter would answer with its defaults instead."""
    if isinstance(data, dict):
        taken = set(model.model_fields)
        unknown = sorted(str(name) for name in set(data) - taken)
        if unknown:
            raise TypeError(
                f"unexpected keyword argument(s) {', '.join(unknown)}: not a field of {model.__name__}, which takes "
                f"{', '.join(sorted(taken))}"
            )
    return data


class AdapterFields(Protocol):
    """The fields both adapters declare: what a call resolves its document and options from."""

    FRAMEWORK_DOCUMENTS: ClassVar[FrameworkDocuments]
    model: str | None
    document: Any
    document_text: str | None
    compression: CompressionConfig | None
    device: str | None
    dtype: str | None
    max_tokens: int
    temperature: float
    top_p: float
    stop: list[str] | None
    seed: int | None
    max_cache_tokens: int | None
    recall: float | int | None


def call_model_name(adapter: AdapterFields, kwargs: dict[str, Any]) -> str:
    """The name of the model a call answers with (`answering_model`), for traces and answer-cache keys: a document
    whose manifest cannot be read is refused when the call opens it, and named with the default model until then."""
    source, text = _call_source(adapter, kwargs)
    try:
        return answering_model(kwargs.get("model") or adapter.model, source, text, bound_engine(adapter))
    except (OSError, InfoKVError):
        return DEFAULT_MODEL


def bound_engine(adapter: AdapterFields) -> InfoKVEngine | None:
    """The engine of the adapter's own document when that is a `CompressedDocument`: the model the adapter answers
    with, which reads a call's file or text where neither the call nor the adapter names a model."""
    return adapter.document.engine if isinstance(adapter.document, CompressedDocument) else None


def token_ids(adapter: AdapterFields, text: str) -> list[int]:
    """`text`'s tokens by the adapter's model's own tokenizer (`answering_engine`: its weights load on first use; no
    document is read)."""
    source, document_text = _call_source(adapter, {})
    engine = answering_engine(adapter.model, source, document_text, adapter.device, adapter.dtype)
    return engine.prompt.ids(text, as_text=False)


DOCUMENT_OPTIONS = ("document", "document_text", "model", "compression")
"""The call kwargs that choose another document than the adapter's own."""


def _call_source(adapter: AdapterFields, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """(document, text) of one call: the call's over the adapter's, a per-call `document` replacing the adapter's
    `document_text`; a document no adapter takes is refused (`check_document`), a call's as the field's."""
    text = kwargs.get("document_text", adapter.document_text if "document" not in kwargs else None)
    if text is not None and not isinstance(text, str):  # the field's is checked by its type; a call's is not
        pages = ": join the pages' texts, or pass infokv_rag.documents.document_from_pages(...) as document="
        raise TypeError(
            f"{type(adapter).__name__}'s document_text is the document's text, a str; got {type(text).__name__}"
            + (pages if isinstance(text, (list, tuple)) else "")
        )
    source = kwargs.get("document", adapter.document)
    return check_document(source, type(adapter).__name__, adapter.FRAMEWORK_DOCUMENTS), text


def check_call_password(adapter: AdapterFields, kwargs: dict[str, Any], password: str | None) -> None:
    """Refuses (`EncryptedPDFError`) a wrong or missing `password` for the call's document when that is an
    encrypted PDF file, as `open_call_document` would: for a caller that may answer before it opens the document
    (LangChain's answer cache keys on no password, so a cached answer must not reach a call without the right one)."""
    source, text = _call_source(adapter, kwargs)
    if text is not None or source is None or isinstance(source, (CompressedDocument, Document)):
        return
    path = _document_path(os.fspath(source))
    if path.is_file():  # anything else holds no password: opening it says what it is
        stat = path.stat()
        _check_password(path, stat.st_mtime_ns, stat.st_size, password)


def as_secret(password: Any) -> Any:
    """A password field's value held as a `SecretStr` (a str given is wrapped; anything else is left to the field's
    type to refuse), so that no repr, dump or validation error shows it."""
    return SecretStr(password) if isinstance(password, str) else password


def revealed(password: str | SecretStr | None) -> str | None:
    """The text of a password field (`as_secret`), for the one place that opens the PDF with it."""
    return password.get_secret_value() if isinstance(password, SecretStr) else password


def fields_choice(adapter: AdapterFields) -> str:
    """What the fields' document depends on (its content, model, compression, device and dtype), as text."""
    choice = [
        document_identity(adapter.document, adapter.document_text),
        adapter.model,
        config_fields(adapter.compression),
        adapter.device,
        adapter.dtype,
    ]
    return json.dumps(choice, sort_keys=True)


class DocumentHold:
    """Where an adapter holds the document its own fields chose, once read: not only the process's shared cache,
    which evicts documents other adapters opened since, so that this one would read its own again on every call.

    An adapter keeps one as a private attribute, which a copy of it (pydantic's `model_copy`, as an adapter may make
    for a call's options) shares: give a copy whose fields choose another document its own."""

    def __init__(self) -> None:
        self._held: tuple[str, CompressedDocument] | None = None
        """(`fields_choice`, the document it chose): replaced whole, so that no thread reads half of it."""

    # A deep copy or a pickle of an adapter (a chain copied, shipped to a worker process) holds no document: it
    # reads its own on its first call. The document's engine holds locks and tensors, which made an adapter that
    # had answered once impossible to copy or pickle, where one that had not could be.
    def __deepcopy__(self, memo: dict[int, Any]) -> DocumentHold:
        return DocumentHold()

    def __reduce__(self) -> tuple[type[DocumentHold], tuple[()]]:
        return DocumentHold, ()

    def held(self, adapter: AdapterFields) -> CompressedDocument | None:
        """The document the adapter's fields chose and it read already; None before that, or once a field changed."""
        held = self._held
        return held[1] if held is not None and held[0] == fields_choice(adapter) else None

    def document(
        self, adapter: AdapterFields, kwargs: dict[str, Any], password: str | None, how_to_bind: str
    ) -> CompressedDocument:
        """The document of one of the adapter's calls (`open_call_document`), held when it is the fields' own (the
        call names none of `DOCUMENT_OPTIONS`) and read again once a field that chooses it changes. The password is
        checked on every call, as on a first read."""
        if any(key in kwargs for key in DOCUMENT_OPTIONS):
            return open_call_document(adapter, kwargs, password, how_to_bind)
        choice = fields_choice(adapter)
        held = self._held
        if held is not None and held[0] == choice:
            check_call_password(adapter, {}, password)
            return held[1]
        document = open_call_document(adapter, {}, password, how_to_bind)
        self._held = (choice, document)
        return document


def open_call_document(
    adapter: AdapterFields, kwargs: dict[str, Any], password: str | None, how_to_bind: str
) -> CompressedDocument:
    """The document of one call (`_call_source`: the call's `DOCUMENT_OPTIONS` over the adapter's fields);
    `password` opens an encrypted PDF; `how_to_bind` says, when there is no document, how the adapter takes one."""
    source, text = _call_source(adapter, kwargs)
    return open_document(
        source,
        text=text,
        model=kwargs.get("model") or adapter.model,
        config=kwargs.get("compression", adapter.compression),
        device=adapter.device,
        dtype=adapter.dtype,
        password=password,
        how_to_bind=how_to_bind,
        reader=bound_engine(adapter),
    )


# Generation ----------------------------------------------------------------------------------------


CALL_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "max_cache_tokens", "recall")
"""Generation settings an adapter holds as fields, each of which a call's kwargs may override."""

CALL_KWARGS = frozenset((*CALL_OPTIONS, *DOCUMENT_OPTIONS, "stop"))
"""Every kwarg a call takes: a misspelt option (or the core's `max_new_tokens`) must not pass unseen."""

NONE_MEANS_UNSET = frozenset({"max_tokens", "temperature", "top_p", "seed", "stop"})
"""Call options whose None is no value but the option left unset, as frameworks pass it (LangChain's
`invoke(max_tokens=None)`): the adapter's field holds. For the others None is a value that a call may set:
`recall` None is the document's recall, `max_cache_tokens` None no cap, `compression` None the cache as saved."""


def given_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's kwargs less the options it leaves unset (`NONE_MEANS_UNSET`)."""
    return {name: value for name, value in kwargs.items() if value is not None or name not in NONE_MEANS_UNSET}


def options_a_call_takes(adapter: Any) -> Any:
    """`adapter` as it is made (an after-validator of both adapters), once its fields are options every call takes:
    temperature=inf or recall=1.5 are refused then, not at every call."""
    call_options(adapter, {})
    return adapter


def call_options(
    adapter: AdapterFields, kwargs: dict[str, Any], stop: str | Sequence[str] | None = None
) -> GenerationOptions:
    """The generation options of one call: its kwargs over the adapter's fields (`CALL_OPTIONS`; `stop`, the
    framework's own argument, over a `stop` kwarg over the field), None leaving an option unset where it means
    nothing else (`given_options`); ConfigError for a kwarg that no call takes (`CALL_KWARGS`)."""
    unknown = sorted(set(kwargs) - CALL_KWARGS)
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; a call takes {', '.join(sorted(CALL_KWARGS))}")
    kwargs = given_options(kwargs)
    options = {name: kwargs.get(name, getattr(adapter, name)) for name in CALL_OPTIONS}
    if stop is None:
        stop = kwargs.get("stop", adapter.stop)
    check_count("max_tokens", options["max_tokens"], 1)
    return GenerationOptions.build(
        max_new_tokens=options["max_tokens"],
        temperature=options["temperature"],
        top_p=options["top_p"],
        stop=[s for s in ([stop] if isinstance(stop, str) else stop or ()) if s],  # a string is one sequence
        seed=options["seed"],
        max_cache_tokens=options["max_cache_tokens"],
        recall=options["recall"],
    )


def start_generation(document: CompressedDocument, turns: list[Turn], options: GenerationOptions) -> Generation:
    """`document.generate`, its refusal of an answer's length in the adapters' terms: they take `max_tokens` where
    the core takes `max_new_tokens`, which a call that followed the advice would be refused for."""
    try:
        return document.generate(turns, options)
    except AnswerRoomError as exc:
        raise exc.worded("max_tokens") from exc


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

    def token_counts(self) -> dict[str, int]:
        """The answer's token counts as OpenAI's usage (and the service's `/v1/chat/completions`) reports them: the
        document served from the cache is part of the prompt (`prompt_tokens` = `input_tokens`, `cached_tokens`
        of it), and the total is the prompt and the completion."""
        completion = self.usage.completion_tokens
        return {
            "prompt_tokens": self.input_tokens,
            "cached_tokens": self.usage.cached_tokens,
            "completion_tokens": completion,
            "total_tokens": self.input_tokens + completion,
        }

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
