"""Receiving an upload: bounded reading, checks before any model work, client-safe error messages.

Work on an upload is bounded before it is refused: bytes while receiving (`max_upload_bytes`), pages
before extraction (`max_pages`), characters before tokenization (`max_document_chars`), and tokenization
itself stops as soon as the text has passed the model's context window.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import logging
import re
import shutil
import unicodedata
import urllib.parse
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NamedTuple

from fastapi import Request
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ..config import CompressionConfig, parse_keep, parse_ratio_or_count
from ..errors import ConfigError, DocumentError, EncryptedPDFError
from ..scorers import method as scoring_method
from .errors import ServiceError, StorageError, from_core
from .schemas import FORM_FIELD_BYTES, UploadOptions
from .settings import Settings

if TYPE_CHECKING:
    from ..documents import Document
    from ..engine import InfoKVEngine
    from .registry import DocumentRecord, Registry

log = logging.getLogger(__name__)

_NAME_PUNCTUATION = frozenset("._()+ -")
_SUFFIX = re.compile(r"[A-Za-z0-9]{1,10}")
NAME_BYTES = 120
"""The most bytes of a display name in UTF-8 (a file name on disk holds 255)."""
_FIELDS = tuple(UploadOptions.model_fields)
_BITS_FIELDS = ("cold_bits", "stored_bits")


def _safe_in_a_name(char: str) -> bool:
    """Letters, marks and digits of every script (a Devanagari or Thai word holds combining marks), and a little
    punctuation that no file system or shell reads otherwise."""
    return char in _NAME_PUNCTUATION or unicodedata.category(char)[0] in "LMN"


def display_name(raw: str | None) -> str:
    """The client's file name reduced to one safe path component of at most `NAME_BYTES` bytes (only ever shown,
    never trusted), with its suffix kept: the upload is staged under it, and the loader reads a `.pdf` as a PDF
    where it would read another name as text. A name percent-encoded as RFC 7578 allows (aiohttp sends
    "%E5%90%88%E5%90%8C.pdf" for "合同.pdf") is decoded where its escapes are UTF-8."""
    raw = raw or ""
    if _PERCENT_ESCAPE.search(raw):
        with contextlib.suppress(UnicodeDecodeError):
            raw = urllib.parse.unquote(raw, errors="strict")
    name = unicodedata.normalize("NFC", raw.replace("\\", "/").rsplit("/", 1)[-1])
    kept = ("".join(run) if safe else "_" for safe, run in itertools.groupby(name, _safe_in_a_name))
    stem, dot, suffix = "".join(kept).rpartition(".")
    if not dot or not _SUFFIX.fullmatch(suffix):
        stem, suffix = f"{stem}{dot}{suffix}", ""
    suffix = f".{suffix}" if suffix else ""
    stem = stem.strip(" ._") or "upload"
    room = NAME_BYTES - len(suffix)  # an ASCII suffix: one byte a character
    return stem.encode()[:room].decode(errors="ignore").rstrip(" ._") + suffix


@dataclass
class StagedUpload:
    directory: Path
    path: Path
    name: str
    size: int
    options: UploadOptions

    def discard(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _copy_limited(source: IO[bytes], target: Path, limit: int) -> int:
    size = 0
    try:
        with open(target, "wb") as out:
            while block := source.read(1 << 20):
                size += len(block)
                if size > limit:
                    raise ServiceError(
                        413,
                        "file_too_large",
                        f"the upload is larger than the server's limit of {_mib(limit)}",
                    )
                out.write(block)
    except OSError as exc:
        raise StorageError("store the upload while receiving it", exc) from exc
    return size


_PERCENT_ESCAPE = re.compile("%[0-9A-Fa-f]{2}")
_EXTENDED_FILENAME = re.compile(rb""";\s*filename\*\s*=\s*"?([^;"\s]+)""", re.IGNORECASE)


def _extended_filename(disposition: bytes) -> str | None:
    """The file name a Content-Disposition gives as `filename*=charset'language'percent-encoded` (RFC 5987), decoded
    (its charset UTF-8 or ISO-8859-1); None when it gives none, or one that does not decode."""
    match = _EXTENDED_FILENAME.search(disposition)
    if match is None:
        return None
    charset, _, rest = match[1].decode("ascii", errors="replace").partition("'")
    _language, quoted, encoded = rest.partition("'")
    if not quoted or charset.lower() not in ("utf-8", "iso-8859-1"):
        return None
    try:
        return urllib.parse.unquote(encoded, encoding=charset, errors="strict")
    except UnicodeDecodeError:
        return None


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size} bytes"


_SEND_MULTIPART = (
    "send the document as multipart/form-data with the file in the 'file' field (e.g. curl -F file=@contract.pdf ...)"
)


class _CheckedMultiPartParser(MultiPartParser):
    """Starlette's multipart parser, which also tells whether the body reached its closing boundary: Starlette
    takes a body cut before it for a whole one, silently dropping the part it ended in (the file, usually); and
    which reads a file named by RFC 5987's `filename*` (python-multipart drops it: a part naming its file only so
    was read as a text field, and the upload refused as holding no file)."""

    complete = False

    def on_headers_finished(self) -> None:
        disposition = self._current_part.content_disposition or b""
        extended = _extended_filename(disposition)
        if extended is not None:
            self._current_part.content_disposition = disposition + b'; filename=""'  # read as a file
        super().on_headers_finished()
        if extended is not None and self._current_part.file is not None:
            self._current_part.file.filename = extended  # which RFC 6266 prefers to a plain filename

    def on_end(self) -> None:  # python-multipart's callback for the closing boundary (`--boundary--`)
        self.complete = True

    def close_files(self) -> None:
        """Closes the files of every part, also of the part the body ended in (which is in no form)."""
        for file in getattr(self, "_files_to_close_on_error", ()):
            file.close()


async def _arriving(
    body: AsyncGenerator[bytes, None], settings: Settings, shutting_down: asyncio.Event
) -> AsyncGenerator[bytes, None]:
    """The chunks of `body` as they arrive; 408 `upload_timeout` once none has for `upload_idle_seconds`, or once
    the body has taken `max_upload_seconds` in all (a byte sent within every idle interval would hold the upload's
    queue place for good); 503 `cancelled` once `shutting_down` is set."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.max_upload_seconds
    stopped = asyncio.ensure_future(shutting_down.wait())  # one waiter for the whole body, not one per chunk
    try:
        async with aclosing(body):
            while True:
                wait = min(settings.upload_idle_seconds, deadline - loop.time())
                arrived = asyncio.ensure_future(anext(body))
                try:
                    await asyncio.wait((arrived, stopped), timeout=max(wait, 0), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not arrived.done():
                        arrived.cancel()
                        # Until the read has unwound, the body cannot be closed ("asynchronous generator is already
                        # running").
                        await asyncio.wait((arrived,))
                if shutting_down.is_set() or stopped.done():
                    if not arrived.cancelled():
                        arrived.exception()  # retrieved: a read that ended as the stop came is not logged as lost
                    if not shutting_down.is_set():
                        stopped.result()  # the wait failed (no shutdown): its own error
                    raise shutting_down_refusal("the upload")
                if not arrived.done() or arrived.cancelled():
                    if wait < settings.upload_idle_seconds:
                        why = f"took longer than {settings.max_upload_seconds} s to arrive"
                    else:
                        why = f"stopped arriving: nothing of its body came for {settings.upload_idle_seconds} s"
                    raise ServiceError(
                        408, "upload_timeout", f"the upload {why}, and nothing of it was kept; send it again"
                    )
                try:
                    chunk = arrived.result()
                except StopAsyncIteration:
                    return
                yield chunk
    finally:
        stopped.cancel()


def shutting_down_refusal(what: str) -> ServiceError:
    """503 `cancelled` for `what`, begun as the server stops: nothing of it is kept."""
    return ServiceError(
        503,
        "cancelled",
        f"{what} was cancelled because the server is shutting down, and nothing of it was kept; send it again once "
        "the server is back",
        headers={"Connection": "close"},
    )


async def _read_form(request: Request, settings: Settings, shutting_down: asyncio.Event) -> FormData:
    """The upload's multipart form (one file, a few small fields), read whole; 400 `bad_request` for a body that
    is malformed, over the form's limits, or cut before its closing boundary, 408 `upload_timeout` for one that
    stops arriving or takes too long (`_arriving`; nothing of it is kept)."""
    # Room for a field sent as a file, so that it is refused naming it (422 `invalid_field`), not as "too many files".
    limits: dict[str, Any] = {
        "max_files": 1 + len(_FIELDS),
        "max_fields": len(_FIELDS),
        "max_part_size": FORM_FIELD_BYTES,
    }
    async with aclosing(_arriving(request.stream(), settings, shutting_down)) as stream:
        try:
            parser = _CheckedMultiPartParser(request.headers, stream, **limits)
        except TypeError:  # Starlette < 0.40 has no max_part_size (its default is 1 MiB)
            del limits["max_part_size"]
            parser = _CheckedMultiPartParser(request.headers, stream, **limits)
        try:
            form = await parser.parse()
        except MultiPartException as exc:
            raise _malformed_multipart(exc.message) from exc
        except ServiceError:  # stopped arriving: the parts received so far are dropped
            parser.close_files()
            raise
    if not parser.complete:
        await form.close()
        parser.close_files()
        raise ServiceError(
            400,
            "bad_request",
            "the multipart body ended before its closing boundary (--<boundary>--): the upload was cut short or is "
            "malformed, and nothing of it was kept; " + _SEND_MULTIPART,
        )
    return form


def _malformed_multipart(detail: str) -> ServiceError:
    """400 `bad_request` for a multipart body that cannot be read; the form's own limits keep their message."""
    if detail.startswith(("Too many", "Part exceeded")):
        return ServiceError(
            400, "bad_request", f"{detail} An upload has one file and at most the fields {', '.join(_FIELDS)}."
        )
    return ServiceError(
        400,
        "bad_request",
        f"the multipart body is malformed ({detail.rstrip('.')}), and nothing of it was kept; " + _SEND_MULTIPART,
    )


def require_multipart(request: Request) -> None:
    """415 `multipart_required` for an upload that is not multipart/form-data, before its queue place is taken."""
    content_type = request.headers.get("content-type", "")
    media_type = content_type.partition(";")[0].strip().lower()  # media types are case-insensitive
    if media_type != "multipart/form-data":  # not a prefix: "multipart/form-dataX" is another type
        raise ServiceError(415, "multipart_required", _SEND_MULTIPART)


async def receive_upload(
    request: Request, registry: Registry, settings: Settings, shutting_down: asyncio.Event
) -> StagedUpload:
    """Reads the multipart body (one file, a few small fields; `require_multipart` checked) into a private staging
    directory; 503 `cancelled` when the server begins to stop meanwhile."""
    form = await _read_form(request, settings, shutting_down)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ServiceError(422, "missing_file", "no file: send the document in the multipart field 'file'")
        unknown = sorted(set(form.keys()) - {"file", *_FIELDS})
        if unknown:
            raise ServiceError(
                422,
                "unknown_field",
                f"unknown form field {unknown[0][:40]!r}; an upload has the fields file, {', '.join(_FIELDS)}",
            )
        repeated = sorted(key for key in set(form.keys()) if len(form.getlist(key)) > 1)
        if repeated:
            # Which of two values was meant cannot be known: neither is taken.
            raise ServiceError(422, "repeated_field", f"the form field '{repeated[0]}' is sent more than once")
        fields: dict[str, str | None] = {}
        for name in _FIELDS:
            value = form.get(name)
            if value is not None and not isinstance(value, str):
                raise ServiceError(422, "invalid_field", f"the field '{name}' must be text, not a file")
            fields[name] = value.strip() if isinstance(value, str) and name != "password" else value
        options = upload_options(fields)
        name = display_name(upload.filename)
        try:
            directory = registry.staging_dir()
        except OSError as exc:
            raise StorageError("store the upload while receiving it", exc) from exc
        path = directory / name
        try:
            size = await run_in_threadpool(_copy_limited, upload.file, path, settings.max_upload_bytes)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
    finally:
        await form.close()
    return StagedUpload(directory, path, name, size, options)


def upload_options(fields: dict[str, str | None]) -> UploadOptions:
    """The upload's form fields (text; None or empty: not sent), numbers read as the command line reads them (an
    integer is a token count, `0.25` a ratio), validated against the bounds of the upload's schema; 422
    `invalid_option` naming the field."""
    values: dict[str, Any] = {}
    for name, text in fields.items():
        if not text:
            continue
        try:
            if name == "keep":
                values[name] = parse_keep(text, name)
            elif name == "recall":
                values[name] = parse_ratio_or_count(text, name)
            elif name in _BITS_FIELDS:
                values[name] = _bits(name, text)
            else:
                if name == "method":  # the schema's enum, which pydantic does not check
                    scoring_method(text)
                values[name] = text
        except ConfigError as exc:
            raise ServiceError(422, "invalid_option", str(exc), param=name) from exc
    try:
        # Strict: a number keeps the type it was read as (pydantic would take the ratio 1000.0 for the count 1000).
        return UploadOptions.model_validate(values, strict=True)
    except ValidationError as exc:
        raise _out_of_bounds(exc) from exc


_KINDS = {"constrained-float": "as a ratio", "constrained-int": "as a token count"}
"""What each member of a ratio-or-count field is, by the name pydantic gives it in an error's location."""


def _out_of_bounds(exc: ValidationError) -> ServiceError:
    """422 `invalid_option` for the first field that `UploadOptions` refuses, saying why for each way it is read."""
    errors = exc.errors()
    name = str(errors[0]["loc"][0])
    reasons: dict[str, None] = {}
    for error in errors:
        if error["loc"][0] == name:
            reason = error["msg"][:1].lower() + error["msg"][1:]
            kind = _KINDS.get(str(error["loc"][-1]))
            reasons[f"{kind}, {reason}" if kind else reason] = None
    return ServiceError(
        422, "invalid_option", f"the form field '{name}' is out of bounds: {'; '.join(reasons)}", param=name
    )


def compression_config(
    settings: Settings,
    method: str | None,
    keep: float | int | None,
    recall: float | int | None = None,
    cold_bits: int | None = None,
    stored_bits: int | None = None,
) -> CompressionConfig:
    """The config of an upload's options or of a record; None: the server's default."""
    given: dict[str, Any] = {"recall": recall, "cold_bits": cold_bits, "stored_bits": stored_bits}
    try:
        return CompressionConfig(
            method=method or settings.default_method,
            keep=keep if keep is not None else settings.default_keep,
            chunk_size=settings.ingest_chunk_size,
            **{name: value for name, value in given.items() if value is not None},
        )
    except ConfigError as exc:
        raise ServiceError(422, "invalid_option", str(exc)) from exc


def record_config(settings: Settings, record: DocumentRecord) -> CompressionConfig:
    """The config a document was uploaded with, to read it again (a restart, a lost cache, a takeover)."""
    return compression_config(settings, record.method, record.keep, record.recall, record.cold_bits, record.stored_bits)


def _bits(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be 4 or 8, not {text[:40]!r}") from None


def _pdf_page_count(path: Path, password: str | None) -> int | None:
    """Pages of a PDF, counted before any text is extracted (None when unknown: `load_document` then reports what
    stops it being read, such as damage or an encryption that `password` does not open)."""
    try:
        from pypdf import PdfReader

        from ..documents import PDF_HEADER_WINDOW, ends_as_pdf, opens_with, reads_as_pdf

        data = path.read_bytes()
        # Told apart as `load_document` tells them: whatever it reads as a PDF is counted first.
        if not reads_as_pdf(data[:PDF_HEADER_WINDOW], path.name) or not ends_as_pdf(data):
            return None  # text, or truncated: load_document says so
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted and not opens_with(reader, password):  # as `load_document` opens it
            return None
        return len(reader.pages)
    except Exception:  # noqa: BLE001 - load_document reports damage properly
        return None


def _too_many_pages(pages: int, settings: Settings) -> ServiceError:
    return ServiceError(
        413,
        "too_many_pages",
        f"the document has {pages} pages; this server reads at most {settings.max_pages}",
    )


class ParsedUpload(NamedTuple):
    document: Document
    tokens: int
    warnings: list[str]
    """What the loader warned about while reading the upload (pages skipped, stray bytes read as Windows-1252),
    for its uploader; without server paths."""


def _load(staged: StagedUpload, settings: Settings) -> tuple[Document, list[str]]:
    """`load_document` of the upload, and what it warned about (pages skipped, stray bytes read as Windows-1252),
    without server paths."""
    from ..documents import load_document

    document = load_document(
        staged.path, password=staged.options.password, content_limit=settings.max_pdf_content_bytes, warn=False
    )
    told = [_without_paths(message, staged) for message in document.load_warnings]
    for message in told:
        log.info("upload %s: %s", staged.name, message)
    return document, told


def parse_upload(staged: StagedUpload, settings: Settings, engine: InfoKVEngine) -> ParsedUpload:
    """The upload's text, token count and the loader's warnings about it, or a ServiceError that says exactly
    what is wrong with it."""
    pages = _pdf_page_count(staged.path, staged.options.password)
    if pages is not None and pages > settings.max_pages:
        raise _too_many_pages(pages, settings)
    try:
        document, load_warnings = _load(staged, settings)
    except DocumentError as exc:
        raise from_core(exc, _client_message(exc, staged)) from exc
    total_pages = len(document.pages) + len(document.skipped_pages)
    if total_pages > settings.max_pages:
        raise _too_many_pages(total_pages, settings)
    document = replace(document, source=staged.name)
    if len(document.text) > settings.max_document_chars:
        raise ServiceError(
            413,
            "too_many_characters",
            f"{staged.name} holds {len(document.text)} characters of text; this server "
            f"reads at most {settings.max_document_chars}; split the document",
        )
    tokens = engine.count_document_tokens(document.text)
    if tokens > engine.max_document_tokens:
        raise ServiceError(413, "document_too_long", engine.too_long(staged.name))
    return ParsedUpload(document, tokens, load_warnings)


def _without_paths(message: str, staged: StagedUpload) -> str:
    """A message of the loader about the staged upload, naming the file as the client named it (no server path)."""
    return message.replace(str(staged.directory) + "/", "").replace(str(staged.directory), "")


def _client_message(exc: DocumentError, staged: StagedUpload) -> str:
    """The core's message without server paths, and with advice that fits an HTTP client."""
    message = _without_paths(str(exc), staged)
    if isinstance(exc, EncryptedPDFError):
        if staged.options.password is None and "needs a password" in message:
            return (
                f"{staged.name} is encrypted: send its password in the form field 'password', "
                "or upload a decrypted copy"
            )
        if "Wrong password" in message:
            return f"wrong password for {staged.name}: check the form field 'password', or upload a decrypted copy"
    return message
