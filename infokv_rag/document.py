"""CompressedDocument: one document read into a compressed cache, answering any number of questions."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict

from torch import Tensor

from . import decoding, store
from .cache import ResidentCache
from .cold_tier import ColdTier
from .config import CompressionConfig
from .documents import Document
from .errors import ConfigError
from .generation import Generation, GenerationOptions
from .ingestion import DocumentStats
from .prompt import Turn, check_conversation, question_turns

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pydantic's dependency, so every install holds it
    from typing_extensions import Unpack

if TYPE_CHECKING:
    from .engine import InfoKVEngine


class AnswerOptions(TypedDict, total=False):
    """The keywords of `CompressedDocument.ask` and `stream`: `GenerationOptions`' fields, a None (or a keyword left
    out) keeping its default. `recall` (a ratio of the document's tokens or a token count per layer and KV head;
    0: off) is how much of the cold tier the question may bring back; default `config.recall`."""

    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: str | Sequence[str] | None
    seed: int | None
    max_cache_tokens: int | None
    recall: float | int | None


def _answer_options(method: str, options: Mapping[str, Any]) -> GenerationOptions:
    """`ask`'s or `stream`'s keywords as options; a keyword that is none of `AnswerOptions` is refused as a call's
    (TypeError), not taken, nor dropped for being None."""
    unknown = sorted(set(options) - set(AnswerOptions.__annotations__))
    if unknown:
        raise TypeError(
            f"CompressedDocument.{method}() got an unexpected keyword argument {unknown[0]!r}; it takes "
            f"{', '.join(AnswerOptions.__annotations__)}"
        )
    return GenerationOptions.build(**options)


NOT_PICKLED = (
    "a CompressedDocument holds its model and cache in this process's memory and is not pickled: save it "
    "(doc.save(directory)) and load or pass that directory where it is needed"
)


@dataclass(repr=False, eq=False)  # a document is itself (hashable, compared by identity): its tensors compare no way
class CompressedDocument:
    """A document read once into a compressed cache; answers any number of questions against it.

    A copy, deep or not, is the same document (its model and cache are shared, as the engine is); a pickle is refused
    (`NOT_PICKLED`): save it and load it where it is needed."""

    engine: InfoKVEngine
    cache: ResidentCache
    """At the model's dtype (`DocumentCache`), or in codes (`CodedCache`) when `config.stored_bits` is set."""
    config: CompressionConfig
    document: Document
    stats: DocumentStats
    information_reference: Tensor | None = None
    """(n,) sorted information values (entropy or surprisal, as configured) of the document tokens, when
    the method computed them; decode-time eviction ranks generated tokens among them."""
    cold_tier: ColdTier | None = None
    """What compression evicted, kept to be recalled per question, when `config.recall` asked for it."""

    def __copy__(self) -> CompressedDocument:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> CompressedDocument:
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError(NOT_PICKLED)

    def __repr__(self) -> str:
        # Not the tensors: frameworks put a model's repr, with the document it holds, into every trace.
        source = self.document.source or f"sha256 {self.document.sha256[:12]}"
        return (
            f"CompressedDocument({source!r}, model={self.engine.name!r}, method={self.config.method!r}, "
            f"keep={self.config.keep}, tokens={self.stats.document_tokens}, kept={self._kept_per_layer()} per layer "
            f"and KV head)"
        )

    def _kept_per_layer(self) -> int:
        # `stats.kept_tokens` counts over every layer: 17,100 beside a document of 2,342 tokens read as a growth.
        layers = len(self.stats.kept_tokens_per_layer)
        return round(self.stats.kept_tokens / layers) if layers else 0

    def generate(self, turns: Sequence[Turn], options: GenerationOptions | None = None) -> Generation:
        """Answers a conversation ((role, content) turns after the document); see `ask` for options. A conversation
        whose last user turn is empty (whitespace or control characters only) is refused (`EmptyQuestionError`)."""
        check_conversation(turns)
        if options is None:
            options = GenerationOptions()
        elif not isinstance(options, GenerationOptions):  # a dict would fail later, on an attribute
            raise ConfigError(
                "options must be GenerationOptions, e.g. GenerationOptions(max_new_tokens=64) (a dict: "
                f"GenerationOptions(**it)), not {type(options).__name__}"
            )
        return decoding.generate(self, turns, options)

    def stream(self, question: str, **options: Unpack[AnswerOptions]) -> Iterator[str]:
        """The answer's text pieces, as they are generated. The question and options (`AnswerOptions`: max_new_tokens,
        temperature, top_p, stop, seed, max_cache_tokens, recall) are checked here, before the first piece is asked
        for (a bad one raises at the call, as `generate` does, not mid-stream).
        """
        return iter(self.generate(question_turns(question), _answer_options("stream", options)))

    def ask(self, question: str, **options: Unpack[AnswerOptions]) -> str:
        """Answers one question (greedy unless `temperature` > 0); options (`AnswerOptions`) as for `stream`."""
        return "".join(self.generate(question_turns(question), _answer_options("ask", options)))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Writes this cache to `directory` atomically (see `infokv_rag.store`); returns its path."""
        return store.save_document(self, directory)
