"""LangChain adapters: a compressed document as a chat model (`ChatInfoKV`) or a completion LLM (`InfoKVLLM`).

```python
from infokv_rag.integrations.langchain import ChatInfoKV
chat = ChatInfoKV(model="default", document="contract.pdf")   # weights load on first use
chain = ChatPromptTemplate.from_messages([("human", "{question}")]) | chat | StrOutputParser()
chain.invoke({"question": "What is the notice period?"})
chat.bind(document="caches/other").invoke("...")             # another document for these calls
ChatInfoKV(model="default", document="locked.pdf", password="...")   # an encrypted PDF
```

The document is read once (per model and compression config) and shared by every instance in the
process; each call sends only its own messages, which follow the document in the model's chat template
(system messages are folded into the next user message, consecutive same-role messages merged).
Needs the `langchain` extra (`langchain-core`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, ClassVar

try:
    import langchain_core  # noqa: F401
except ImportError as exc:
    raise ImportError("the LangChain adapters need langchain-core: pip install 'infokv-rag[langchain]'") from exc

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document as LangChainDocument
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.llms import LLM
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

from infokv_rag import CompressedDocument, CompressionConfig
from infokv_rag.documents import Document
from infokv_rag.generation import DEFAULT_MAX_NEW_TOKENS
from infokv_rag.generation import Generation as InfoKVGeneration
from infokv_rag.prompt import Turn, check_conversation

from ._common import (
    CALL_KWARGS,
    CALL_OPTIONS,
    DOCUMENT_OPTIONS,
    AnswerInfo,
    DocumentHold,
    FrameworkDocuments,
    aiter_pieces,
    answer_info,
    as_secret,
    call_model_name,
    call_options,
    check_call_password,
    check_document,
    check_turns,
    coerce_dtype,
    config_fields,
    document_as_json,
    document_identity,
    given_options,
    model_field,
    not_a_bool,
    optional_config,
    options_a_call_takes,
    refuse_unknown_fields,
    revealed,
    start_generation,
    stop_field,
    token_ids,
)

__all__ = ["ChatInfoKV", "InfoKVLLM", "messages_to_turns"]

_ROLES = {
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "system": "system",
    "developer": "system",
}


def _text_of(content: str | list[Any], role: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("reasoning", "thinking"):
            continue  # earlier reasoning is not part of the conversation the model sees
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatInfoKV reads text only; a {role} message holds a {kind!r} block")
    return "".join(parts)


def messages_to_turns(messages: Sequence[BaseMessage]) -> list[Turn]:
    """LangChain messages -> (role, content) turns after the document."""
    turns: list[Turn] = []
    for message in messages:
        if isinstance(message, ChatMessage):
            role = _ROLES.get(message.role)
        elif isinstance(message, HumanMessage):  # the chunk classes too (a streamed answer kept in the history)
            role = "user"
        elif isinstance(message, AIMessage):
            role = "assistant"
        elif isinstance(message, SystemMessage):
            role = "system"
        else:
            role = None
        if role is None:
            named = message.role if isinstance(message, ChatMessage) else message.type  # a ChatMessage's type: "chat"
            raise ValueError(f"ChatInfoKV has no tool calling and takes system, human and ai messages, not {named!r}")
        turns.append((role, _text_of(message.content, role)))
    return check_turns(turns)


_NO_TOOLS = (
    "ChatInfoKV answers questions about its document in plain text: it has no tool calling (bind_tools) and no "
    "structured output (with_structured_output); parse its text answer instead, e.g. with an output parser"
)


def _usage_metadata(info: AnswerInfo) -> UsageMetadata:
    counts = info.token_counts()
    return UsageMetadata(
        input_tokens=counts["prompt_tokens"],
        output_tokens=counts["completion_tokens"],
        total_tokens=counts["total_tokens"],
        input_token_details=InputTokenDetails(cache_read=counts["cached_tokens"]),
    )


def _call_fields(adapter: _InfoKVFields, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Takes the adapter's own options out of a call's `kwargs` (those LangChain's are left), as field values: an
    option left unset (`given_options`) keeps the field's, a call's `document` replaces the adapter's `document_text`,
    and a `compression` is checked as the field is."""
    taken = {name: kwargs.pop(name) for name in list(kwargs) if name in CALL_KWARGS and name != "stop"}
    options = given_options(taken)
    if "document" in options and "document_text" not in options:
        options["document_text"] = None
    if "compression" in options:
        options["compression"] = optional_config(options["compression"])
    if "model" in options:  # as the field takes it (`model_copy` validates nothing)
        options["model"] = model_field(options["model"])
    return options


def _identified(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Call kwargs with a per-call document named by what its answers depend on (`document_identity`): LangChain
    puts call kwargs into its answer cache's key as text, and a path or a document's repr is not its content; an
    option left unset (`given_options`) is left out, as it changes no answer."""
    named = given_options(kwargs)
    if "document" in named:
        named["document"] = document_identity(named["document"], None)
    if "document_text" in named:
        named["document_text"] = document_identity(None, named["document_text"])
    return named


def _described(text: str) -> str:
    """A text by its length and digest."""
    return f"<{len(text)} characters, sha256 {hashlib.sha256(text.encode(errors='surrogatepass')).hexdigest()[:16]}>"


class _InfoKVFields(BaseModel):
    """Settings shared by the chat model and the completion LLM."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    FRAMEWORK_DOCUMENTS: ClassVar[FrameworkDocuments] = FrameworkDocuments(
        (LangChainDocument,),
        "LangChain Documents",
        'pass their text instead, document_text="\\n\\n".join(d.page_content for d in docs)',
        "document=... with the dump's other fields",
    )
    """What LangChain's loaders return, refused as `document` (`check_document`) saying how their text comes in."""

    model: str | None = None
    """`default`, `tiny`, a local HF directory, a .gguf file or a hub id (`org/name[@revision]`); None: the
    document's model (a `CompressedDocument`'s, or the one a saved cache directory's manifest names), else default."""
    document: Any = None
    """A .pdf/.txt/.md path (str or os.PathLike), a saved cache directory, a `CompressedDocument` or an infokv_rag
    `Document` (anything else is refused when the adapter is made: TypeError)."""
    document_text: str | None = None
    """The document's text, when there is no file (used instead of `document`)."""
    compression: CompressionConfig | None = None
    """How a document given as a file or text is compressed (default: InfoKV, keep 0.25); `recall` > 0 in it
    also keeps a cold tier of what compression evicts, to be recalled per question."""
    device: str | None = None
    """auto (None: CUDA when available, else CPU), cpu, cuda, cuda:N or mps."""
    dtype: str | None = None
    """auto (None: bf16 on CUDA, fp16 where unsupported; fp32 elsewhere), bf16, fp16, fp32, or a torch dtype."""
    max_tokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, gt=0)
    """Most tokens generated per answer."""
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: list[str] | None = None
    seed: int | None = None
    max_cache_tokens: int | None = Field(default=None, gt=0)
    """Cap on the cached tokens per layer while answering (evicts past it); None: no cap."""
    recall: float | int | None = None
    """How much of the cold tier each answer recalls (ratio or token count; 0: none); None: the document's."""
    streaming: bool = False
    password: str | SecretStr | None = Field(default=None, exclude=True, repr=False)
    """Opens `document` (or a call's) when it is an encrypted PDF file. Held as a `SecretStr`, and no part of the
    repr, the dumps, LangChain's serialisation or its answer cache's key."""

    _hold: DocumentHold = PrivateAttr(default_factory=DocumentHold)
    """The document the fields chose, once read."""

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # The repr goes into every trace (LangChain serialises a model it cannot serialise as its repr): a
        # document's text, given as text or as a loaded Document, is named by its length and digest, not written
        # out whole.
        for name, value in super().__repr_args__():
            if name == "document_text" and isinstance(value, str):
                value = _described(value)
            elif name == "document" and isinstance(value, Document):
                value = f"Document(source={value.source!r}, text={_described(value.text)})"
            yield name, value

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return refuse_unknown_fields(cls, data)

    _config = field_validator("compression", mode="before")(optional_config)

    @field_serializer("compression")
    def _config_fields(self, config: CompressionConfig | None) -> dict[str, Any] | None:
        return config_fields(config)

    _document_as_json = field_serializer("document")(document_as_json)

    _options_as_a_call_takes_them = model_validator(mode="after")(options_a_call_takes)

    _dtype = field_validator("dtype", mode="before")(coerce_dtype)

    _number = field_validator(*CALL_OPTIONS, mode="before")(not_a_bool)

    _stop = field_validator("stop", mode="before")(stop_field)
    _model = field_validator("model", mode="before")(model_field)

    @field_validator("document")
    @classmethod
    def _fingerprinted(cls, value: Any) -> Any:
        """Checks the document's type (`check_document`). A `CompressedDocument`'s model fingerprint is part of the
        answer cache's key, which `ainvoke` reads on the event loop; for a `from_model` engine it hashes every
        weight, so that is done here, once per engine."""
        check_document(value, cls.__name__, cls.FRAMEWORK_DOCUMENTS)
        if isinstance(value, CompressedDocument):
            value.engine.fingerprint  # noqa: B018 (a cached property: computed now, read later)
        return value

    _secret = field_validator("password", mode="before")(as_secret)

    def _model_name(self, kwargs: dict[str, Any]) -> str:
        return call_model_name(self, kwargs)

    def compressed_document(self, **kwargs: Any) -> CompressedDocument:
        """The document calls answer from, read on first use (loading the weights): `stats`, `save()`, pages.

        kwargs as per call: `document`, `document_text`, `model`, `compression`.
        """
        return self._hold.document(
            self, kwargs, self._password(), how_to_bind="as a field or per call with .bind(document=...)"
        )

    def _password(self) -> str | None:
        return revealed(self.password)

    def _check_password(self, kwargs: dict[str, Any]) -> None:
        """Refuses a wrong or missing password for the call's encrypted PDF before LangChain's answer cache is
        read: its key holds no password, so a cached answer would otherwise reach any caller."""
        check_call_password(self, kwargs, self._password())

    def _start(
        self, turns: list[Turn], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[InfoKVGeneration, CompressedDocument]:
        """Checks the messages and the call's options, then resolves the document (loading weights / ingesting on
        first use) and starts an answer: a call that cannot be answered reads no document."""
        check_conversation(turns)
        options = call_options(self, kwargs, stop)
        document = self.compressed_document(**kwargs)
        return start_generation(document, turns, options), document

    def _infokv_identity(self) -> dict[str, Any]:
        document = document_identity(self.document, self.document_text)
        return {
            "model": self._model_name({}),
            "document": document,
            "compression": (self.compression or CompressionConfig()).to_dict(),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_cache_tokens": self.max_cache_tokens,
            "recall": self.recall,
            # What else changes an answer: LangChain's answer cache keys on all of this ("stop" itself is the
            # call's, which LangChain writes over it).
            "default_stop": self.stop,
            "seed": self.seed,
            "device": self.device,
            "dtype": self.dtype,
        }


class ChatInfoKV(BaseChatModel, _InfoKVFields):
    """A chat model that answers from one InfoKV-compressed document (read once, asked many times).

    Usage metadata counts the document tokens served from the cache as `input_token_details.cache_read`
    (and within `input_tokens`); `response_metadata` carries the model name, finish reason and the
    document's compression stats. Per-call options: `document`, `document_text`, `model`, `max_tokens`,
    `temperature`, `top_p`, `seed`, `max_cache_tokens`, `recall` (via `.bind(...)` or invoke kwargs) and `stop`.
    """

    @property
    def _llm_type(self) -> str:
        return "infokv-chat"

    def _start(
        self, turns: list[Turn], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[InfoKVGeneration, CompressedDocument]:
        # `stream` is LangChain's own call option (streaming on or off for this call, whatever the callbacks): it
        # has acted on it already and passes it on with the rest.
        return super()._start(turns, stop, {name: value for name, value in kwargs.items() if name != "stream"})

    def get_token_ids(self, text: str) -> list[int]:
        """By the model's own tokenizer (`get_num_tokens`, `trim_messages`), not LangChain's GPT-2 fallback."""
        return token_ids(self, text)

    def bind_tools(
        self, tools: Sequence[Any], *, tool_choice: str | None = None, **kwargs: Any
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Refused (NotImplementedError saying why): the model answers from its document and calls no tools."""
        raise NotImplementedError(_NO_TOOLS)

    def with_structured_output(
        self, schema: dict[str, Any] | type, *, include_raw: bool = False, **kwargs: Any
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Refused as `bind_tools` is, whose tool calls LangChain's structured output is made of."""
        raise NotImplementedError(_NO_TOOLS)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._infokv_identity()

    def _get_llm_string(self, stop: list[str] | None = None, **kwargs: Any) -> str:
        # LangChain asks for the key right before it reads its answer cache: the password is checked first.
        self._check_password(kwargs)
        return super()._get_llm_string(stop, **_identified(kwargs))

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        given = given_options(kwargs)
        params = LangSmithParams(
            ls_provider="infokv",
            ls_model_name=self._model_name(kwargs),
            ls_model_type="chat",
            ls_temperature=given.get("temperature", self.temperature),
            ls_max_tokens=given.get("max_tokens", self.max_tokens),
        )
        stops = stop if stop is not None else self.stop
        if stops:
            params["ls_stop"] = stops
        return params

    @staticmethod
    def _final_chunk(info: AnswerInfo) -> ChatGenerationChunk:
        message = AIMessageChunk(
            content="",
            usage_metadata=_usage_metadata(info),
            response_metadata=info.metadata(),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": info.usage.finish_reason})

    def _result(self, text: str, info: AnswerInfo) -> ChatResult:
        message = AIMessage(content=text, usage_metadata=_usage_metadata(info), response_metadata=info.metadata())
        generation = ChatGeneration(message=message, generation_info={"finish_reason": info.usage.finish_reason})
        return ChatResult(generations=[generation], llm_output={"model_name": info.model_name})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        generation, document = self._start(messages_to_turns(messages), stop, kwargs)
        text = generation.text()
        return self._result(text, answer_info(document, generation.usage))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        generation, document = self._start(messages_to_turns(messages), stop, kwargs)
        for piece in generation:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield self._final_chunk(answer_info(document, generation.usage))

    async def _astart(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[InfoKVGeneration, CompressedDocument]:
        turns = messages_to_turns(messages)
        return await asyncio.to_thread(self._start, turns, stop, kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        generation, document = await self._astart(messages, stop, kwargs)
        text = "".join([piece async for piece in aiter_pieces(generation)])
        return self._result(text, answer_info(document, generation.usage))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        generation, document = await self._astart(messages, stop, kwargs)
        async for piece in aiter_pieces(generation):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield self._final_chunk(answer_info(document, generation.usage))


class InfoKVLLM(LLM, _InfoKVFields):
    """A completion LLM over one compressed document: the prompt is the user turn after the document.

    Streaming fires `on_llm_new_token` per piece; each generation's `generation_info` holds the finish
    reason and token usage as OpenAI's: `prompt_tokens` counts the document, `cached_tokens` of it served from the
    cache, and `total_tokens` is `prompt_tokens` + `completion_tokens`.
    """

    @property
    def _llm_type(self) -> str:
        return "infokv"

    def get_token_ids(self, text: str) -> list[int]:
        """By the model's own tokenizer (`get_num_tokens`, `trim_messages`), not LangChain's GPT-2 fallback."""
        return token_ids(self, text)

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self._infokv_identity()

    def generate(
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Any = None, **kwargs: Any
    ) -> LLMResult:
        # LangChain keys an LLM's answer cache on its fields alone, not on the call's kwargs: a call's options
        # become the fields of a copy, so that answers for another document or length are never served.
        options = _call_fields(self, kwargs)
        if options:
            return self._with_fields(options).generate(prompts, stop, callbacks, **kwargs)
        self._check_password(kwargs)  # before LangChain's answer cache, which keys on no password
        return super().generate(prompts, stop, callbacks, **kwargs)

    async def agenerate(
        self, prompts: list[str], stop: list[str] | None = None, callbacks: Any = None, **kwargs: Any
    ) -> LLMResult:
        options = _call_fields(self, kwargs)
        if options:
            return await self._with_fields(options).agenerate(prompts, stop, callbacks, **kwargs)
        self._check_password(kwargs)
        return await super().agenerate(prompts, stop, callbacks, **kwargs)

    def _with_fields(self, options: dict[str, Any]) -> InfoKVLLM:
        """A copy whose fields hold a call's options (`_call_fields`). It shares the document this LLM holds, unless
        the call chooses another, which it holds apart: this LLM's own is kept for its next calls."""
        copy = self.model_copy(update=options)
        if any(name in options for name in DOCUMENT_OPTIONS):
            copy._hold = DocumentHold()
        return copy

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "infokv"
        params["ls_model_name"] = self._model_name(kwargs)
        return params

    @staticmethod
    def _info(info: AnswerInfo) -> dict[str, Any]:
        return {**info.metadata(), "usage": info.token_counts()}

    @staticmethod
    def _check_prompts(prompts: list[str]) -> None:
        """Refuses a batch holding a prompt that cannot be asked before any prompt of it is answered."""
        for prompt in prompts:
            check_conversation([("user", prompt)])

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        generation, _ = self._start([("user", prompt)], stop, kwargs)
        return generation.text()

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        self._check_prompts(prompts)
        generations = []
        for prompt in prompts:
            if self.streaming:  # pieces reach on_llm_new_token as they are generated
                chunks = list(self._stream(prompt, stop, run_manager, **kwargs))
                text, info = "".join(c.text for c in chunks), chunks[-1].generation_info
            else:
                generation, document = self._start([("user", prompt)], stop, kwargs)
                text, info = generation.text(), self._info(answer_info(document, generation.usage))
            generations.append([Generation(text=text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model_name": self._model_name(kwargs)})

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        generation, document = self._start([("user", prompt)], stop, kwargs)
        for piece in generation:
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info(answer_info(document, generation.usage)))

    async def _acall(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        generation, _ = await asyncio.to_thread(self._start, [("user", prompt)], stop, kwargs)
        return "".join([piece async for piece in aiter_pieces(generation)])

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        self._check_prompts(prompts)
        generations = []
        for prompt in prompts:
            if self.streaming:
                chunks = [chunk async for chunk in self._astream(prompt, stop, run_manager, **kwargs)]
                text, info = "".join(c.text for c in chunks), chunks[-1].generation_info
            else:
                generation, document = await asyncio.to_thread(self._start, [("user", prompt)], stop, kwargs)
                text = "".join([piece async for piece in aiter_pieces(generation)])
                info = self._info(answer_info(document, generation.usage))
            generations.append([Generation(text=text, generation_info=info)])
        return LLMResult(generations=generations, llm_output={"model_name": self._model_name(kwargs)})

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        generation, document = await asyncio.to_thread(self._start, [("user", prompt)], stop, kwargs)
        async for piece in aiter_pieces(generation):
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info(answer_info(document, generation.usage)))
