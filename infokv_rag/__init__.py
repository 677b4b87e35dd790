"""infokv-rag: answer questions about long documents from an InfoKV-compressed, persisted KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import CompressionConfig
from .errors import (
    AnswerRoomError,
    CacheStoreError,
    CacheUnreadableError,
    ConfigError,
    ContextLengthError,
    CorruptPDFError,
    DocumentError,
    EmptyDocumentError,
    EmptyQuestionError,
    EncryptedPDFError,
    InfoKVError,
    ModelError,
    NoExtractableTextError,
    PDFContentLimitError,
    UnsupportedFormatError,
)

if TYPE_CHECKING:
    from .document import AnswerOptions, CompressedDocument
    from .documents import Document, load_document
    from .engine import InfoKVEngine
    from .generation import Generation, GenerationOptions, Usage
    from .ingestion import DocumentStats
    from .store import CacheStore, StoreWriteWarning

__version__ = "0.1.0"

# The engine pulls in torch and transformers (seconds to import); it is imported on first use, so
# that the command line can reject a bad document, and tools can read a cache manifest, at once.
_LAZY = {
    "AnswerOptions": "document",
    "CompressedDocument": "document",
    "Document": "documents",
    "DocumentStats": "ingestion",
    "Generation": "generation",
    "GenerationOptions": "generation",
    "InfoKVEngine": "engine",
    "CacheStore": "store",
    "StoreWriteWarning": "store",
    "Usage": "generation",
    "load_document": "documents",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AnswerOptions",
    "AnswerRoomError",
    "CacheStore",
    "CacheStoreError",
    "CacheUnreadableError",
    "CompressedDocument",
    "CompressionConfig",
    "ConfigError",
    "ContextLengthError",
    "CorruptPDFError",
    "Document",
    "DocumentError",
    "DocumentStats",
    "EmptyDocumentError",
    "EmptyQuestionError",
    "EncryptedPDFError",
    "Generation",
    "GenerationOptions",
    "InfoKVEngine",
    "InfoKVError",
    "ModelError",
    "NoExtractableTextError",
    "PDFContentLimitError",
    "StoreWriteWarning",
    "UnsupportedFormatError",
    "Usage",
    "load_document",
]
