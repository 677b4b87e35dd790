"""Typed errors. Every message says what went wrong and what the user can do about it."""

from __future__ import annotations


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


class CacheStoreError(InfoKVError):
    """A saved cache cannot be written, or is refused on load (corrupt, foreign, unknown format)."""
