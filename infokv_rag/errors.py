"""Typed errors. Every message says what went wrong and what the user can do about it."""

from __future__ import annotations

import errno
import unicodedata
from dataclasses import dataclass

_LINE_FORGING = frozenset("\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
"""Besides control characters: the line and paragraph separators, and the bidirectional overrides and isolates that
reorder how a log line reads."""


def on_one_line(text: str) -> str:
    """`text` with its control characters (line breaks, escape sequences), line separators and bidirectional overrides
    escaped (`\\n`, `\\x1b`, `\\u202e`): text a file holds (a PDF's filter name in pypdf's error) written into a log
    line cannot forge another line. Other text, a no-break or ideographic space included, is kept as it is."""
    return "".join(
        repr(char)[1:-1] if unicodedata.category(char) == "Cc" or char in _LINE_FORGING else char for char in text
    )


class InfoKVError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(InfoKVError, ValueError):
    """A `CompressionConfig` or generation option is out of range."""


class EmptyQuestionError(ConfigError):
    """A question (a conversation's last user message) holds no text: nothing but whitespace and control or format
    characters (NUL, a zero-width space)."""


class ModelError(InfoKVError):
    """A model name, path or packaged weight file cannot be resolved or verified."""


class ContextLengthError(InfoKVError, ValueError):
    """A document or question does not fit the model's context window."""


@dataclass(frozen=True)
class AnswerRoom:
    """What a conversation asked after a document needs of the context window, in tokens."""

    document_tokens: int
    question_tokens: int
    answer_tokens: int
    context_window: int
    question_counted_in_part: bool = False
    """The question was counted only until it certainly did not fit (a text of megabytes is never tokenized whole):
    `question_tokens` is the least it holds."""

    @property
    def spare(self) -> int:
        """The most tokens an answer may take beside the document and the question (0 or less: none)."""
        return self.context_window - self.document_tokens - self.question_tokens

    def refusal(self, answer_option: str) -> str:
        """Why it does not fit, naming the caller's option for the answer's length (`answer_option`)."""
        needed = self.document_tokens + self.question_tokens + self.answer_tokens
        more = "more than " if self.question_counted_in_part else ""
        return (
            f"the document ({self.document_tokens} tokens) plus the question ({more}{self.question_tokens} tokens) "
            f"plus {answer_option} ({self.answer_tokens}) is {more}{needed} tokens, more than the model's context "
            f"window of {self.context_window}; shorten the question or lower {answer_option}"
        )


class AnswerRoomError(ContextLengthError):
    """A conversation and the tokens its answer may take do not fit the context window beside the document. It keeps
    the counts (`room`) so that a caller whose option for the answer's length has another name than the core's
    `max_new_tokens` (an adapter's `max_tokens`, the CLI's `--max-new-tokens`) says it in its own terms (`worded`)."""

    def __init__(self, message: str, room: AnswerRoom | None = None) -> None:
        super().__init__(message)
        self.room = room

    @classmethod
    def of(cls, room: AnswerRoom, answer_option: str = "max_new_tokens") -> AnswerRoomError:
        return cls(room.refusal(answer_option), room)

    def worded(self, answer_option: str) -> AnswerRoomError:
        """The same refusal naming `answer_option` (itself when it holds no counts: one re-raised with other words)."""
        return self if self.room is None else self.of(self.room, answer_option)


class DocumentError(InfoKVError):
    """A document cannot be read into text."""


class UnsupportedFormatError(DocumentError):
    """The file is neither a PDF nor plain text / markdown."""


class EmptyDocumentError(DocumentError):
    """The file is empty or holds only whitespace."""


class EncryptedPDFError(DocumentError):
    """The PDF is encrypted and no (or a wrong) password was given."""


class NoExtractableTextError(DocumentError):
    """The PDF has pages but no text layer (scanned or image-only): it needs OCR first."""


class CorruptPDFError(DocumentError):
    """The PDF is damaged or truncated: it cannot be parsed, or pages it lists are missing or do not decode."""


class PDFContentLimitError(DocumentError):
    """The PDF draws more content than the reader parses (`pdf_limits.CONTENT_LIMIT`): pages or forms drawing the
    same large content many times, a bomb of a few kilobytes that would take hours to read."""


class CacheStoreError(InfoKVError):
    """A saved cache cannot be written, or is refused on load (corrupt, foreign, unknown format)."""


class CacheUnreadableError(CacheStoreError):
    """A saved cache that could not be read now, for a reason that shows no damage of it: an I/O error other than a
    missing file or a directory in a file's place (a store throttled or unreachable, a disk error, a permission).
    Reading the document again would not help; retry, or see to the disk or store."""


class NotARegularFileError(OSError):
    """Something other than a regular file where a file is read (a FIFO, a device): `files.open_regular`."""


def is_damage(error: OSError) -> bool:
    """Whether an I/O error reading a saved cache's file shows the cache damaged (a file missing, something else in
    a file's place: a directory, a FIFO, a link loop), rather than the storage failing to read it now
    (`CacheUnreadableError`). Not every EINVAL: an object store's client maps request errors to it."""
    damage = (FileNotFoundError, IsADirectoryError, NotADirectoryError, NotARegularFileError)
    return isinstance(error, damage) or error.errno == errno.ELOOP


def cache_read_error(error: OSError, what: str, damaged: str) -> CacheStoreError:
    """The refusal of a saved cache whose file `what` the I/O `error` stopped reading: `CacheStoreError(damaged)`
    where the error shows damage (`is_damage`), else `CacheUnreadableError`, to retry."""
    if is_damage(error):
        return CacheStoreError(damaged)
    return CacheUnreadableError(f"cannot read {what} now ({error}); retry, or check the storage")
