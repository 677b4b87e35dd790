"""infokv-rag: answer questions about long documents from an InfoKV-compressed, persisted KV cache."""

from .config import CompressionConfig
from .engine import CompressedDocument, DocumentStats, InfoKVEngine
from .errors import (
    CacheStoreError,
    ConfigError,
    ContextLengthError,
    CorruptPDFError,
    DocumentError,
    EmptyDocumentError,
    EncryptedPDFError,
    InfoKVError,
    ModelError,
    NoExtractableTextError,
    UnsupportedFormatError,
)

__version__ = "0.1.0"

__all__ = [
    "CacheStoreError",
    "CompressedDocument",
    "CompressionConfig",
    "ConfigError",
    "ContextLengthError",
    "CorruptPDFError",
    "DocumentError",
    "DocumentStats",
    "EmptyDocumentError",
    "EncryptedPDFError",
    "InfoKVEngine",
    "InfoKVError",
    "ModelError",
    "NoExtractableTextError",
    "UnsupportedFormatError",
]
