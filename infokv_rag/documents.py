"""PDF and text files, in-memory text and (page number, text) pairs -> `Document` (text plus page map), with
typed, actionable errors."""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import itertools
import logging
import os
import re
import shlex
import stat
import unicodedata
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from pypdf import PageObject, PasswordType, PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

from .errors import (
    ConfigError,
    CorruptPDFError,
    DocumentError,
    EmptyDocumentError,
    EncryptedPDFError,
    NoExtractableTextError,
    PDFContentLimitError,
    UnsupportedFormatError,
)
from .files import open_regular
from .pdf_damage import (
    damage_error,
    fails_checksum,
    missing_pages,
    page_list,
    page_problem,
    pypdf_detail,
    pypdf_reports,
    unreadable_text,
)
from .pdf_forms import draws_images, draws_nothing, page_text
from .pdf_limits import CONTENT_LIMIT, ContentMeter

__all__ = [
    "Document",
    "GarbledTextWarning",
    "Page",
    "PageExtractionWarning",
    "PAGE_SEPARATOR",
    "StrayBytesWarning",
    "document_from_pages",
    "document_from_text",
    "join_broken_words",
    "labels_told_apart",
    "load_document",
    "page_has_text",
    "repair_extracted_text",
]

PAGE_SEPARATOR = "\n\n"
"""What joins page texts into `Document.text`."""

PDF_SUFFIXES = frozenset({".pdf"})
TEXT_SUFFIXES = frozenset({".txt", ".md", ".markdown"})

# Acrobat accepts a header anywhere in the first 1024 bytes and a %%EOF anywhere in the last
# 1024; we use the same tolerances so that we accept what common viewers accept.
PDF_HEADER_WINDOW = 1024
_EOF_WINDOW = 1024
# The last 1024 bytes are counted before padding: NULs and whitespace that a transfer or a disk image left after the
# file (a file cut short ends in its content, not in padding). The same padding before a PDF's header is tolerated.
_PADDING = b"\x00\t\n\x0c\r "
_REVISION_START = re.compile(rb"\s*(?:\d+\s+\d+\s+obj\b|xref\b)")
"""How an update appended to a PDF begins (an object, or a cross-reference table): found right after the last
%%EOF, the file was cut inside the update. Other bytes there (a web server's error page, a comment) are junk that
viewers read past."""
_REPLACEMENT = "\ufffd"  # what pypdf reads a glyph as when it cannot map it to a character
_UTF8_BOM = b"\xef\xbb\xbf"
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
_UTF32_BOMS = (b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")  # the first begins as UTF-16's little-endian mark


def reads_as_pdf(head: bytes, name: str) -> bool:
    """Whether `load_document` reads a file named `name` whose first bytes are `head` (at least
    `PDF_HEADER_WINDOW` of them, or all) as a PDF: one starting with %PDF- whatever its name (after a UTF-8
    byte-order mark, whitespace or NULs, which a web server or a transfer may put before it and pypdf skips), and
    one named .pdf holding it in its first `PDF_HEADER_WINDOW` bytes. Other junk before the header is tolerated
    only in a file named .pdf: a text file that merely mentions "%PDF-" near its top must stay text."""
    window = head[:PDF_HEADER_WINDOW]
    if window.removeprefix(_UTF8_BOM).lstrip(_PADDING).startswith(b"%PDF-"):
        return True
    return Path(name).suffix.lower() in PDF_SUFFIXES and b"%PDF-" in window


# pypdf reports recoverable damage through `logging`. Without any handler configured, Python's
# last-resort handler would print those records to stderr; a NullHandler stops that while records
# still propagate to whatever logging the application sets up. `_load_pdf` also reads them while it loads a
# PDF (`pypdf_reports`), as one sign of damage among the checks it makes itself.
logging.getLogger("pypdf").addHandler(logging.NullHandler())


class PageExtractionWarning(UserWarning):
    """Some PDF pages were skipped, their text failing to extract or the page holding only images (a scan with
    no text layer); the rest of the document was loaded. `pages` are their numbers."""

    def __init__(self, message: str, pages: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.pages = pages


class GarbledTextWarning(UserWarning):
    """Some PDF pages were loaded from compressed content that fails its checksum: their text may not be what the
    file was written with. `pages` are their numbers."""

    def __init__(self, message: str, pages: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.pages = pages


class StrayBytesWarning(UserWarning):
    """A UTF-8 text file held a few bytes that are not UTF-8, each standing alone (a quote, dash or letter pasted
    from a Windows-1252 source); they were read as Windows-1252 characters and the rest as UTF-8. `offsets` are
    their byte offsets in the file."""

    def __init__(self, message: str, offsets: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.offsets = offsets


@dataclass(frozen=True)
class Page:
    """One page's text. `number` is the 1-based page number in the source file; `label` the source's own label
    for the page where it is not that number (a PDF's /PageLabels or a framework reader's page label: "iv", "A-1"),
    or None."""

    number: int
    text: str
    label: str | None = None

    @property
    def cited_as(self) -> str:
        """What a citation calls the page: its label, else its number."""
        return self.label if self.label is not None else str(self.number)


@dataclass(frozen=True)
class Document:
    """A document's text and where each page lies in it.

    `text` is the page texts joined by `PAGE_SEPARATOR`; plain text is one page numbered 1.
    `sha256` is the hex digest of the raw file bytes (or of the UTF-8 text given in memory).
    `skipped_pages` lists the PDF pages absent from `pages` although they have content: their text failed to
    extract, or they hold only images (scanned: they need OCR). Blank pages are absent from both.
    `load_warnings` are the messages of what loading the file warned about (`PageExtractionWarning`,
    `StrayBytesWarning`, each also emitted): for a caller that reports them, such as the service to an uploader,
    without catching warnings process-wide. No part of the layout or of equality.
    """

    text: str
    pages: tuple[Page, ...]
    source: str | None
    sha256: str
    skipped_pages: tuple[int, ...] = ()
    load_warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # page_of() and the page map are only right if text is exactly the joined pages.
        if self.text != PAGE_SEPARATOR.join(p.text for p in self.pages):
            raise ValueError("Document.text must equal the page texts joined by PAGE_SEPARATOR")

    def layout(self) -> dict[str, Any]:
        """Everything but the text, JSON-ready: page numbers, labels and lengths, source, sha256, skipped pages.

        A page's "label" is written only when it has one, so a document without labels has the layout (and the
        cache keys made from it) that it had before pages had labels."""
        return {
            "sha256": self.sha256,
            "source": self.source,
            "pages": [_page_layout(page) for page in self.pages],
            "skipped_pages": list(self.skipped_pages),
        }

    @classmethod
    def from_layout(cls, text: str, layout: dict[str, Any]) -> Document:
        """The document whose `text` and `layout()` these are."""
        pages, offset = [], 0
        for page in layout["pages"]:
            pages.append(
                Page(number=page["number"], text=text[offset : offset + page["chars"]], label=page.get("label"))
            )
            offset += page["chars"] + len(PAGE_SEPARATOR)
        return cls(
            text=text,
            pages=tuple(pages),
            source=layout["source"],
            sha256=layout["sha256"],
            skipped_pages=tuple(layout["skipped_pages"]),
        )

    @cached_property
    def page_spans(self) -> tuple[tuple[int, int], ...]:
        """(start, end) character offsets of each page in `text`, end exclusive, in page order."""
        spans: list[tuple[int, int]] = []
        start = 0
        for page in self.pages:
            end = start + len(page.text)
            spans.append((start, end))
            start = end + len(PAGE_SEPARATOR)
        return tuple(spans)

    @cached_property
    def _starts(self) -> list[int]:
        return [start for start, _ in self.page_spans]

    def page_of(self, char_offset: int) -> int:
        """Number of the page holding `text[char_offset]`.

        A separator between two pages belongs to the page before it; `len(text)` maps to the
        last page, so end-exclusive spans can be looked up too.
        """
        if not self.pages:
            raise ValueError("document has no pages")
        if not 0 <= char_offset <= len(self.text):
            raise IndexError(f"char_offset {char_offset} is outside the text (0..{len(self.text)})")
        index = bisect.bisect_right(self._starts, char_offset) - 1
        return self.pages[index].number


def _page_layout(page: Page) -> dict[str, Any]:
    layout: dict[str, Any] = {"number": page.number, "chars": len(page.text)}
    if page.label is not None:
        layout["label"] = page.label
    return layout


def is_blank(text: str) -> bool:
    """Whether `text` holds nothing to read: only whitespace, control or format characters (NUL, a tab, a
    zero-width space, a byte-order mark) and the other characters Unicode says to show as nothing (a variation
    selector, a Hangul filler; `_SHOWN_AS_NOTHING`), or nothing at all."""
    return all(
        char.isspace() or unicodedata.category(char) in ("Cc", "Cf") or _SHOWN_AS_NOTHING.match(char) for char in text
    )


_SHOWN_AS_NOTHING = re.compile(
    "[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]"
)
"""Unicode's default-ignorable code points that are no format character (the combining grapheme joiner, the Hangul
fillers, the Mongolian and other variation selectors), and the blank Braille pattern."""


def unpaired_surrogate(text: str) -> int | None:
    """Where `text` holds a lone UTF-16 surrogate (no character of Unicode text, and no tokenizer takes it),
    or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _check_text(text: object, where: str) -> str:
    """`text` if it is Unicode text (a str with no lone surrogate), else TypeError / DocumentError."""
    if not isinstance(text, str):
        raise TypeError(f"{where} must be str, not {type(text).__name__}")
    surrogate = unpaired_surrogate(text)
    if surrogate is not None:
        raise DocumentError(
            f"{where} holds a lone surrogate ({text[surrogate]!r} at character {surrogate}), which is "
            "not Unicode text: decode the document's bytes with their real encoding"
        )
    return text


def document_from_text(text: str, source: str | None = None) -> Document:
    """Wrap in-memory text as a one-page Document; line endings are normalised to LF."""
    _check_text(text, source or "The text")
    sha = hashlib.sha256(text.encode("utf-8")).hexdigest()
    body = text_as_read(text)
    if is_blank(body):
        where = source or "The text"
        raise EmptyDocumentError(
            f"{where} is empty or only whitespace and invisible characters (zero-width spaces, byte-order marks): "
            "there is nothing to answer questions from. Pass the document's text."
        )
    return Document(text=body, pages=(Page(1, body),), source=source, sha256=sha)


def text_as_read(text: str) -> str:
    """In-memory text as `document_from_text` reads it: without a byte-order mark, its line endings LF."""
    return _normalize_newlines(text.removeprefix("\ufeff"))


def page_has_text(text: str) -> bool:
    """Whether `document_from_pages` keeps a page of this text: something to read once repaired (not `is_blank`)."""
    return not is_blank(repair_extracted_text(text))


def document_from_pages(
    pages: Sequence[tuple[int, str]], source: str | None = None, labels: Sequence[str | None] | None = None
) -> Document:
    """A Document from (page number, text) pairs, e.g. one per page of a framework's PDF reader, and each page's
    `Page.label` (None: none). The text is repaired as `load_document` repairs a PDF's (`repair_extracted_text`,
    `join_broken_words`) but not re-spaced (a page may be markdown); pages with no text are left out. `sha256` is
    that of the joined text."""
    if labels is not None and len(labels) != len(pages):
        raise ValueError(f"{len(labels)} labels for {len(pages)} pages")
    kept = []
    for (number, text), label in zip(pages, labels or [None] * len(pages), strict=True):
        if page_has_text(_check_text(text, f"page {number} of {source or 'the documents'}")):
            kept.append(Page(number, repair_extracted_text(text).strip(), label))
    if not kept:
        raise EmptyDocumentError(f"{source or 'the documents'} hold no text to answer questions from")
    kept = _with_words_joined(kept)
    text = PAGE_SEPARATOR.join(page.text for page in kept)
    return Document(
        text=text, pages=tuple(kept), source=source, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest()
    )


def load_document(
    path: str | os.PathLike[str],
    password: str | None = None,
    *,
    content_limit: int = CONTENT_LIMIT,
    warn: bool = True,
) -> Document:
    """Read a PDF or text/markdown file into a Document.

    A file starting with `%PDF-` (after whitespace, NULs or a UTF-8 byte-order mark) is a PDF whatever its name;
    any other file that decodes as text is text. `password` opens encrypted PDFs and is ignored otherwise. A UTF-8
    file with a few stray Windows-1252 bytes is read with a `StrayBytesWarning` (see `_MAX_STRAY_BYTES`).
    `content_limit`: the decoded page content, in bytes, that reading a PDF may parse before it is refused with
    `PDFContentLimitError` (`pdf_limits.CONTENT_LIMIT`, 16 MiB, by default; raise it for manuals of many large
    drawings, knowing that pypdf parses about 4.5 us per byte of typeset text).
    What loading warned about is the document's `load_warnings`, and is also issued as warnings unless `warn` is
    False (a server that reads many uploads: Python keeps every distinct warning it issued for good, and its message
    names the file's path).
    """
    if isinstance(content_limit, bool) or not isinstance(content_limit, int) or content_limit < 1:
        raise ConfigError(f"content_limit must be a positive number of bytes, got {content_limit!r}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"expected the path of a PDF or text file, got {type(path).__name__}; for a Document already loaded "
            "use InfoKVEngine.ingest_document, for text in memory ingest_text"
        )
    p = Path(path)
    name = os.fspath(path)
    if not name:  # Path("") is the working directory
        raise FileNotFoundError("No such file: the document's path is empty")
    try:
        status = p.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"No such file: {name}") from None
    # Any other failure (a loop of symbolic links, no permission) is the system's own, as it says it.
    if stat.S_ISDIR(status.st_mode):
        raise IsADirectoryError(f"{name} is a directory; give the path of a PDF or text file")
    try:
        with open_regular(p) as handle:
            data = handle.read()
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # open_regular's refusal; any other error is the system's own
            raise
        raise UnsupportedFormatError(
            f"{name} is {_file_kind(p)}, not a regular file, so it cannot be read as a document "
            "(a pipe blocks its reader, a device may read without end). Save its content to a file and load that."
        ) from exc
    if not data:
        raise EmptyDocumentError(f"{name} is empty (0 bytes). Check that you picked the right file.")
    sha = hashlib.sha256(data).hexdigest()
    suffix = p.suffix.lower()

    if reads_as_pdf(data, p.name):
        return _load_pdf(data, name=name, sha=sha, password=password, content_limit=content_limit, warn=warn)
    if suffix in PDF_SUFFIXES:
        raise UnsupportedFormatError(
            f"{name} is named .pdf but is not a PDF (no %PDF- header): it {_describe(data)}. "
            "Download or export the PDF again."
        )
    text, strays = _read_text(data)
    if text is None or data.startswith(b"{\\rtf"):
        named = f" is named {suffix} but" if suffix in TEXT_SUFFIXES else ""
        raise UnsupportedFormatError(
            f"{name}{named} is not a supported document: it {_describe(data)}. "
            "Supported are PDF files and plain text or markdown (UTF-8, or a legacy encoding that can be "
            "detected such as Latin-1 or GB18030); "
            "export the document to PDF or plain text first."
        )
    body = _normalize_newlines(text)
    if is_blank(body):
        raise EmptyDocumentError(
            f"{name} contains only whitespace and invisible characters (zero-width spaces, byte-order marks): there "
            "is no text to answer questions from. "
            "Check that you picked the right file."
        )
    told = _warn([_stray_bytes_warning(name, data, strays)] if strays else [], stacklevel=3, emit=warn)
    return Document(text=body, pages=(Page(1, body),), source=name, sha256=sha, load_warnings=told)


def _warn(issued: Sequence[UserWarning], stacklevel: int, emit: bool) -> tuple[str, ...]:
    """Emits each warning of loading a file, where `emit` (`stacklevel`: counted from here to the caller of
    `load_document`), and returns their messages."""
    for warning in issued if emit else ():
        warnings.warn(warning, stacklevel=stacklevel)
    return tuple(str(warning) for warning in issued)


# --- text ------------------------------------------------------------------------------------


def _normalize_newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _file_kind(path: Path) -> str:
    """What kind of file that is not a regular one `path` is, phrased to follow 'is'."""
    mode = os.stat(path).st_mode
    for test, kind in (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"


def _decode_text(data: bytes) -> str | None:
    """Decode text bytes, or None when they are binary."""
    return _read_text(data)[0]


def _read_text(data: bytes) -> tuple[str | None, tuple[int, ...]]:
    """Decoded text bytes (None when they are binary or their encoding cannot be told), and the byte offsets of
    the stray Windows-1252 bytes read within UTF-8 text (`_utf8_with_stray_bytes`; usually none)."""
    if data.startswith(_UTF8_BOM):
        text = _text_or_none(data[3:], "utf-8")
        if text is None:  # the byte-order mark says UTF-8: a few stray bytes are read as in a file without one
            stray = _utf8_with_stray_bytes(data, marked=True)
            if stray is not None:
                return stray[0].removeprefix("\ufeff"), stray[1]
        return text, ()
    # Windows editors save "Unicode" text as UTF-16 with a BOM; without a BOM we do not guess.
    if data.startswith(_UTF16_BOMS):
        return _text_or_none(data, "utf-16"), ()
    text = _text_or_none(data, "utf-8")
    if text is not None:
        return _iso_2022(data) if data.isascii() and "\x1b$" in text else text, ()  # ISO-2022 is 7-bit
    if b"\x00" in data:
        return None, ()
    stray = _utf8_with_stray_bytes(data)
    if stray is not None:
        return stray
    if _mostly_utf8(data) is not None:
        # UTF-8 by majority, but for bytes that are no few stray characters: a legacy encoding's reading (charset
        # detection may find one, "dÃĐlai" in ISO-8859-10) would garble every accented letter. Refused (`_describe`).
        return None, ()
    return _decode_legacy(data), ()


# A UTF-8 file may hold a character that came from a Windows-1252 source (a smart quote 0x92 or an en dash 0x96
# pasted from a Windows application, an "é" typed in an editor set to cp1252): a byte that is not UTF-8 among valid
# UTF-8. Such a file is read as UTF-8 with those bytes read as cp1252 (and a StrayBytesWarning naming them) when
#  - each byte that is not UTF-8 stands alone: no two side by side. A word in a legacy encoding (cp1251, cp1250,
#    GB18030, ...) puts its high bytes in runs, and a UTF-8 character that lost a byte leaves the others together;
#  - each is a character of cp1252 (not one of the five bytes it leaves undefined, 0x81 0x8d 0x8f 0x90 0x9d);
#  - there are at most _MAX_STRAY_BYTES of them: a slip is a character or two pasted, and 8 allows a few slips in
#    one file. More, and a passage or the whole file is in another encoding, where reading it as cp1252 would be a
#    guess about that passage, not a slip repaired: the file is refused, the message counting the bytes and giving
#    the first one's offset, so that it can be saved as UTF-8;
#  - the file is UTF-8 by majority: it holds more multi-byte UTF-8 characters than such bytes (or starts with a
#    UTF-8 byte-order mark). A Western cp1252 file has accented letters that stand alone too, and two of its bytes
#    may happen to form a UTF-8 character ("ß“" is U+07D3); it has more of the former. A tie is not taken. Read byte
#    by byte, a file that is UTF-8 by majority never reads as Western text (`_reads_as_western`: every multi-byte
#    character is a run of 2-4 high bytes), so no file that was read as cp1252 reads otherwise.
_MAX_STRAY_BYTES = 8
_ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, as errors="surrogateescape" decodes it


def _utf8_with_escapes(data: bytes) -> tuple[str, list[int], int, int]:
    """`data` decoded as UTF-8 with each byte that is not UTF-8 as a lone surrogate U+DC80..U+DCFF (no valid UTF-8
    decodes to one); where the first `_MAX_STRAY_BYTES` + 1 of those stand in the text (a legacy file has one per
    letter: a list of them all took tens of bytes each); how many there are; and how many multi-byte UTF-8
    characters the text holds."""
    text = data.decode("utf-8", errors="surrogateescape")
    first = [match.start() for match in itertools.islice(_ESCAPED_BYTE.finditer(text), _MAX_STRAY_BYTES + 1)]
    count = len(text) - len(text.encode("utf-32-le", errors="ignore")) // 4  # UTF-32 drops the lone surrogates
    return text, first, count, len(text) - len(text.encode("ascii", errors="ignore")) - count


def _byte_offset(text: str, position: int) -> int:
    """The offset in the file of `text[position]`, for text decoded with errors="surrogateescape"."""
    return len(text[:position].encode("utf-8", errors="surrogateescape"))


def _utf8_with_stray_bytes(data: bytes, marked: bool = False) -> tuple[str, tuple[int, ...]] | None:
    """The text of UTF-8 bytes with a few stray Windows-1252 bytes (the rules above), and those bytes' offsets;
    None when the bytes are no such text. `marked`: `data` starts with a UTF-8 byte-order mark."""
    text, escaped, count, multibyte = _utf8_with_escapes(data)
    if not 0 < count <= _MAX_STRAY_BYTES or any(b - a == 1 for a, b in zip(escaped, escaped[1:], strict=False)):
        return None
    if not marked and multibyte <= count:
        return None
    try:
        replacements = bytes(ord(text[i]) - 0xDC00 for i in escaped).decode("cp1252")
    except UnicodeDecodeError:
        return None
    pieces, start = [], 0
    for position, replacement in zip(escaped, replacements, strict=True):
        pieces += [text[start:position], replacement]
        start = position + 1
    decoded = "".join([*pieces, text[start:]])
    if not _looks_like_text(decoded):
        return None
    return decoded, tuple(_byte_offset(text, position) for position in escaped)


def _stray_bytes_warning(name: str, data: bytes, offsets: tuple[int, ...]) -> StrayBytesWarning:
    count = len(offsets)
    read = ", ".join(f"0x{data[at]:02x} at {at} as {bytes([data[at]]).decode('cp1252')!r}" for at in offsets)
    return StrayBytesWarning(
        f"{name} is UTF-8 but for {count} stray byte{'s' if count > 1 else ''} that {'are' if count > 1 else 'is'} "
        f"not UTF-8 (the first at byte offset {offsets[0]}), read as Windows-1252, which a character pasted from "
        f"a Windows application often is: {read}. Check the text there; saving the file as UTF-8 ends this warning.",
        offsets,
    )


def _mostly_utf8(data: bytes) -> tuple[int, int] | None:
    """(how many bytes are not UTF-8, the offset of the first) for bytes that are UTF-8 text by majority (more
    multi-byte UTF-8 characters than bytes that are not UTF-8) but hold some; None for other bytes."""
    text, escaped, count, multibyte = _utf8_with_escapes(data)
    if not count or multibyte <= count or not _looks_like_text(_ESCAPED_BYTE.sub("", text)):
        return None
    return count, _byte_offset(text, escaped[0])


def _decode_legacy(data: bytes) -> str | None:
    """The text of bytes that are not UTF-8 (nor hold NULs) in a legacy encoding that can be told; None otherwise."""
    # Not UTF-8. A legacy Western file is the common case: cp1252 turns 0x80-0x9f into the quotes and
    # dashes such files mean; the five bytes it leaves undefined fall back to plain Latin-1. But any byte
    # string decodes as cp1252, so it is taken only when the result reads like Western text, and holds none
    # of the letters where Turkish cp1254 differs nor a character inside a word that no Western spelling puts
    # there; otherwise (GB18030, Shift-JIS, cp1251, cp1254, cp1250, ...) the encoding is detected, or the file
    # refused: never garbled.
    for encoding in ("cp1252", "latin-1"):
        text = _text_or_none(data, encoding)
        if text is not None:
            if not _CP1254_IN_CP1252.isdisjoint(text) or _symbol_inside_a_word(text):
                return _detect_legacy_encoding(data)
            return text if _reads_as_western(text) else _detect_legacy_encoding(data, western=text)
    return _detect_legacy_encoding(data)


# cp1254 (Turkish) is cp1252 but for these six bytes: cp1252's Icelandic letters are cp1254's Ğ İ Ş ğ ı ş. Only
# the words around them can tell an Icelandic text from a Turkish one.
_CP1254_IN_CP1252 = frozenset("\u00d0\u00dd\u00de\u00f0\u00fd\u00fe")


def _reads_as_western(text: str) -> bool:
    """Accented letters in Western text stand mostly alone between ASCII letters ("préavis", "Straße");
    the bytes of a multi-byte or Cyrillic text, read as cp1252, come in runs ("Í¨Öª")."""
    non_ascii = adjacent = 0
    previous_non_ascii = False
    for char in text:
        is_non_ascii = ord(char) > 0x7F
        non_ascii += is_non_ascii
        adjacent += is_non_ascii and previous_non_ascii
        previous_non_ascii = is_non_ascii
    return adjacent <= 0.3 * non_ascii


def _symbol_inside_a_word(text: str) -> bool:
    """Whether a character beyond ASCII stands inside a word as no Western spelling has it: a symbol, a superscript,
    an inverted or opening mark between two letters (Polish or Czech letters in cp1252: "P³atnoœæ" for
    "Płatność", "u¿ytkowego" for "użytkowego"), or a capital between two small letters (a DOS or Mac text in
    cp1252: "KŸndigung" for "Kündigung", "d‚lai" for "délai")."""
    for index in range(1, len(text) - 1):
        before, char, after = text[index - 1], text[index], text[index + 1]
        if ord(char) <= 0x7F or not (before.isalpha() and after.isalpha()):
            continue
        if unicodedata.category(char) in _NOT_INSIDE_A_WORD or char in "\u00a1\u00bf":
            return True
        if char.isupper() and before.islower() and after.islower():
            return True
    return False


_NOT_INSIDE_A_WORD = frozenset({"Sc", "Sk", "Sm", "So", "No", "Ps"})


# How much mojibake (charset-normalizer's chaos, 0-1) a reading may hold, and how much more coherent (its
# letters' fit to a language, 0-1; 0 where too few letters to tell) the best reading must be than any other
# that reads the bytes as different text.
_MAX_CHAOS = 0.1
_COHERENCE_MARGIN = 0.1


def _detect_legacy_encoding(data: bytes, western: str | None = None) -> str | None:
    """The text of a non-UTF-8 file when its encoding can be told; None (refused) otherwise.

    Told means that one reading stands out, or that `western` (the cp1252 reading, when it may be one) is among
    the readings that do best: a short text decodes cleanly in several encodings, equally (in)coherent
    ("Срок: 30 дней." in cp1251 reads as Korean in johab), and taking the first would garble it; when
    "Größe: 5 m" reads as well in cp1250 (the same text) as in mac_iceland, the Western reading is the common case.
    """
    try:
        from charset_normalizer import from_bytes
    except ImportError:  # pragma: no cover - a dependency; without it such files are refused, not guessed
        return None
    # Best first; a reading mostly in half-width katakana is single-byte text (KOI8-R, cp1251) read as Shift-JIS.
    readings = [reading for reading in from_bytes(data) if not _halfwidth_kana(str(reading))]
    best = readings[0] if readings else None
    if best is None or best.chaos > _MAX_CHAOS:
        return None
    contenders = {
        str(reading)
        for reading in readings
        if reading.chaos <= _MAX_CHAOS and best.coherence - reading.coherence < _COHERENCE_MARGIN
    }
    if len(contenders) > 1:
        return western if western in contenders else None
    return _text_or_none(data, best.encoding)


def _iso_2022(data: bytes) -> str | None:
    """The text of 7-bit bytes that switch to a CJK character set with escape sequences (ESC $ ...; e-mail's
    ISO-2022-JP, ISO-2022-KR), which read as ASCII with the escapes left in; None where they do not decode so."""
    encoding = "iso2022_kr" if b"\x1b$)C" in data else "iso2022_jp_2"
    return _text_or_none(data, encoding)


def _halfwidth_kana(text: str) -> bool:
    """Whether half-width katakana (U+FF61-U+FF9F, which Japanese text written since the 1990s hardly uses) are most
    of the characters beyond ASCII."""
    beyond_ascii = len(text) - len(text.encode("ascii", errors="ignore"))
    return 2 * sum(1 for char in text if "\uff61" <= char <= "\uff9f") > beyond_ascii


def _text_or_none(data: bytes, encoding: str) -> str | None:
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError:
        return None
    return text if _looks_like_text(text) else None


# C0/C1 control characters except tab, newline, vertical tab, form feed, carriage return and ESC
# (ANSI colour codes in logs).
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0e-\x1a\x1c-\x1f\x7f-\x9f]")


def _looks_like_text(text: str) -> bool:
    # Binary that happens to decode (a file of zero bytes is valid UTF-8) is full of control
    # characters; real text has next to none beyond tab, newline and form feed.
    if "\x00" in text:
        return False
    controls = len(_CONTROL_CHARS.findall(text))
    return controls <= max(1, len(text) // 100)


_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", "is a ZIP container (a .docx, .xlsx, .odt, .epub or .zip file)"),
    (b"\xd0\xcf\x11\xe0", "is a legacy Microsoft Office file (.doc, .xls, .ppt)"),
    (b"{\\rtf", "is a Rich Text Format (.rtf) file"),
    (b"\x89PNG", "is a PNG image (it needs OCR, e.g. ocrmypdf after converting it to PDF)"),
    (b"\xff\xd8\xff", "is a JPEG image (it needs OCR, e.g. ocrmypdf after converting it to PDF)"),
    (b"GIF8", "is a GIF image"),
    (b"II*\x00", "is a TIFF image (it needs OCR, e.g. ocrmypdf)"),
    (b"MM\x00*", "is a TIFF image (it needs OCR, e.g. ocrmypdf)"),
    (b"\x1f\x8b", "is gzip-compressed; decompress it first"),
    (b"7z\xbc\xaf", "is a 7-Zip archive; extract it first"),
)


def _describe(data: bytes) -> str:
    """What the bytes look like, phrased to follow 'it'."""
    for signature, what in _SIGNATURES:
        if data.startswith(signature):
            return what
    if data.startswith((*_UTF16_BOMS, *_UTF32_BOMS)):
        return _describe_marked_unicode(data)
    head = data[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "looks like an HTML page (often a failed or blocked download)"
    if b"\x00" in data:  # no text holds NUL bytes, so they say what went wrong
        nuls = _describe_nuls(data)
        if nuls is not None:
            return nuls
    if _decode_text(data) is not None:
        return "is plain text"
    mostly_utf8 = _mostly_utf8(data)
    if mostly_utf8 is not None:
        count, first = mostly_utf8
        bytes_are = "1 byte that is" if count == 1 else f"{count} bytes that are"
        return (
            f"is UTF-8 text except for {bytes_are} not UTF-8 (the first at byte offset {first}), which cannot be "
            f"read as a few stray Windows-1252 characters (at most {_MAX_STRAY_BYTES}, each standing alone, each a "
            "Windows-1252 character): save it as UTF-8, converting those bytes from the encoding they came in"
        )
    # Read as text in some single-byte encoding: cp1252 makes characters of the bytes where Latin-1 has controls.
    if any(_text_or_none(data, encoding) is not None for encoding in ("cp1252", "latin-1")):
        return "looks like text in an encoding that could not be determined (not UTF-8); save it as UTF-8"
    return "looks like binary data of an unknown format"


def _describe_marked_unicode(data: bytes) -> str:
    """What bytes that start with a UTF-16 or UTF-32 byte-order mark, and were not read as text, hold: phrased to
    follow 'it', and not as "NUL bytes" to delete (UTF-16 holds one beside every ASCII character)."""
    if data.startswith(_UTF32_BOMS):
        return "is UTF-32 text (its byte-order mark says so), which is not read here: save it as UTF-8"
    if len(data) % 2:
        return "is UTF-16 text (its byte-order mark says so) cut short inside its last character: get a whole copy"
    text = data.decode("utf-16", errors="replace")
    if "\x00" in text:
        return (
            f"is UTF-16 text holding {text.count(chr(0))} NUL character(s) (the first at character "
            f"{text.index(chr(0))}), which no text holds: save it again as UTF-8 without them"
        )
    return "is UTF-16 text (its byte-order mark says so) that does not read as text: save it again as UTF-8"


def _describe_nuls(data: bytes) -> str | None:
    """What the NUL bytes in `data` say, phrased to follow 'it'; None when it is no text with or without them."""
    count = data.count(b"\x00")
    # UTF-16 holds a NUL beside each ASCII character: at odd offsets in little-endian, even in big-endian.
    odd = data[1::2].count(b"\x00")
    for encoding, on_parity in (("utf-16-le", odd), ("utf-16-be", count - odd)):
        if on_parity >= max(1, len(data) // 4) and _text_or_none(data[: len(data) // 2 * 2], encoding) is not None:
            return (
                f"looks like UTF-16 without a byte-order mark ({encoding[-2:].upper()}), which cannot be told "
                "from binary data for sure: save it as UTF-8 (or as UTF-16 with a byte-order mark)"
            )
    rest = data.replace(b"\x00", b"")
    if rest.strip() and _decode_text(rest) is not None:
        plural = "byte" if count == 1 else "bytes"
        first = data.index(b"\x00")
        return (
            f"is text except for {count} NUL {plural} (the first at byte offset {first}), which "
            "no text holds: remove them (e.g. `tr -d '\\000' < in.txt > out.txt`) or save the file again as UTF-8"
        )
    return None


# --- PDF -------------------------------------------------------------------------------------


_LIGATURES = str.maketrans(
    {"\ufb00": "ff", "\ufb01": "fi", "\ufb02": "fl", "\ufb03": "ffi", "\ufb04": "ffl", "\ufb05": "st", "\ufb06": "st"}
)
_HSPACE = re.compile(r"[ \t\u00a0\u2000-\u200a\u202f\u205f\u3000\f\v]+")
_MANY_NEWLINES = re.compile(r"\n{3,}")
_SOFT_BREAK = re.compile(r"\u00ad[ \t]*\n")
_DROPPED = dict.fromkeys(map(ord, "\x00\u00ad\u200b\u2060\ufeff"))


def repair_extracted_text(text: str) -> str:
    """Text as PDF extraction leaves it, repaired: line endings as LF, NULs, soft hyphens and invisible breaks
    (zero-width space, word joiner, a stray byte-order mark) dropped, ligatures spelt out ("\ufb01" -> "fi"), so
    that the model (and citation matching) reads the words themselves: "3\u200b150" is 3150. The zero-width
    joiner and non-joiner stay: Persian, Indic scripts and emoji sequences spell with them."""
    # A soft hyphen ending a line marks where a word was broken: the word goes on after the line break.
    text = _SOFT_BREAK.sub("", _normalize_newlines(text))
    return text.translate(_DROPPED).translate(_LIGATURES)


# A word broken across two lines by a hyphen: its head (from a word's start: a match tried at every letter of a
# long run would take quadratic time) ends one line, its tail starts the next; `suffix` is the rest of the tail's
# non-blank run.
_LINE_BREAK_AT_HYPHEN = r"[-\u2010][ \t]*\n"
_BROKEN_WORD = re.compile(
    rf"(?<![^\W\d_])(?P<head>[^\W\d_]+){_LINE_BREAK_AT_HYPHEN}(?P<tail>[^\W\d_]+)(?P<suffix>\S*)(?P<space>[ \t]*)"
)
# A word broken on more than two lines ("Gewähr-" "leistungs-" "frist"), whose pieces are known whole together only.
_BROKEN_TWICE = re.compile(
    rf"(?<![^\W\d_])(?P<pieces>[^\W\d_]+(?:{_LINE_BREAK_AT_HYPHEN}[^\W\d_]+){{2,}})(?P<suffix>\S*)(?P<space>[ \t]*)"
)
_WORD = re.compile(r"[^\W\d_]+")
# "short- and long-term": a hyphen left hanging for the word after the conjunction, not a broken word.
_CONJUNCTIONS = frozenset({"and", "or", "nor", "to", "und", "oder", "bis", "et", "ou", "y", "o", "e", "en", "of"})
_JOIN_PASSES = 3  # a word broken twice that is not known whole ("Gewähr-" "leistungs-" "frist") takes a pass per break


def join_broken_words(texts: Sequence[str]) -> list[str]:
    """`texts` (the pages of one document) with every word that a line break split at a hyphen read across the
    break again ("termi-\nnation" -> "termination"), so that the model reads the word, not two fragments.

    Justified text breaks words at a hyphen it adds; a compound ("follow-up", "acme-corp.com") keeps its own, and
    a hyphen cannot tell which it is. So the document decides: the word goes whole where the document writes it
    whole elsewhere (a contract's "termination", "Agreement"), and otherwise keeps its hyphen ("follow-up",
    "termi-nation"), which loses nothing. Left as they are: a capital or digit after the break (a new item) unless
    the word is in capitals throughout ("LIA-" "BILITY"), a conjunction ("short-" "and long-term"), and the lines
    of a fenced Markdown code block (```, ~~~), whose line breaks are the code's own. The rest of the tail's line
    starts a line of its own."""
    words = {word.lower() for text in texts for word in _WORD.findall(text)}

    def breaks_a_word(head: str, tail: str) -> bool:
        capitals = len(head) > 1 and head.isupper() and tail.isupper()  # "LIA-" "BILITY" in a heading
        return (tail[0].islower() or capitals) and tail.lower() not in _CONJUNCTIONS

    def rest_of_line(match: re.Match[str]) -> str:
        # Spaces that end the tail's line are dropped: its own line break follows.
        ends_line = match.string[match.end() : match.end() + 1] in ("", "\n")
        return match["suffix"] + ("\n" if match["space"] and not ends_line else "")

    def rejoin(match: re.Match[str]) -> str:
        head, tail = match["head"], match["tail"]
        if not breaks_a_word(head, tail):
            return match[0]
        word = head + tail if (head + tail).lower() in words else f"{head}-{tail}"
        return word + rest_of_line(match)

    def rejoin_whole(match: re.Match[str]) -> str:
        # Only the whole word is looked up: the word-by-word passes below would judge "Gewährleistungs" and
        # "leistungsfrist", which no document writes, and keep both hyphens.
        pieces = re.split(_LINE_BREAK_AT_HYPHEN, match["pieces"])
        word = "".join(pieces)
        if word.lower() not in words or not all(map(breaks_a_word, pieces, pieces[1:])):
            return match[0]
        return word + rest_of_line(match)

    def rejoined(prose: str) -> str:
        prose = _BROKEN_TWICE.sub(rejoin_whole, prose)
        for _ in range(_JOIN_PASSES):
            prose, count = _BROKEN_WORD.subn(rejoin, prose)
            if not count:
                break
        return prose

    return ["".join(part if code else rejoined(part) for code, part in _fenced_parts(text)) for text in texts]


_FENCE = re.compile(r" {0,3}(`{3,}|~{3,})")


def _fenced_parts(text: str) -> list[tuple[bool, str]]:
    """`text` cut into (is code, part) pieces that join back to it: a fenced code block (from its opening fence
    line to its closing one, or to the end if it is never closed) is code, the rest prose."""
    parts: list[tuple[bool, str]] = []
    part: list[str] = []
    fence: str | None = None
    for line in text.splitlines(keepends=True):
        marker = _FENCE.match(line)
        if fence is None and marker:
            parts.append((False, "".join(part)))
            part, fence = [line], marker[1]
            continue
        part.append(line)
        if fence is not None and marker and marker[1].startswith(fence):
            parts.append((True, "".join(part)))
            part, fence = [], None
    parts.append((fence is not None, "".join(part)))
    return parts


def _with_words_joined(pages: Sequence[Page]) -> list[Page]:
    """`pages` with their broken words joined (`join_broken_words`, which reads the whole document's spelling)."""
    joined = join_broken_words([page.text for page in pages])
    return [replace(page, text=text) for page, text in zip(pages, joined, strict=True)]


def _clean_page_text(text: str) -> str:
    """Repair (`repair_extracted_text`), then collapse runs of spaces and blank lines; paragraph breaks survive
    as one blank line."""
    # A font's ToUnicode map may send a glyph to half of a surrogate pair: the pairs are joined, a lone half is
    # unreadable (U+FFFD, which `unreadable_text` judges), never text no encoder takes.
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    lines = [_HSPACE.sub(" ", line).strip() for line in repair_extracted_text(text).split("\n")]
    return _MANY_NEWLINES.sub("\n\n", "\n".join(lines)).strip()


def _repair_hint(name: str) -> str:
    return (
        "Download or export it again; if that is impossible, try repairing it, "
        f"e.g. `qpdf {shlex.quote(name)} repaired.pdf` or `mutool clean {shlex.quote(name)} repaired.pdf`, and load "
        "the repaired file."
    )


def ends_as_pdf(data: bytes) -> bool:
    """Whether `data` ends as a whole PDF does: a %%EOF in its last `_EOF_WINDOW` bytes before trailing padding,
    with no part of a revision after it. A file cut short loses its last %%EOF, and pypdf (strict=False) can
    sometimes rebuild the cross-reference table of such a file and would then silently return partial content, so
    `load_document` refuses a PDF without it; one cut inside an update appended to it (a page added, a form filled,
    a signature) still ends in the older revision's %%EOF, followed by the update's objects."""
    end = _end_before_padding(data)
    tail = data[max(0, end - _EOF_WINDOW) : end]
    last = tail.rfind(b"%%EOF")
    return last >= 0 and _REVISION_START.match(tail, last + len(b"%%EOF")) is None


def _unended(data: bytes, name: str) -> str:
    """Why `ends_as_pdf` refused `data`: cut short, or bytes appended after a %%EOF further back than viewers look
    (a mail gateway's banner, a web server's page), which may follow a whole file or the part of one left by a cut."""
    last = data.rfind(b"%%EOF")
    end = last + len(b"%%EOF")
    if last < 0 or _REVISION_START.match(data, end) is not None:
        return (
            f"{name} is truncated: it does not end with a %%EOF marker after its last part ({len(data)} bytes), so "
            "the download or copy was probably cut short. " + _repair_hint(name)
        )
    end += 2 if data[end : end + 2] == b"\r\n" else int(data[end : end + 1] in (b"\r", b"\n"))  # its line end
    return (
        f"{name} does not end as a PDF: {len(data) - end} bytes that are no part of a PDF follow its last %%EOF "
        f"marker, more than the {_EOF_WINDOW} that viewers read past (bytes appended to the file, such as a mail "
        "gateway's banner, or what is left of a file cut short). If the file is whole, remove them "
        f"(`head -c {end} {shlex.quote(name)} > trimmed.pdf`) and load the trimmed file; otherwise download or export "
        "it again."
    )


def opens_with(reader: PdfReader, password: str | None) -> bool:
    """Whether an encrypted PDF opens as `load_document` opens it: with `password`, else with the empty user password.
    An owner-password-only file opens so, as in a viewer, whatever password a batch passes to every file: a wrong
    one only matters to a file that needs one. pypdf's errors (a missing crypto library, damage) are the caller's."""
    return any(reader.decrypt(each) != PasswordType.NOT_DECRYPTED for each in dict.fromkeys((password or "", "")))


def _open_pdf(data: bytes, name: str, password: str | None) -> PdfReader:
    if not ends_as_pdf(data):
        raise CorruptPDFError(_unended(data, name))
    try:
        # The password goes to decrypt() below: pypdf refuses one for an unencrypted file.
        reader = PdfReader(io.BytesIO(data), strict=False)
        encrypted = reader.is_encrypted
    except DependencyError as exc:
        raise _missing_crypto(name, exc) from exc
    except FileNotDecryptedError as exc:
        raise _needs_password(name) from exc
    except MemoryError:
        raise
    except Exception as exc:
        # pypdf raises assorted built-in exceptions (KeyError, ValueError, ...) on malformed
        # input, not only PdfReadError.
        raise CorruptPDFError(
            f"{name} is damaged and cannot be parsed as a PDF ({pypdf_detail(exc)}). " + _repair_hint(name)
        ) from exc
    if not encrypted:
        return reader
    try:
        opened = opens_with(reader, password)
    except DependencyError as exc:
        raise _missing_crypto(name, exc) from exc
    except NotImplementedError as exc:
        raise EncryptedPDFError(
            f"{name} uses an encryption scheme that cannot be opened here ({pypdf_detail(exc)}). "
            "Remove the encryption with the tool that made it, or e.g. "
            f"`qpdf --password=... --decrypt {shlex.quote(name)} decrypted.pdf`, and load the decrypted file."
        ) from exc
    except Exception as exc:
        raise CorruptPDFError(
            f"{name} is encrypted and its encryption data is damaged ({pypdf_detail(exc)}). " + _repair_hint(name)
        ) from exc
    if not opened:
        if password is None:
            raise _needs_password(name)
        raise EncryptedPDFError(
            f"Wrong password for {name}: it is neither the user nor the owner password. "
            "Check it and pass the right one with password=... (command line: --password)."
        )
    return reader


def _end_before_padding(data: bytes, step: int = 1 << 16) -> int:
    """Where `data` ends without its trailing `_PADDING`, found a slice at a time (stripping the whole of a large
    file would copy it)."""
    end = len(data)
    while end > 0:
        piece = data[max(0, end - step) : end]
        kept = len(piece.rstrip(_PADDING))
        if kept:
            return end - len(piece) + kept
        end -= len(piece)
    return 0


def _needs_password(name: str) -> EncryptedPDFError:
    return EncryptedPDFError(
        f"{name} is encrypted and needs a password. Pass it with password=... (load_document, "
        "InfoKVEngine.ingest and the LangChain and LlamaIndex adapters take it) or on the command line with --password."
    )


def _missing_crypto(name: str, exc: BaseException) -> EncryptedPDFError:
    return EncryptedPDFError(
        f"{name} is AES-encrypted and decrypting it needs the 'cryptography' package "
        f"({pypdf_detail(exc)}). Install it with: pip install 'pypdf[crypto]'"
    )


def _load_pdf(data: bytes, *, name: str, sha: str, password: str | None, content_limit: int, warn: bool) -> Document:
    with pypdf_reports() as reports:
        reader = _open_pdf(data, name, password)
        try:
            page_count = len(reader.pages)
        except MemoryError:
            raise
        except Exception as exc:
            raise CorruptPDFError(
                f"{name} is damaged: its page tree cannot be read ({pypdf_detail(exc)}). " + _repair_hint(name)
            ) from exc
        missing = missing_pages(reader, page_count)
        if page_count == 0 and missing is None:
            raise EmptyDocumentError(f"{name} is a PDF with no pages. Check that you picked the right file.")

        labels = _page_labels(reader, page_count)
        pages: list[Page] = []
        failed: list[int] = []
        scanned: list[int] = []
        garbled: list[int] = []
        damaged: dict[int, str] = {}
        first_error: BaseException | None = None
        checked: dict[tuple[int, int], tuple[bool, str] | None] = {}
        meter = ContentMeter(name, content_limit)
        for index in range(page_count):
            seen = len(reports.records)
            page: PageObject | None = None
            error: BaseException | None = None
            try:
                page = reader.pages[index]
                meter.charge(page, index + 1)
                raw = page_text(page)
            except (MemoryError, PDFContentLimitError):
                raise
            except Exception as exc:
                error = exc
            problem = page_problem(page, reports.records[seen:], checked) if page is not None else None
            if problem is not None and problem[0]:
                # Text from damaged content is partial at best: the page is reported, never loaded.
                damaged[index + 1] = problem[1]
                continue
            if error is not None or problem is not None:
                # One content stream pypdf cannot read (an unsupported filter, a malformed stream) should not
                # cost the user the whole document.
                failed.append(index + 1)
                first_error = first_error or error or PdfReadError(f"its content {problem[1] if problem else ''}")
                continue
            assert page is not None
            text = _clean_page_text(raw or "")
            blank = is_blank(text)
            # A page read as nothing, or with U+FFFD, may have failed to extract without a word from pypdf (content
            # cut short, a font its resources lost): such a page is skipped and named, never loaded as blank or
            # as replacement characters.
            unreadable = unreadable_text(page) if blank or _REPLACEMENT in text else None
            if unreadable is not None:
                failed.append(index + 1)
                first_error = first_error or PdfReadError(unreadable)
            elif not blank:
                pages.append(Page(index + 1, text, labels[index]))
                if fails_checksum(page):
                    garbled.append(index + 1)
            elif draws_images(page):
                scanned.append(index + 1)

    if damaged or missing is not None:
        raise damage_error(name, page_count, damaged, missing)
    if not pages:
        if failed:
            assert first_error is not None
            raise CorruptPDFError(
                f"{name} is damaged: text extraction failed on {page_list(failed)} "
                f"({pypdf_detail(first_error)}) and no other page has text. " + _repair_hint(name)
            )
        if not scanned and all(draws_nothing(reader.pages[index]) for index in range(page_count)):
            raise EmptyDocumentError(
                f"{name}'s {page_count} page(s) are blank: they draw nothing. Check that you picked the right file."
            )
        raise NoExtractableTextError(
            f"{name} has {page_count} page(s) but no extractable text: it looks scanned or image-only, "
            f"so it needs OCR first, e.g. `{_ocr_command(name)}`, then load the OCR'd file."
        )
    issued: list[UserWarning] = []
    if failed:
        assert first_error is not None
        issued.append(
            PageExtractionWarning(
                f"{name}: skipped {page_list(failed)} of {page_count}: text extraction failed "
                f"({pypdf_detail(first_error)}). The other pages were loaded; questions about "
                "the skipped pages cannot be answered.",
                tuple(failed),
            )
        )
    if scanned:
        issued.append(
            PageExtractionWarning(
                f"{name}: skipped {page_list(scanned)} of {page_count}: they hold only images, no text layer "
                "(scanned). The other pages were loaded; to answer questions about the skipped ones too, OCR the "
                f"file first, e.g. `{_ocr_command(name, '--skip-text')}`, and load the OCR'd file.",
                tuple(scanned),
            )
        )
    if garbled:
        issued.append(
            GarbledTextWarning(
                f"{name}: the compressed content of {page_list(garbled)} fails its checksum, so its text may have "
                "been changed by damage to the file (or its producer wrote a wrong checksum); it was loaded. Compare "
                f"{'it' if len(garbled) == 1 else 'them'} with the PDF in a viewer, or get an undamaged copy.",
                tuple(garbled),
            )
        )
    pages = _with_words_joined(pages)
    text = PAGE_SEPARATOR.join(page.text for page in pages)
    skipped = tuple(sorted(failed + scanned))
    told = _warn(issued, stacklevel=4, emit=warn)
    return Document(text=text, pages=tuple(pages), source=name, sha256=sha, skipped_pages=skipped, load_warnings=told)


def _page_labels(reader: PdfReader, page_count: int) -> list[str | None]:
    """Each page's `Page.label` from the PDF's /PageLabels ("i", "ii", "1"): None where the label is the page's
    number or empty, and for every page when the label tree cannot be read (labels only name the pages, so a
    malformed tree costs the document nothing but them). Pages that would be cited alike (an unlabelled cover,
    cited as 1, before a body labelled from 1; chapters each labelled from 1) are told apart by their place in the
    file: "1 (file page 2)"."""
    try:
        labels = reader.page_labels
    except MemoryError:
        raise
    except Exception:
        return [None] * page_count
    stripped = (label.strip() for label in labels)
    own = [label if label and label != str(number) else None for number, label in enumerate(stripped, start=1)]
    places = range(1, len(own) + 1)
    return labels_told_apart(places, own, places)


def labels_told_apart(numbers: Sequence[int], labels: Sequence[str | None], places: Sequence[int]) -> list[str | None]:
    """The `Page.label`s of pages of one file (`labels`: each one's own, None where it is cited by its number),
    with pages that would be cited alike told apart by their place in the file (`places`, 1-based): "1 (file
    page 3)"."""
    cited = [label if label is not None else str(number) for number, label in zip(numbers, labels, strict=True)]
    shared = {name for name, count in Counter(cited).items() if count > 1}
    return [
        f"{name} (file page {place})" if name in shared else label
        for name, label, place in zip(cited, labels, places, strict=True)
    ]


def _ocr_command(name: str, *options: str) -> str:
    """An ocrmypdf command line that writes an OCR'd copy of `name` beside it (`--skip-text`: OCR only the pages
    without text, which ocrmypdf otherwise refuses); quoted for a shell, as every command a message suggests."""
    out = Path(name).with_name(Path(name).stem + "-ocr.pdf")
    return shlex.join(["ocrmypdf", *options, name, str(out)])
