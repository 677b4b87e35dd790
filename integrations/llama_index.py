"""LlamaIndex adapters: a compressed document as an LLM (`InfoKV`) and as a query engine (`DocumentQueryEngine`).

```python
from infokv_rag.integrations.llama_index import DocumentQueryEngine
engine = DocumentQueryEngine.from_file("contract.pdf", model="default")     # or .from_documents(docs)
response = engine.query("What is the notice period?")
response.response, [n.node.metadata["page_label"] for n in response.source_nodes]
```

The document is read once (per model and compression config) and shared in the process; prompts and
chat messages follow it in the model's chat template. Needs the `llamaindex` extra (`llama-index-core`).
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any, ClassVar

try:
    import llama_index.core  # noqa: F401
except ImportError as exc:
    raise ImportError("the LlamaIndex adapters need llama-index-core: pip install 'infokv-rag[llamaindex]'") from exc

from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
)
from llama_index.core.base.response.schema import Response
from llama_index.core.bridge.pydantic import (
    Field,
    PrivateAttr,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle, QueryType, TextNode
from llama_index.core.schema import Document as LlamaDocument
from llama_index.core.types import TokenAsyncGen

from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.citations import supporting_pages
from infokv_rag.document import NOT_PICKLED
from infokv_rag.documents import Document, document_from_pages, labels_told_apart, page_has_text
from infokv_rag.generation import DEFAULT_MAX_NEW_TOKENS, Generation
from infokv_rag.prompt import Turn, check_conversation, question_turns

from ._common import (
    CALL_OPTIONS,
    DocumentHold,
    FrameworkDocuments,
    aiter_pieces,
    answer_info,
    answering_engine,
    as_secret,
    call_model_name,
    call_options,
    check_document,
    check_turns,
    coerce_dtype,
    config_fields,
    document_as_json,
    model_field,
    not_a_bool,
    optional_config,
    options_a_call_takes,
    refuse_unknown_fields,
    revealed,
    start_generation,
    stop_field,
)

__all__ = ["DocumentQueryEngine", "InfoKV", "messages_to_turns"]

_ROLES = {
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}


def messages_to_turns(messages: Sequence[ChatMessage]) -> list[Turn]:
    """LlamaIndex chat messages -> (role, content) turns after the document."""
    turns: list[Turn] = []
    for message in messages:
        role = _ROLES.get(message.role)
        if role is None:
            raise ValueError(
                f"InfoKV has no tool calling and takes system, user and assistant messages, not {message.role.value!r}"
            )
        parts = []
        for block in message.blocks:
            if isinstance(block, TextBlock):
                parts.append(block.text)
            elif not isinstance(block, ThinkingBlock):
                raise ValueError(f"InfoKV reads text only; a {role} message holds a {type(block).__name__}")
        turns.append((role, "".join(parts)))
    return check_turns(turns)


_HOW_TO_BIND = "as a field (InfoKV(document=...)) or as a call's kwarg (llm.complete(prompt, document=...))"
"""Where an `InfoKV` takes its document: LlamaIndex LLMs have no `.bind`."""


class InfoKV(CustomLLM):
    """A chat LLM answering from one InfoKV-compressed document (weights and document load on first use).

    `metadata.context_window` is what is left for messages and the answer: the model's window minus the
    document tokens held (at their original positions) by the cache and the chat template's own tokens; with no
    document bound, the window less the template (an upper bound that a call's document lowers). Per-call kwargs:
    `document`, `document_text`, `model`, `max_tokens`, `temperature`, `top_p`, `seed`, `max_cache_tokens`,
    `recall`, `stop`.
    """

    FRAMEWORK_DOCUMENTS: ClassVar[FrameworkDocuments] = FrameworkDocuments(
        (BaseNode,),
        "LlamaIndex Documents",
        "pass those to DocumentQueryEngine.from_documents(documents)",
        "InfoKV.from_json(text, document=...)",
    )
    """LlamaIndex `Document`s and nodes, refused as `document` (`check_document`): their pages come in through
    `DocumentQueryEngine.from_documents`, which keeps their page numbers."""

    model: str | None = Field(
        default=None,
        description="default, tiny, a local HF directory, a .gguf file or a hub id (org/name[@revision]); None: the "
        "document's model (a CompressedDocument's, or the one a saved cache directory's manifest names), else default",
    )
    document: Any = Field(
        default=None,
        description="a .pdf/.txt/.md path, saved cache dir, CompressedDocument or infokv_rag Document",
    )
    document_text: str | None = Field(default=None, description="the document's text, when there is no file")
    compression: CompressionConfig | None = Field(
        default=None, description="how a file or text is compressed (recall > 0 also keeps a cold tier)"
    )
    device: str | None = Field(default=None, description="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    dtype: str | None = Field(default=None, description="auto (bf16 on CUDA, fp32 elsewhere), bf16, fp16, fp32")
    max_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, gt=0, description="most tokens generated per answer")
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] | None = None
    seed: int | None = None
    max_cache_tokens: int | None = Field(default=None, gt=0)
    recall: float | int | None = Field(
        default=None, description="cold-tier recall per answer (ratio or token count; 0: none); None: the document's"
    )
    password: str | SecretStr | None = Field(
        default=None,
        exclude=True,
        repr=False,
        description="opens `document` when it is an encrypted PDF file; held as a SecretStr, never serialised",
    )

    _hold: DocumentHold = PrivateAttr(default_factory=DocumentHold)
    """The document the fields chose, once read (`to_payload` describes it, and reads none)."""

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("class_name") == cls.class_name():
            # LlamaIndex's dumps name their class (`model_dump`, `to_json`): a dump of this class makes it again.
            data = {name: value for name, value in data.items() if name != "class_name"}
        return refuse_unknown_fields(cls, data)

    _config = field_validator("compression", mode="before")(optional_config)

    _number = field_validator(*CALL_OPTIONS, mode="before")(not_a_bool)

    _stop = field_validator("stop", mode="before")(stop_field)
    _model = field_validator("model", mode="before")(model_field)

    @field_serializer("compression")
    def _config_fields(self, config: CompressionConfig | None) -> dict[str, Any] | None:
        return config_fields(config)

    @field_validator("document", mode="before")
    @classmethod
    def _document(cls, value: Any) -> Any:
        return check_document(value, cls.__name__, cls.FRAMEWORK_DOCUMENTS)

    _dtype = field_validator("dtype", mode="before")(coerce_dtype)

    _secret = field_validator("password", mode="before")(as_secret)

    _options_as_a_call_takes_them = model_validator(mode="after")(options_a_call_takes)

    _document_as_json = field_serializer("document")(document_as_json)

    def __getstate__(self) -> dict[Any, Any]:
        # LlamaIndex's own drops what it cannot pickle, with a log line only: the copy would have no document.
        if isinstance(self.document, CompressedDocument):
            raise TypeError(NOT_PICKLED)
        return super().__getstate__()

    @classmethod
    def class_name(cls) -> str:
        return "InfoKV"

    # The document ----------------------------------------------------------------------------------

    def _model_name(self) -> str:
        return call_model_name(self, {})

    def compressed_document(self, **kwargs: Any) -> CompressedDocument:
        """The compressed document this LLM answers from: read on first use, then shared while the fields (or
        the call's kwargs) that choose it stay the same; a field changed later chooses another."""
        return self._hold.document(self, kwargs, revealed(self.password), _HOW_TO_BIND)

    @property
    def metadata(self) -> LLMMetadata:
        """With a bound document, the window left beside it; with none yet (each call passes its own), the model's
        window less the chat template only: an upper bound that a call's document lowers."""
        if self.document is None and self.document_text is None:
            return self._metadata(answering_engine(self.model, None, None, self.device, self.dtype), 0)
        document = self.compressed_document()
        return self._metadata(document.engine, document.cache.document_tokens)

    def _metadata(self, engine: InfoKVEngine, document_tokens: int) -> LLMMetadata:
        # The context left for a prompt: the model's, less the document and the chat template's own tokens
        # around every question (a prompt packed to the window would overflow by those). LlamaIndex counts a
        # system prompt's own tokens itself; what joins it to the question (an empty one's turn) is the template's.
        turns: list[Turn] = [("system", ""), ("user", "")] if self.system_prompt else [("user", "")]
        template = len(engine.prompt.conversation_ids(turns))
        return LLMMetadata(
            context_window=engine.context_window - document_tokens - template,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=engine.name,
        )

    def to_payload(self) -> dict[str, Any]:
        """For instrumentation events: never loads weights or reads the document just to describe them."""
        held = self._hold.held(self)
        if held is None:  # none read yet, or another field's document
            return {"class_name": self.class_name(), "model_name": self._model_name(), "num_output": self.max_tokens}
        metadata = self._metadata(held.engine, held.cache.document_tokens)
        return {"class_name": self.class_name(), **metadata.model_dump()}

    # Generation ------------------------------------------------------------------------------------

    def _start(self, turns: list[Turn], kwargs: dict[str, Any]) -> tuple[Generation, CompressedDocument]:
        """Checks the messages and the call's options, then resolves the document (loading weights / ingesting on
        first use) and starts an answer: a call that cannot be answered reads no document."""
        check_conversation(turns)
        options = call_options(self, kwargs)
        document = self.compressed_document(**kwargs)
        return start_generation(document, turns, options), document

    async def _astart(self, turns: list[Turn], kwargs: dict[str, Any]) -> tuple[Generation, CompressedDocument]:
        return await asyncio.to_thread(self._start, turns, kwargs)

    def _prompt_turns(self, prompt: str, formatted: bool) -> list[Turn]:
        if not formatted and self.completion_to_prompt is not None:
            prompt = self.completion_to_prompt(prompt)
        turns: list[Turn] = []
        if self.system_prompt and not formatted:
            turns.append(("system", self.system_prompt))
        return [*turns, ("user", prompt)]

    def _chat_turns(self, messages: Sequence[ChatMessage]) -> list[Turn]:
        """The messages after the document, led by `system_prompt` once: `LLM.predict` / `stream` (and their async
        forms) have prepended it already (`_get_messages`), a direct `chat` call has not."""
        messages = list(messages)
        first = messages[0] if messages else None
        if first is None or (first.role == MessageRole.SYSTEM and first.content == self.system_prompt):
            return messages_to_turns(messages)  # none: refused as such, not asked as the system prompt alone
        return messages_to_turns(self._extend_messages(messages))

    @staticmethod
    def _answered(
        text: str, generation: Generation, document: CompressedDocument, delta: str | None = None
    ) -> CompletionResponse:
        """The response that ends an answer (`delta` "" when streamed): its metadata and token counts in
        `additional_kwargs`, and the counts also as `raw["usage"]`, where LlamaIndex's `TokenCountingHandler` reads a
        model's own (else it counts the messages again with its tokenizer, without the document)."""
        info = answer_info(document, generation.usage)
        counts = info.token_counts()
        return CompletionResponse(
            text=text, delta=delta, additional_kwargs={**info.metadata(), **counts}, raw={"usage": counts}
        )

    def _completions(self, generation: Generation, document: CompressedDocument) -> CompletionResponseGen:
        text = ""
        for piece in generation:
            text += piece
            yield CompletionResponse(text=text, delta=piece)
        yield self._answered(text, generation, document, delta="")

    async def _acompletions(self, generation: Generation, document: CompressedDocument) -> CompletionResponseAsyncGen:
        text = ""
        async for piece in aiter_pieces(generation):
            text += piece
            yield CompletionResponse(text=text, delta=piece)
        yield self._answered(text, generation, document, delta="")

    @staticmethod
    def _as_chat(response: CompletionResponse) -> ChatResponse:
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
            delta=response.delta,
            additional_kwargs=response.additional_kwargs,
            raw=response.raw,
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        generation, document = self._start(self._prompt_turns(prompt, formatted), kwargs)
        text = generation.text()
        return self._answered(text, generation, document)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        generation, document = self._start(self._prompt_turns(prompt, formatted), kwargs)
        return self._completions(generation, document)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        generation, document = self._start(self._chat_turns(messages), kwargs)
        text = generation.text()
        return self._as_chat(self._answered(text, generation, document))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        generation, document = self._start(self._chat_turns(messages), kwargs)
        return (self._as_chat(response) for response in self._completions(generation, document))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        generation, document = await self._astart(self._prompt_turns(prompt, formatted), kwargs)
        text = "".join([piece async for piece in aiter_pieces(generation)])
        return self._answered(text, generation, document)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        generation, document = await self._astart(self._prompt_turns(prompt, formatted), kwargs)
        return self._acompletions(generation, document)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        generation, document = await self._astart(self._chat_turns(messages), kwargs)
        text = "".join([piece async for piece in aiter_pieces(generation)])
        return self._as_chat(self._answered(text, generation, document))

    async def apredict(self, prompt: BasePromptTemplate, **prompt_args: Any) -> str:
        await self._aopen()
        return await super().apredict(prompt, **prompt_args)

    async def astream(self, prompt: BasePromptTemplate, **prompt_args: Any) -> TokenAsyncGen:
        await self._aopen()
        return await super().astream(prompt, **prompt_args)

    async def _aopen(self) -> None:
        """LlamaIndex's `apredict` and `astream` (every query engine's `aquery`) read `metadata` on the event loop
        before they answer, and it reads the document (or loads the weights) on first use: done here in a thread, so
        that the loop goes on meanwhile and `metadata` then finds them ready."""
        await asyncio.to_thread(lambda: self.metadata)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        generation, document = await self._astart(self._chat_turns(messages), kwargs)

        async def responses() -> ChatResponseAsyncGen:
            async for response in self._acompletions(generation, document):
                yield self._as_chat(response)

        return responses()


def _page_number(metadata: dict[str, Any], position: int) -> tuple[int, str | None]:
    """A page's (number, label) from a reader's metadata: the first of `page_label`, `page` and `page_number`
    that is a whole number, else `position` (1-based, within its file); the label is `page_label` where it is
    not that number ("iv", "A-1")."""
    number = position
    for key in ("page_label", "page", "page_number"):
        try:
            number = int(str(metadata.get(key)).strip())
            break
        except ValueError:
            continue
    label = str(metadata.get("page_label", "")).strip() or None
    return number, (label if label != str(number) else None)


def _check_documents(documents: Any) -> None:
    """TypeError, where they are given, for `from_documents` arguments that are no sequence of LlamaIndex Documents
    (a path, one Document, strings), rather than an AttributeError from deep inside."""
    takes = "DocumentQueryEngine.from_documents takes a sequence of LlamaIndex Documents"
    if isinstance(documents, (str, os.PathLike)):
        raise TypeError(f"{takes}, not a path: DocumentQueryEngine.from_file(path) reads a file")
    if isinstance(documents, BaseNode):
        raise TypeError(f"{takes}, not one {type(documents).__name__}: pass a list of it, [document]")
    if not isinstance(documents, Sequence):
        raise TypeError(f"{takes}; got {type(documents).__name__}")
    strays = sorted({type(item).__name__ for item in documents if not isinstance(item, BaseNode)})
    if strays:
        raise TypeError(f"{takes}; got a {type(documents).__name__} holding {', '.join(strays)}")


def _cited_files(files: Sequence[str]) -> dict[str, str]:
    """How each file is cited: by its base name, or by its path where files in other folders share that name."""
    sharing = Counter(os.path.basename(file) for file in set(files))
    return {file: file if sharing[os.path.basename(file)] > 1 else os.path.basename(file) for file in files}


class DocumentQueryEngine(CustomQueryEngine):
    """Answers queries from one compressed document; source nodes are the pages that support the answer.

    Every source node is a page of the document, its metadata holding `page_label` (str) and `page` (int)
    as LlamaIndex's PDF readers do, plus `file_name` when known. Pages are chosen after answering: those
    holding the answer verbatim, else those sharing most of its (rare) words. A query emits LlamaIndex's query
    events and span, and the LLM's chat events (callbacks and instrumentation), as `llm.chat` does.
    """

    llm: InfoKV
    max_sources: int = Field(default=3, ge=0, description="most pages returned as source nodes")
    page_files: list[str] | None = Field(
        default=None,
        description="the file each page is cited by, in order, when the pages came from several files (its base "
        "name, or its path where files in several folders share one)",
    )

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        model: str | None = None,
        compression: CompressionConfig | dict[str, Any] | None = None,
        password: str | SecretStr | None = None,
        max_sources: int = 3,
        callback_manager: CallbackManager | None = None,
        **llm_kwargs: Any,
    ) -> DocumentQueryEngine:
        """A .pdf/.txt/.md file (read by infokv-rag's loader, keeping the PDF's page numbers) or a saved cache
        directory; `password` opens an encrypted PDF; `callback_manager` serves the engine and its LLM.
        `llm_kwargs` are `InfoKV` fields."""
        llm = InfoKV(
            model=model,
            document=path,  # checked by InfoKV (`check_document`), which says where LlamaIndex Documents go
            compression=optional_config(compression),
            password=password,
            **llm_kwargs,
        )
        return cls._with(llm, max_sources, callback_manager)

    @classmethod
    def from_documents(
        cls,
        documents: Sequence[LlamaDocument],
        *,
        model: str | None = None,
        compression: CompressionConfig | dict[str, Any] | None = None,
        max_sources: int = 3,
        callback_manager: CallbackManager | None = None,
        **llm_kwargs: Any,
    ) -> DocumentQueryEngine:
        """LlamaIndex `Document`s (e.g. from `SimpleDirectoryReader`), in order, as the pages of one document.

        A document's page number comes from its `page_label` / `page` metadata (as set by PDF readers), else from
        its position within its file (`file_path`, else `file_name`; 1, 2, ...); a `page_label` that is not a
        number ("iv") is kept and cited as it is. A page cites its file by base name, or by path where files in
        several folders share one. `callback_manager` serves the engine and its LLM; `llm_kwargs` are `InfoKV`
        fields.
        """
        _check_documents(documents)
        if not documents:
            raise ValueError("no documents given: pass the pages (or files) of the document to answer from")
        files = [str(doc.metadata.get("file_path") or doc.metadata.get("file_name") or "") for doc in documents]
        cited = _cited_files(files)
        pages: list[tuple[int, str]] = []
        labels: list[str | None] = []
        names: list[str] = []
        positions: dict[str, int] = {}
        kept_of: dict[str, list[tuple[int, int]]] = {}  # each file's kept pages: (index in `pages`, place in the file)
        for doc, file in zip(documents, files, strict=True):
            positions[file] = positions.get(file, 0) + 1  # blank pages count: they are pages of the file
            text = doc.get_content()
            if page_has_text(text):  # the pages document_from_pages keeps
                number, label = _page_number(doc.metadata, positions[file])
                kept_of.setdefault(file, []).append((len(pages), positions[file]))
                pages.append((number, text))
                labels.append(label)
                names.append(cited[file])
        for kept in kept_of.values():  # chapters each numbered from 1 in one file: "1 (file page 3)", as from_file
            told_apart = labels_told_apart(
                [pages[index][0] for index, _ in kept],
                [labels[index] for index, _ in kept],
                [place for _, place in kept],
            )
            for (index, _), label in zip(kept, told_apart, strict=True):
                labels[index] = label
        source = names[0] if names and names[0] and all(name == names[0] for name in names) else None
        document = document_from_pages(pages, source=source, labels=labels)
        llm = InfoKV(model=model, document=document, compression=optional_config(compression), **llm_kwargs)
        engine = cls._with(llm, max_sources, callback_manager)
        engine.page_files = names if source is None and any(names) else None
        return engine

    @classmethod
    def _with(cls, llm: InfoKV, max_sources: int, callback_manager: CallbackManager | None) -> DocumentQueryEngine:
        if callback_manager is None:
            return cls(llm=llm, max_sources=max_sources)
        llm.callback_manager = callback_manager
        return cls(llm=llm, max_sources=max_sources, callback_manager=callback_manager)

    @property
    def document(self) -> CompressedDocument:
        return self.llm.compressed_document()

    # BaseQueryEngine's, not CustomQueryEngine's (which skips them): a dispatcher span, QueryStartEvent and
    # QueryEndEvent around `_query` / `_aquery`.
    def query(self, str_or_query_bundle: QueryType) -> Response:
        return BaseQueryEngine.query(self, str_or_query_bundle)  # type: ignore[return-value]

    async def aquery(self, str_or_query_bundle: QueryType) -> Response:
        return await BaseQueryEngine.aquery(self, str_or_query_bundle)  # type: ignore[return-value]

    def _query(self, query_bundle: QueryBundle) -> Response:
        return self.custom_query(query_bundle.query_str)

    async def _aquery(self, query_bundle: QueryBundle) -> Response:
        return await self.acustom_query(query_bundle.query_str)

    @staticmethod
    def _question(query_str: str) -> list[ChatMessage]:
        """The query as chat messages: asked through the LLM's `chat`, whose decorator emits its callback and
        instrumentation events (token counters, tracers), and which leads them with its `system_prompt`."""
        return [ChatMessage(role=role, content=content) for role, content in question_turns(query_str)]

    def _source_nodes(self, document: Document, answer: str, query_str: str) -> list[NodeWithScore]:
        """The pages of `document` that support `answer`, as LlamaIndex source nodes (best first)."""
        nodes = []
        for index, score in supporting_pages(document, answer, query_str, limit=self.max_sources):
            page = document.pages[index]
            metadata: dict[str, Any] = {"page_label": page.cited_as, "page": page.number}
            name = self.page_files[index] if self.page_files else os.path.basename(document.source or "")
            if name:
                metadata["file_name"] = name
            # By position: pages of several files may share numbers.
            node = TextNode(id_=f"{document.sha256[:16]}-page-{index + 1}", text=page.text, metadata=metadata)
            nodes.append(NodeWithScore(node=node, score=score))
        return nodes

    def _response(self, query_str: str, answer: ChatResponse, document: CompressedDocument) -> Response:
        text = (answer.message.content or "").strip()
        nodes = self._source_nodes(document.document, text, query_str)
        return Response(response=text, source_nodes=nodes, metadata=answer.additional_kwargs)

    def custom_query(self, query_str: str) -> Response:
        answer = self.llm.chat(self._question(query_str))
        return self._response(query_str, answer, self.document)

    async def acustom_query(self, query_str: str) -> Response:
        answer = await self.llm.achat(self._question(query_str))
        return self._response(query_str, answer, await asyncio.to_thread(lambda: self.document))
