"""LangChain adapters: the official standard suites, a real LCEL chain over a document, the example."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import pickle
import re
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy
import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")
pytest.importorskip("pytest_asyncio")

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LangChainDocument
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.load import dumpd, dumps
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    HumanMessage,
    HumanMessageChunk,
    SystemMessage,
    SystemMessageChunk,
    ToolMessage,
)
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate
from langchain_core.runnables import Runnable
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import ValidationError

from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag.documents import document_from_text
from infokv_rag.errors import (
    CacheStoreError,
    ConfigError,
    ContextLengthError,
    EmptyQuestionError,
    EncryptedPDFError,
    ModelError,
)
from infokv_rag.generation import GenerationOptions
from infokv_rag.integrations import _common
from infokv_rag.integrations._common import call_options, get_engine, open_document
from infokv_rag.integrations.langchain import ChatInfoKV, InfoKVLLM, _call_fields, messages_to_turns
from infokv_rag.store import save_document

from .conftest import CORPUS
from .helpers import (
    COMPRESSED,
    COMPRESSION,
    FACT_PAGES,
    QUESTION,
    record_engine_loads,
    record_texts_read_with_one_shared_document,
    rename_saved_model,
    run_example,
)
from .pdf_factory import encrypted_pdf

SUITE_TEXT = (
    "Welcome note. The Harbor Cafe opens at 8 am and closes at 6 pm. "
    "Guests can order coffee, tea and fresh pastries. The staff greet every guest warmly."
)
FACT_TEXT = "\n\n".join(FACT_PAGES)
OTHER_TEXT = (
    "Lab safety memo. The safety officer of the Nordvik laboratory is Tomas Okafor. "
    "Goggles must be worn at all times. Spills are reported to the front desk."
)


# The official standard suites ----------------------------------------------------------------------


class _NoToolCalling:
    """The suites tell tool calling and structured output by `bind_tools` being overridden; ChatInfoKV overrides it
    only to refuse it, saying why."""

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False


class TestChatInfoKVStandardUnit(_NoToolCalling, ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatInfoKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        # No max_tokens here: test_standard_params passes its own.
        return {"model": "tiny", "document_text": SUITE_TEXT}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # The suite also passes a hosted model's client settings (api_key, timeout, max_retries): ChatInfoKV has
        # none, and refuses a keyword that is no field of it rather than drop it unseen.
        params = super().standard_chat_model_params
        return {name: value for name, value in params.items() if name in ChatInfoKV.model_fields}


class TestChatInfoKVStandardIntegration(_NoToolCalling, ChatModelIntegrationTests):
    """On the tiny model; tool calling, structured output, JSON mode and media inputs are off through the
    suite's own properties (`has_tool_calling` / `has_structured_output` false: `_NoToolCalling`;
    `supports_*_inputs` false: text-only models), so those tests skip with the suite's reasons."""

    # The suite's coroutine tests need pytest-asyncio, which the project runs in strict mode, and the suite
    # forbids overriding its tests: mark the class, and silence the notice for its synchronous tests.
    pytestmark: ClassVar[list[pytest.MarkDecorator]] = [
        pytest.mark.tiny,
        pytest.mark.asyncio,
        pytest.mark.filterwarnings(
            "ignore:The test .* is marked with '@pytest.mark.asyncio' but it is not an async function"
        ),
    ]

    @property
    def chat_model_class(self) -> type[BaseChatModel]:
        return ChatInfoKV

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "tiny", "document_text": SUITE_TEXT, "max_tokens": 5}

    @property
    def model_override_value(self) -> str:
        # Another spelling of a model: the tiny model's local directory, loaded as a second engine.
        from infokv_rag.models import resolve_model_dir

        return str(resolve_model_dir("tiny"))

    @property
    def supported_usage_metadata_details(
        self,
    ) -> dict[
        Literal["invoke", "stream"],
        list[Literal["audio_input", "audio_output", "reasoning_output", "cache_read_input", "cache_creation_input"]],
    ]:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = self.chat_model_class(**self.chat_model_params)
        if not stream:
            return model.invoke("Hello")
        full = None
        for chunk in model.stream("Hello"):
            full = chunk if full is None else full + chunk
        assert isinstance(full, AIMessage)
        return full


# Adapter behaviour without weights -----------------------------------------------------------------


def test_messages_to_turns_folds_roles_and_rejects_non_text() -> None:
    turns = messages_to_turns(
        [
            SystemMessage("Be brief."),
            HumanMessage([{"type": "text", "text": "Hi"}]),
            AIMessage("Hello"),
            HumanMessage("Q?"),
        ]
    )
    assert turns == [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Q?")]
    with pytest.raises(ValueError, match="text only"):
        messages_to_turns([HumanMessage([{"type": "image", "base64": "AAAA", "mime_type": "image/png"}])])
    with pytest.raises(ValueError, match="no tool calling"):
        messages_to_turns([HumanMessage("q"), ToolMessage("3", tool_call_id="x")])
    with pytest.raises(ValueError, match="messages, not 'function'"):  # the role, not ChatMessage's type ("chat")
        messages_to_turns([ChatMessage(role="function", content="q")])
    # A streamed answer kept in the history is a chunk of its message class (LangChain's `full = full + chunk`).
    chunks = [
        SystemMessageChunk(content="Be brief."),
        HumanMessageChunk(content="Hi"),
        AIMessageChunk(content="Hello"),
        HumanMessage("Q?"),
    ]
    assert messages_to_turns(chunks) == turns


def test_tool_calling_and_structured_output_are_refused_saying_why() -> None:
    @tool
    def add(a: int, b: int) -> int:
        """Adds two numbers."""
        return a + b

    chat = ChatInfoKV(model="tiny", document_text=SUITE_TEXT)
    with pytest.raises(NotImplementedError, match="answers questions about its document.*no tool calling"):
        chat.bind_tools([add])
    with pytest.raises(NotImplementedError, match="no structured output"):
        chat.with_structured_output({"title": "A", "type": "object", "properties": {"a": {"type": "string"}}})


def test_a_document_of_another_type_is_refused_where_it_is_given(no_document_read: None) -> None:
    """A LangChain `Document` (what every loader returns) is refused naming the way its text comes in, anything else
    naming what is taken: when the adapter is made, and per call, not later by an opaque `os.fspath`."""
    pages = [LangChainDocument(page_content=SUITE_TEXT)]
    route = (
        r'not LangChain Documents: pass their text instead, document_text="\\n\\n".join\(d.page_content for d in docs\)'
    )
    for adapter in (ChatInfoKV, InfoKVLLM):
        for documents in (pages[0], pages, tuple(pages)):
            with pytest.raises(TypeError, match=rf"{adapter.__name__}'s document is a .pdf/.txt/.md path .*, {route}"):
                adapter(model="tiny", document=documents)
        for other, named in ((3, "int"), (b"contract.txt", "bytes"), (["contract.txt"], "list")):
            with pytest.raises(TypeError, match=rf"CompressedDocument or an infokv_rag Document; got {named}$"):
                adapter(model="tiny", document=other)
        with pytest.raises(TypeError, match=route):
            adapter(model="tiny", document_text=SUITE_TEXT).invoke("Q?", document=pages[0])
        for other, named in ((3, "int"), (b"contract", "bytes"), ([SUITE_TEXT], "list: join the pages' texts")):
            with pytest.raises(TypeError, match=rf"{adapter.__name__}'s document_text is .* a str; got {named}"):
                adapter(model="tiny", document_text=SUITE_TEXT).invoke("Q?", document_text=other)
        assert adapter(model="tiny", document=Path("contract.txt")).document == Path("contract.txt")  # os.PathLike
        assert adapter(model="tiny", document=document_from_text(SUITE_TEXT)).document is not None


def test_a_keyword_that_is_no_field_is_refused_when_the_adapter_is_made(no_document_read: None) -> None:
    """pydantic drops a keyword that is no field: the core's `max_new_tokens` or a misspelling would leave the adapter
    answering with its defaults (256 greedy tokens), where a call's kwargs refuse the same names."""
    misspelt: dict[str, Any] = {"max_new_tokens": 5, "temprature": 0.7}
    for adapter in (ChatInfoKV, InfoKVLLM):
        takes = r"which takes cache, callbacks, compression, .*max_tokens, .*temperature, top_p, verbose$"
        with pytest.raises(TypeError, match=rf"max_new_tokens, temprature: not a field of {adapter.__name__}, {takes}"):
            adapter(model="tiny", document_text=SUITE_TEXT, **misspelt)
        with pytest.raises(TypeError, match="api_key: not a field"):  # a hosted model's: none here
            adapter.model_validate({"model": "tiny", "api_key": "sk-..."})
        llm = adapter(model="tiny", document_text=SUITE_TEXT, max_tokens=5, tags=["qa"], streaming=True)
        assert (llm.max_tokens, llm.tags, llm.streaming) == (5, ["qa"], True)  # LangChain's fields are fields too


@pytest.mark.parametrize("adapter", [ChatInfoKV, InfoKVLLM])
def test_the_compression_survives_serialisation_with_its_method_settings(
    adapter: type[ChatInfoKV | InfoKVLLM], no_document_read: None
) -> None:
    """pydantic wrote a config's method settings as their base class, which has no fields (`{}`), and
    `CompressionConfig.to_dict` leaves out values (`summaries` 0, `layer_budgets` "uniform") that the constructor
    fills with today's defaults: the adapter made again from its dump compressed its document otherwise."""
    configs = [
        CompressionConfig(method="snapkv", keep=0.5, settings={"pooling_kernel": 7}),
        CompressionConfig(keep=64, recall=0.1, summaries=0, settings={"tau": 0.5, "layer_budgets": "uniform"}),
    ]
    for config in configs:
        llm = adapter(model="tiny", document_text=SUITE_TEXT, compression=config)
        assert llm.model_dump()["compression"]["settings"] == dataclasses.asdict(config)["settings"]
        assert adapter.model_validate(llm.model_dump()).compression == config
        assert adapter.model_validate_json(llm.model_dump_json()).compression == config
    assert adapter(model="tiny").model_dump()["compression"] is None


def test_a_documents_text_given_as_its_path_is_refused_saying_where_it_goes(no_document_read: None) -> None:
    """Text passed as `document=`: one longer than a file name may be (or holding a NUL) made the filesystem raise a
    bare OSError (ValueError); text with a line break was "not found"."""
    texts = ["The notice period is ninety days. " * 10, "Notice period:\nninety days.", "ninety\x00days"]
    as_text = r"is no file: it looks like the document's text, which goes in document_text="
    for adapter in (ChatInfoKV, InfoKVLLM):
        for text in texts:
            with pytest.raises(FileNotFoundError, match=as_text):
                adapter(model="tiny", document=text).invoke("What is the notice period?")
        with pytest.raises(FileNotFoundError, match="not found: .*or the text itself as document_text="):
            adapter(model="tiny", document="The notice period is ninety days.").invoke("What is the notice period?")


def test_an_option_given_as_none_keeps_the_adapters_own(random_model_dir: Path) -> None:
    """None is how LangChain leaves an option unset (`max_tokens=None`): the field holds, not the core's default.
    Where None means something (`recall`: the document's; `max_cache_tokens`: no cap) a call's None sets it."""
    fields: dict[str, Any] = {"max_tokens": 3, "temperature": 1.5, "top_p": 0.5, "seed": 7, "stop": ["ninety"]}
    chat = ChatInfoKV(model=str(random_model_dir), document_text=SUITE_TEXT, max_cache_tokens=64, recall=4, **fields)
    unset = {name: None for name in (*fields, "max_cache_tokens", "recall")}
    options = call_options(chat, unset)
    assert call_options(chat, {}) == GenerationOptions.build(
        max_new_tokens=3, temperature=1.5, top_p=0.5, stop=["ninety"], seed=7, max_cache_tokens=64, recall=4
    )
    assert options == GenerationOptions.build(
        max_new_tokens=3, temperature=1.5, top_p=0.5, stop=["ninety"], seed=7, max_cache_tokens=None, recall=None
    )
    traced = chat._get_ls_params(max_tokens=None, temperature=None)
    assert (traced["ls_max_tokens"], traced["ls_temperature"]) == (3, 1.5)
    assert chat._get_llm_string(max_tokens=None) == chat._get_llm_string()  # one answer, one cache entry
    question = "What is the notice period?"
    for adapter in (ChatInfoKV, InfoKVLLM):  # InfoKVLLM takes a call's options as the fields of a copy
        llm = adapter(model=str(random_model_dir), document_text=SUITE_TEXT, **fields)
        answer = llm.invoke(question, max_tokens=None, temperature=None, seed=None)
        assert _answer_text(answer) == _answer_text(llm.invoke(question))


def test_weights_load_lazily(tmp_path: Path) -> None:
    path = tmp_path / "doc.txt"
    path.write_text(FACT_TEXT)
    chat = ChatInfoKV(model="no-such-model", document=str(path))  # nothing is loaded yet
    assert chat._get_ls_params()["ls_model_name"] == "no-such-model"
    with pytest.raises(ModelError, match="no-such-model"):
        chat.invoke("Who is the account manager?")
    with pytest.raises(ValueError, match="no document bound"):
        ChatInfoKV(model="tiny").invoke("hello")


def test_bad_options_and_messages_are_refused_before_the_document_is_read(no_document_read: None) -> None:
    """Reading a document takes seconds to minutes: a call's options and messages are checked first, and the fields
    when the adapter is made."""
    for adapter in (ChatInfoKV, InfoKVLLM):
        # A bool is no number here: pydantic's lax mode read seed=True as the seed 1 and recall=True as all of it.
        bools = [(name, True) for name in ("max_tokens", "temperature", "top_p", "seed", "max_cache_tokens", "recall")]
        # What every call would refuse is refused when the adapter is made, as the core refuses it.
        beyond = [("temperature", math.inf), ("recall", -1), ("recall", math.nan), ("recall", 1.5), ("seed", 2**70)]
        for field, value in (("max_tokens", 0), ("max_tokens", -1), ("top_p", 0.0), ("temperature", -1.0), *bools):
            bad: dict[str, Any] = {field: value}
            with pytest.raises(ValidationError, match=field):
                adapter(model="tiny", document_text=SUITE_TEXT, **bad)
        for field, value in beyond:
            refused: dict[str, Any] = {field: value}
            with pytest.raises(ValidationError, match=field):
                adapter(model="tiny", document_text=SUITE_TEXT, **refused)
        # What pydantic converts otherwise is taken, as it was (a config's string, a whole float).
        converted: dict[str, Any] = {"max_tokens": 8.0, "temperature": "0.2", "seed": 7.0}
        adapter(model="tiny", document_text=SUITE_TEXT, **converted)
        # A stop given as one string is one sequence, as a call's is; a model's path may be a pathlib.Path.
        made = adapter(model=Path("tiny"), document_text=SUITE_TEXT, stop="\n")  # type: ignore[arg-type]
        assert made.stop == ["\n"] and made.model == "tiny"
        assert _call_fields(made, {"model": Path("default")}) == {"model": "default"}  # a call's too
        # numpy's integer is an int, so that a recall count stays a count (lax mode made np.int64(1) the ratio 1.0,
        # the whole cold tier); numpy's bool is refused as Python's is.
        numpy_values: dict[str, Any] = {"count": numpy.int64(1), "bool": numpy.bool_(True)}
        counted = adapter(model="tiny", document_text=SUITE_TEXT, recall=numpy_values["count"])
        assert counted.recall == 1 and type(counted.recall) is int
        with pytest.raises(ValidationError, match="recall"):
            adapter(model="tiny", document_text=SUITE_TEXT, recall=numpy_values["bool"])
        refusals: list[tuple[type[Exception], str, Any]] = [
            (ConfigError, "unknown option.*max_new_tokens", lambda llm: llm.invoke("hi", max_new_tokens=4)),
            (ConfigError, "max_tokens must be >= 1", lambda llm: llm.invoke("hi", max_tokens=0)),
            (ConfigError, "lone surrogate", lambda llm: list(llm.stream("hi \ud800"))),
            (EmptyQuestionError, "empty", lambda llm: llm.invoke("  \n\t")),
            (EmptyQuestionError, "empty", lambda llm: list(llm.stream("\x00"))),
            (EmptyQuestionError, "empty", lambda llm: asyncio.run(llm.ainvoke(""))),
        ]
        # A text no other test reads: opening it would load weights (`get_engine`), which is refused above.
        llm = adapter(model="tiny", document_text=f"{SUITE_TEXT} Read by no call of {adapter.__name__}.")
        for kind, message, call in refusals:
            with pytest.raises(kind, match=message):
                call(llm)
    # A completion batch is checked whole before any prompt of it is answered (this document would be read first).
    for batch in (
        lambda llm: llm.generate(["What is the fee?", " "]),
        lambda llm: llm.batch(["What is the fee?", "Who pays?", ""]),
        lambda llm: asyncio.run(llm.agenerate(["What is the fee?", "\x00"])),
    ):
        with pytest.raises(EmptyQuestionError, match="empty"):
            batch(InfoKVLLM(model="tiny", document_text=f"{SUITE_TEXT} Read by no batch."))
    # A chat's question is its last user message: an empty one there is refused, whatever came before.
    chat = ChatInfoKV(model="tiny", document_text=f"{SUITE_TEXT} Read by no chat.")
    with pytest.raises(EmptyQuestionError, match="last user message"):
        chat.invoke([SystemMessage("Be brief."), HumanMessage("Q?"), AIMessage("A."), HumanMessage(" \u200b")])


def test_a_directory_that_is_no_saved_cache_is_named_as_the_core_names_it(
    tmp_path: Path, no_document_read: None
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "contract.pdf").write_bytes(b"%PDF-1.4")
    with pytest.raises(IsADirectoryError, match="reports is a directory; give the path of a PDF or text file, or a"):
        ChatInfoKV(model="tiny", document=str(reports)).invoke("Q?")
    damaged = tmp_path / "cache"  # a saved cache's files without its manifest
    damaged.mkdir()
    (damaged / "tensors.safetensors").write_bytes(b"")
    (damaged / "document.txt").write_text(SUITE_TEXT)
    with pytest.raises(CacheStoreError, match=r"not a saved document cache \(no manifest.json\)"):
        InfoKVLLM(model="tiny", document=str(damaged)).invoke("Q?")
    with pytest.raises(FileNotFoundError, match="not found"):
        ChatInfoKV(model="tiny", document=str(tmp_path / "missing.pdf")).invoke("Q?")
    # Where a model shows itself (its answer-cache key, traces), such a path is named as given, not refused.
    assert str(reports) in ChatInfoKV(model="tiny", document=str(reports))._get_llm_string()


# On the tiny model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fact_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lc") / "agreement.txt"
    path.write_text(FACT_TEXT)
    return path


def _chain(chat: Runnable[LanguageModelInput, AIMessage]) -> Runnable[dict[str, Any], str]:
    return ChatPromptTemplate.from_messages([("human", QUESTION)]) | chat | StrOutputParser()


@pytest.mark.tiny
def test_lcel_chain_invoke_stream_astream_reads_fact(fact_file: Path) -> None:
    chat = ChatInfoKV(model="tiny", document=str(fact_file), compression=COMPRESSION, max_tokens=12)
    chain = _chain(chat)
    question = {"question": "Who is the account manager?"}
    answer = chain.invoke(question)
    assert "Lindqvist" in answer
    pieces = list(chain.stream(question))
    assert len(pieces) > 1 and "".join(pieces) == answer  # greedy: the same answer, piece by piece

    async def collect() -> list[str]:
        return [piece async for piece in chain.astream(question)]

    assert "".join(asyncio.run(collect())) == answer


@pytest.mark.tiny
def test_chain_answers_are_the_engines_answers_on_a_compressed_cache(fact_file: Path) -> None:
    chat = ChatInfoKV(model="tiny", document=str(fact_file), compression=COMPRESSED, max_tokens=12)
    question = {"question": "Who is the account manager?"}
    message = (ChatPromptTemplate.from_messages([("human", QUESTION)]) | chat).invoke(question)
    document = chat.compressed_document()
    assert document.stats.method == "infokv" and document.stats.compression_ratio < 1
    expected = document.generate([("user", QUESTION.format(**question))], GenerationOptions(max_new_tokens=12))
    assert message.content == expected.text()  # the adapter adds nothing to the model's answer
    usage = message.usage_metadata
    assert usage is not None and usage["input_token_details"]["cache_read"] == document.stats.document_tokens
    assert usage["input_tokens"] == document.stats.document_tokens + expected.usage.prompt_tokens
    assert usage["output_tokens"] == expected.usage.completion_tokens
    metadata = message.response_metadata
    assert metadata["model_name"] == "tiny" and metadata["finish_reason"] == expected.usage.finish_reason
    assert metadata["compression"] == document.stats.to_dict()


@pytest.mark.tiny
def test_bind_switches_document_file_and_saved_cache(fact_file: Path, tmp_path: Path) -> None:
    chat = ChatInfoKV(model="tiny", document=str(fact_file), compression=COMPRESSION, max_tokens=12)
    engine = get_engine("tiny")
    other = engine.ingest_text(OTHER_TEXT, COMPRESSION)
    saved = tmp_path / "other-cache"
    save_document(other, saved)
    question = {"question": "Who is the safety officer?"}
    from_object = _chain(chat.bind(document=other)).invoke(question)
    assert "Tomas" in from_object
    assert _chain(chat.bind(document=str(saved))).invoke(question) == from_object
    assert open_document(str(saved), model="tiny").engine is engine  # the loaded cache shares the engine


@pytest.mark.tiny
def test_stop_max_tokens_temperature(fact_file: Path) -> None:
    chat = ChatInfoKV(model="tiny", document=str(fact_file), compression=COMPRESSION, max_tokens=12)
    prompt = QUESTION.format(question="Who is the account manager?")
    full = chat.invoke(prompt)
    assert "Lindqvist" in full.content
    stopped = chat.invoke(prompt, stop=["Lindqvist"])
    assert "Lindqvist" not in stopped.content and stopped.response_metadata["finish_reason"] == "stop"
    assert isinstance(full.content, str) and isinstance(stopped.content, str)
    assert full.content.startswith(stopped.content)
    short = chat.bind(max_tokens=2).invoke(prompt)
    assert short.usage_metadata is not None
    assert short.usage_metadata["output_tokens"] == 2 and short.response_metadata["finish_reason"] == "length"
    sampled = chat.bind(temperature=0.8, seed=3).invoke(prompt)
    assert sampled.usage_metadata is not None
    assert sampled.usage_metadata["output_tokens"] >= 1


@pytest.mark.tiny
def test_astream_does_not_block_the_event_loop(fact_file: Path) -> None:
    chat = ChatInfoKV(model="tiny", document=str(fact_file), compression=COMPRESSION, max_tokens=6)
    chat.compressed_document()  # read beforehand: the test measures answering

    async def main() -> tuple[int, int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        chunks = [chunk async for chunk in chat.astream("Who is the account manager?")]
        done.set()
        await task
        return ticks, len(chunks)

    started = time.perf_counter()
    ticks, chunks = asyncio.run(main())
    elapsed = time.perf_counter() - started
    assert chunks >= 2
    # A blocked loop ticks about once per decoding step; a free one every few milliseconds.
    assert ticks >= max(10, elapsed / 0.05)


class _TokenRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str | list[str | dict[str, Any]], **kwargs: Any) -> None:
        assert isinstance(token, str), token  # a completion LLM streams text
        self.tokens.append(token)


@pytest.mark.tiny
def test_completion_llm_chain_streams_tokens_to_callbacks(fact_file: Path) -> None:
    llm = InfoKVLLM(model="tiny", document=str(fact_file), compression=COMPRESSION, max_tokens=10, streaming=True)
    chain = PromptTemplate.from_template(QUESTION) | llm | StrOutputParser()
    recorder = _TokenRecorder()
    answer = chain.invoke({"question": "What is the notice period?"}, config={"callbacks": [recorder]})
    assert "90" in answer or "ninety" in answer.lower()
    assert len(recorder.tokens) > 1 and "".join(recorder.tokens) == answer
    result = llm.generate([QUESTION.format(question="What is the notice period?")])
    info = result.generations[0][0].generation_info
    assert info is not None
    assert info["usage"]["cached_tokens"] == llm.compressed_document().stats.document_tokens
    assert info["model_name"] == "tiny"

    async def astream() -> list[str]:
        return [piece async for piece in llm.astream(QUESTION.format(question="What is the notice period?"))]

    assert "".join(asyncio.run(astream())) == answer


@pytest.mark.tiny
def test_example_langchain_chain_runs(fact_file: Path) -> None:
    lines = run_example("langchain_chain.py", fact_file, "Who is the account manager?")
    assert lines[0].startswith("document: ") and "tokens" in lines[0]
    assert any(line.startswith("Q: Who is the account manager?") for line in lines)
    answer = next(line for line in lines if line.startswith("A: "))
    assert "Lindqvist" in answer
    assert lines[-1].startswith("usage: ") and "cache_read" in lines[-1]


# On the default model ------------------------------------------------------------------------------


@pytest.mark.default
def test_lcel_chain_on_default_model_reads_compressed_fact() -> None:
    # End to end through a compressed cache (InfoKV keeping 3/4 of a ~185-token document); the default model
    # reads the phone number from it, where the tiny one cannot be relied on. Entropy, not the default
    # surprisal: on this short document surprisal's sentence means rank the long phone sentence below
    # the short headings and it is dropped (a known weakness, see the README's quality notes); this
    # test is about the adapter's path through a compressed cache.
    text = OTHER_TEXT + " " + FACT_TEXT.replace("\n", " ")
    compression = CompressionConfig(keep=0.75, settings={"information": "entropy"})
    chat = ChatInfoKV(model="default", document_text=text, compression=compression, max_tokens=16)
    chain = _chain(chat)
    answer = "".join(chain.stream({"question": "What is the phone number of the account manager?"}))
    assert "555-0142" in answer


# The cold tier, on the random model -------------------------------------------------------------------

COLD_TEXT = " ".join(CORPUS * 6)
# Passed as a dict, which the adapters take: pydantic types their __init__ by a field's validated type
# (CompressionConfig), not by what its before-validator accepts, hence `type: ignore[arg-type]` where one is passed.
COLD = {"keep": 0.25, "recall": 0.1, "cold_bits": 8}


def test_recall_from_compression_and_per_call(random_model_dir: Path) -> None:
    chat = ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, compression=COLD, max_tokens=2)  # type: ignore[arg-type]
    document = chat.compressed_document()
    assert document.cold_tier is not None and document.cold_tier.bits == 8
    layers = len(document.cold_tier.layers)
    by_default = chat.invoke("What is the notice period?")
    assert by_default.response_metadata["recalled_tokens"] > 0  # the compression's recall
    compression = by_default.response_metadata["compression"]
    assert compression["cold_bytes"] == document.stats.cold_bytes > 0 and compression["cache_bytes"] > 0
    bound = chat.bind(recall=16).invoke("What is the notice period?")
    assert bound.response_metadata["recalled_tokens"] == 16 * layers
    expected = document.generate(
        [("user", "What is the notice period?")], GenerationOptions(max_new_tokens=2, recall=16)
    )
    assert bound.content == expected.text()
    assert chat.invoke("What is the notice period?", recall=0).response_metadata["recalled_tokens"] == 0

    llm = InfoKVLLM(model=str(random_model_dir), document_text=COLD_TEXT, compression=COLD, max_tokens=2, recall=4)  # type: ignore[arg-type]
    result = llm.generate(["What is the notice period?"])
    info = result.generations[0][0].generation_info
    assert info is not None and info["recalled_tokens"] == 4 * layers
    assert llm._identifying_params["recall"] == 4 and llm._identifying_params["compression"]["recall"] == 0.1


def test_tokens_are_counted_and_stop_strings_read_as_the_model_does(random_model_dir: Path) -> None:
    text = "Either party may terminate this agreement with ninety days written notice."
    chat = ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=6)
    tokenizer = chat.compressed_document().engine.tokenizer
    expected = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    for adapter in (chat, InfoKVLLM(model=str(random_model_dir), document_text=COLD_TEXT)):
        assert adapter.get_num_tokens(text) == expected  # not LangChain's GPT-2 fallback
    assert chat.get_num_tokens_from_messages([HumanMessage(text)]) >= expected
    # A stop given as a string is one sequence, as the core takes it, not a stop at any of its characters.
    assert call_options(chat, {}, "ninety").stop == ("ninety",)
    assert call_options(chat, {}, ["ninety", ""]).stop == ("ninety",)


def test_the_adapters_count_the_document_in_the_prompt_tokens(random_model_dir: Path) -> None:
    """As OpenAI's usage and the service's `/v1/chat/completions`: `InfoKVLLM`'s prompt tokens left the document out
    (and it gave no total), where `ChatInfoKV`'s input tokens hold it."""
    question = "What is the notice period?"
    chat = ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=3)
    metadata = chat.invoke(question).usage_metadata
    assert metadata is not None
    document_tokens = chat.compressed_document().stats.document_tokens
    expected = {
        "prompt_tokens": metadata["input_tokens"],
        "cached_tokens": document_tokens,
        "completion_tokens": 3,
        "total_tokens": metadata["input_tokens"] + 3,
    }
    assert metadata["input_token_details"].get("cache_read") == document_tokens < metadata["input_tokens"]
    assert metadata["total_tokens"] == expected["total_tokens"]
    llm = InfoKVLLM(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=3)
    for streaming in (False, True):
        info = llm.model_copy(update={"streaming": streaming}).generate([question]).generations[0][0].generation_info
        assert info is not None and info["usage"] == expected, streaming


@pytest.mark.parametrize("adapter", [ChatInfoKV, InfoKVLLM])
def test_an_adapter_keeps_its_document_when_the_shared_cache_evicts_it(
    adapter: type[ChatInfoKV | InfoKVLLM], random_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process's shared cache evicts documents other adapters opened since: an adapter that held none of its own
    read (prefilled and compressed) its document again on every call. A call's own options (for `InfoKVLLM` the
    fields of a copy) answer from the document held, and a call's own document leaves it held."""
    ingested = record_texts_read_with_one_shared_document(monkeypatch)
    first, second = (
        adapter(model=str(random_model_dir), document_text=f"Contract {number}: the notice period is {number} days.")
        for number in (1, 2)
    )
    question = "What is the notice period?"
    for llm in (first, second, first, second):
        llm.invoke(question, max_tokens=1)
    assert len(ingested) == 2, "each adapter reads its document once, though the shared cache holds one"
    first.invoke(question, max_tokens=1, document_text=OTHER_TEXT)
    first.invoke(question, max_tokens=1)
    assert ingested[2:] == [OTHER_TEXT], "a call's own document is read apart; the adapter's own stays held"
    first.document_text = "Contract 3: the notice period is 3 days."
    assert first.compressed_document().document.text == first.document_text and len(ingested) == 4


def test_recall_without_a_cold_tier_is_refused(random_model_dir: Path) -> None:
    chat = ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, compression={"keep": 0.25}, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no cold tier"):
        chat.invoke("What is the notice period?", recall=0.1)


def test_the_answer_cache_tells_apart_what_changes_an_answer(random_model_dir: Path) -> None:
    """LangChain's answer cache keys on the model's identity: stop sequences, seed, device and dtype change an
    answer, so two models that differ in one must not share cached answers."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    def chat(**fields: Any) -> ChatInfoKV:
        return ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=6, **fields)

    plain = chat()
    for other in (chat(stop=["the"]), chat(seed=2, temperature=1.0), chat(dtype="bf16")):
        assert other._get_llm_string() != plain._get_llm_string()
    set_llm_cache(InMemoryCache())
    try:
        unstopped = plain.invoke("What is the notice period?").content
        stop = str(unstopped).split()[1] if len(str(unstopped).split()) > 1 else str(unstopped)[1:]
        stopped = chat(stop=[stop]).invoke("What is the notice period?").content
        assert stopped != unstopped and stop not in stopped
    finally:
        set_llm_cache(None)


def _answer_text(answer: str | AIMessage) -> str:
    return answer if isinstance(answer, str) else str(answer.content)


def test_the_answer_cache_keys_on_the_document_content_and_the_call_options(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """Two documents with the same name, one document compressed two ways, a file edited in place, and a call's
    own document (which LangChain leaves out of an LLM's key): never one's cached answer for the other."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    model = str(random_model_dir)
    first, second = COLD_TEXT, " ".join(reversed(CORPUS * 6))
    same_name = [document_from_text(text, source="contract.txt") for text in (first, second)]
    keys = {ChatInfoKV(model=model, document=document)._get_llm_string() for document in same_name}
    kept = [open_document(text=first, model=model, config={"keep": keep}) for keep in (0.25, 0.9)]
    keys |= {ChatInfoKV(model=model, document=document)._get_llm_string() for document in kept}
    path = tmp_path / "contract.txt"
    path.write_text(first)
    keys.add(ChatInfoKV(model=model, document=str(path))._get_llm_string())
    path.write_text(second)
    keys.add(ChatInfoKV(model=model, document=str(path))._get_llm_string())
    chat = ChatInfoKV(model=model, max_tokens=2)
    keys |= {chat._get_llm_string(document=str(path)), chat._get_llm_string(document=kept[0])}
    assert len(keys) == 8
    for adapter in (InfoKVLLM, ChatInfoKV):
        llm = adapter(model=model, document_text=first, max_tokens=6)
        fresh = [_answer_text(llm.invoke("Q?", document_text=text)) for text in (first, second)]
        set_llm_cache(InMemoryCache())
        try:
            cached = [_answer_text(llm.invoke("Q?", document_text=text)) for text in (first, second)]
        finally:
            set_llm_cache(None)
        assert fresh[0] != fresh[1] and cached == fresh, adapter


def test_a_misspelt_option_is_refused_and_the_repr_stays_small(random_model_dir: Path) -> None:
    chat = ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=2)
    for option in ("max_new_tokens", "max_token", "stop_sequences"):
        with pytest.raises(ConfigError, match=f"unknown option.*{option}"):
            chat.invoke("What is the notice period?", **{option: 2})  # type: ignore[arg-type]
    # LangChain's own `stream` option (streaming on or off for one call) is LangChain's, not a misspelling.
    answer = chat.invoke("What is the notice period?").content
    assert chat.invoke("What is the notice period?", stream=False).content == answer
    assert chat.invoke("What is the notice period?", stream=True).content == answer
    assert chat.bind(stream=False).invoke("What is the notice period?").content == answer
    assert asyncio.run(chat.ainvoke("What is the notice period?", stream=False)).content == answer
    # A model holding a compressed document: its repr goes into every trace, so not the tensors.
    held = ChatInfoKV(document=chat.compressed_document(), max_tokens=2)
    assert len(repr(held)) < 2000 and "CompressedDocument(" in repr(held)


def test_an_adapter_that_answered_can_be_copied_and_pickled(random_model_dir: Path) -> None:
    """A deep copy or a pickle (a chain copied, shipped to a worker process) reads its own document on its first
    call: the held document's engine holds locks, which made an adapter that had answered once uncopyable."""
    adapters: list[ChatInfoKV | InfoKVLLM] = [
        ChatInfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=3),
        InfoKVLLM(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=3),
    ]
    for adapter in adapters:
        first = adapter.invoke("What is the notice period?")
        for copied in (copy.deepcopy(adapter), adapter.model_copy(deep=True), pickle.loads(pickle.dumps(adapter))):
            again = copied.invoke("What is the notice period?")
            assert getattr(again, "content", again) == getattr(first, "content", first), type(adapter).__name__
        # Given a document held in memory: a deep copy shares it (it cannot be read again from anywhere), a pickle
        # is refused saying how to ship it, and the dumps describe it (no engine, no tensors: traces hold them).
        held = adapter.compressed_document()
        assert copy.copy(held) is held and copy.deepcopy(held) is held
        given = type(adapter)(document=held, max_tokens=3)
        for copied in (copy.deepcopy(given), given.model_copy(deep=True)):
            answer = copied.invoke("What is the notice period?")
            assert copied.document is held and getattr(answer, "content", answer) == getattr(first, "content", first)
        with pytest.raises(TypeError, match=r"not pickled: save it \(doc.save\(directory\)\)"):
            pickle.dumps(given)
        dumped = given.model_dump()
        assert dumped["document"] == {
            "not_serialised": "CompressedDocument",
            "source": None,
            "pages": 1,
            "sha256": held.document.sha256,
        }
        assert json.loads(given.model_dump_json())["document"] == dumped["document"]
        with pytest.raises(TypeError, match="serialised with a CompressedDocument .*document=... with the dump"):
            type(adapter)(**dumped)
        assert type(adapter)(**{**dumped, "document": held}).document is held


def test_a_password_opens_an_encrypted_pdf_and_is_never_shown(random_model_dir: Path, tmp_path: Path) -> None:
    path = encrypted_pdf(tmp_path / "locked.pdf", FACT_PAGES, "s3cret")
    model = str(random_model_dir)
    with pytest.raises(EncryptedPDFError, match="password="):
        ChatInfoKV(model=model, document=str(path), max_tokens=2).invoke("Who is the account manager?")
    for adapter in (ChatInfoKV, InfoKVLLM):
        llm = adapter(model=model, document=str(path), password="s3cret", max_tokens=2)
        assert "Lindqvist" in llm.compressed_document().document.text
        llm.invoke("Who is the account manager?")
        llm.invoke("Who is the account manager?", document=str(path))  # a call's own document opens with it too
        # Where a model shows itself: its repr, its dumps, LangChain's serialisation (traces) and answer-cache key.
        shown = [repr(llm), str(llm), str(llm.model_dump()), llm.model_dump_json(), str(llm.asdict())]
        shown += [json.dumps(dumpd(llm)), dumps(llm), str(llm.to_json())]
        if isinstance(llm, ChatInfoKV):  # an LLM's answer-cache key is its asdict(), above
            shown.append(llm._get_llm_string())
        assert not [text for text in shown if "s3cret" in text], adapter


def test_a_wrong_or_missing_password_is_refused_after_the_file_was_read(random_model_dir: Path, tmp_path: Path) -> None:
    """A document read once is shared in the process, but not with a call that could not open it: the password is
    checked against the file on every open."""
    path = encrypted_pdf(tmp_path / "locked.pdf", FACT_PAGES, "s3cret")
    model = str(random_model_dir)
    opened = ChatInfoKV(model=model, document=str(path), password="s3cret", max_tokens=2)
    document = opened.compressed_document()
    opened.invoke("Who is the account manager?")
    for adapter in (ChatInfoKV, InfoKVLLM):
        for password, message in ((None, "needs a password"), ("guess", "Wrong password")):
            llm = adapter(model=model, document=str(path), password=password, max_tokens=2)
            with pytest.raises(EncryptedPDFError, match=message):
                llm.invoke("Who is the account manager?")
            with pytest.raises(EncryptedPDFError, match=message):
                llm.compressed_document()
            other = adapter(model=model, document_text=COLD_TEXT, password=password, max_tokens=2)
            with pytest.raises(EncryptedPDFError, match=message):  # a call's own document
                other.invoke("Who is the account manager?", document=str(path))
        again = adapter(model=model, document=str(path), password="s3cret", max_tokens=2)
        assert again.compressed_document() is document  # the right password: the document read once
    assert "s3cret" not in repr(list(_common._DOCUMENTS._values))  # the shared documents' keys hold no password


@pytest.mark.parametrize("adapter", [ChatInfoKV, InfoKVLLM])
def test_a_cached_answer_never_reaches_a_call_without_the_right_password(
    adapter: type[ChatInfoKV] | type[InfoKVLLM], random_model_dir: Path, tmp_path: Path
) -> None:
    """LangChain's answer cache is read before the adapter opens the document, and its key holds no password: the
    password is checked before that."""
    from langchain_core.caches import InMemoryCache
    from langchain_core.globals import set_llm_cache

    path = encrypted_pdf(tmp_path / "locked.pdf", FACT_PAGES, "s3cret")
    model = str(random_model_dir)
    cache = InMemoryCache()
    set_llm_cache(cache)
    try:
        adapter(model=model, document=str(path), password="s3cret", max_tokens=2).invoke("Who is the manager?")
        assert cache._cache, "the answer was cached"
        for password, message in ((None, "needs a password"), ("guess", "Wrong password")):
            llm = adapter(model=model, document=str(path), password=password, max_tokens=2)
            with pytest.raises(EncryptedPDFError, match=message):
                llm.invoke("Who is the manager?")
            with pytest.raises(EncryptedPDFError, match=message):
                asyncio.run(llm.ainvoke("Who is the manager?"))
    finally:
        set_llm_cache(None)


def test_a_saved_cache_is_answered_as_saved_or_refuses_another_compression(
    random_model_dir: Path, tmp_path: Path
) -> None:
    """A saved cache cannot be compressed again: `compression` left unset takes it as saved; one given must be its
    own (its recall, each answer's default, may differ), or the call is refused naming both."""
    model = str(random_model_dir)
    saved = tmp_path / "cache"
    save_document(get_engine(model).ingest_text(COLD_TEXT, CompressionConfig(keep=0.25, recall=0.1)), saved)
    unset = ChatInfoKV(model=model, document=str(saved), max_tokens=2)
    document = unset.compressed_document()
    assert document.config.keep == 0.25 and document.cold_tier is not None
    assert unset.invoke("What is the notice period?").response_metadata["recalled_tokens"] > 0
    for compression, given in (({"keep": 0.9, "recall": 0.1}, "keep=0.9"), ({"keep": 0.25}, "recall=0")):
        chat = ChatInfoKV(model=model, document=str(saved), compression=compression, max_tokens=2)  # type: ignore[arg-type]
        refused = rf"compressed with method=infokv, .*but the compression given has method=infokv, .*{given}"
        with pytest.raises(ConfigError, match=refused):
            chat.invoke("What is the notice period?")
        with pytest.raises(ConfigError, match="compression given"):  # per call too
            unset.invoke("What is the notice period?", compression=compression)
    same = ChatInfoKV(model=model, document=str(saved), compression={"keep": 0.25, "recall": 0.1}, max_tokens=2)  # type: ignore[arg-type]
    assert same.compressed_document() is document
    fewer = ChatInfoKV(model=model, document=str(saved), compression={"keep": 0.25, "recall": 4}, max_tokens=2)  # type: ignore[arg-type]
    assert fewer.compressed_document().cache is document.cache and fewer.compressed_document().config.recall == 4
    assert document.cold_tier is not None
    recalled = fewer.invoke("What is the notice period?").response_metadata["recalled_tokens"]
    assert recalled == 4 * len(document.cold_tier.layers)


def test_a_bound_document_of_a_model_in_memory_is_fingerprinted_before_any_async_call(
    random_model_dir: Path,
) -> None:
    """`ainvoke` reads the answer cache's key on the event loop, and a `from_model` engine's fingerprint hashes
    every weight (InfoKV reads it at ingestion for its surrogate; other methods do not): it is computed when the
    document is bound, so no call blocks the loop on it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    engine = InfoKVEngine.from_model(model, AutoTokenizer.from_pretrained(random_model_dir))
    document = engine.ingest_text(SUITE_TEXT, CompressionConfig(method="snapkv", keep=0.5))  # no surrogate read
    assert "fingerprint" not in vars(engine)
    ChatInfoKV(document=document, max_tokens=2)
    assert "fingerprint" in vars(engine)


def test_a_saved_cache_is_answered_by_the_model_that_made_it(
    random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `model` unset, a saved cache directory is opened, counted and traced with the model its manifest names,
    never the default (which would load only to refuse it); a model named there that does not load here is refused
    saying so."""
    model = str(random_model_dir)
    saved = tmp_path / "cache"
    save_document(get_engine(model).ingest_text(SUITE_TEXT, COMPRESSION), saved)
    loaded = record_engine_loads(monkeypatch)
    text = "Either party may terminate this agreement with ninety days written notice."
    expected = len(get_engine(model).tokenizer(text, add_special_tokens=False)["input_ids"])
    for adapter in (ChatInfoKV(document=str(saved), max_tokens=2), InfoKVLLM(document=saved, max_tokens=2)):
        assert adapter._get_ls_params()["ls_model_name"] == model
        assert adapter._identifying_params["model"] == model
        assert adapter.get_num_tokens(text) == expected
        assert adapter.compressed_document().engine.name == model
        assert adapter.invoke("What is the notice period?")
    bound = ChatInfoKV(max_tokens=2).bind(document=str(saved))  # a call's document: its model too
    assert bound.invoke("What is the notice period?").response_metadata["model_name"] == model
    assert set(loaded) == {model}

    moved = str(tmp_path / "moved" / "model")
    rename_saved_model(saved, moved)
    for call in (
        lambda: ChatInfoKV(document=str(saved), max_tokens=2).invoke("Q?"),
        lambda: InfoKVLLM(document=str(saved)).get_num_tokens(text),
    ):
        refused = f"the saved cache {saved.resolve()} was made by model {moved!r}, which does not load here"
        with pytest.raises(ModelError, match=re.escape(refused)):
            call()
    assert ChatInfoKV(model=model, document=str(saved), max_tokens=2).invoke("What is the notice period?")


def test_a_call_s_own_document_is_read_by_the_model_of_the_bound_one(random_engine: InfoKVEngine) -> None:
    """An adapter bound to a document that the caller's engine read (a model in memory, which may load by no name)
    reads a call's text with that engine: not with the default model, loaded beside it and answering instead."""
    bound = random_engine.ingest_text(SUITE_TEXT, CompressionConfig(keep=0.5))
    loaded = _common.loaded_models()
    for adapter in (ChatInfoKV(document=bound, max_tokens=2), InfoKVLLM(document=bound, max_tokens=2)):
        text = f"{SUITE_TEXT} Read per call by {type(adapter).__name__}."
        assert adapter.compressed_document(document_text=text).engine is random_engine
        adapter.invoke("What is the fee?", document_text=text)
        assert adapter._identifying_params["model"] == random_engine.name
    assert _common.loaded_models() == loaded
    # The advice of a refusal names the adapters' option, max_tokens, which a call takes (not the core's name).
    with pytest.raises(ContextLengthError, match="lower max_tokens") as refused:
        ChatInfoKV(document=bound).invoke("What is the fee?", max_tokens=random_engine.context_window)
    assert "max_new_tokens" not in str(refused.value)


def test_a_document_s_text_is_no_part_of_the_repr(random_model_dir: Path) -> None:
    """The repr goes into every trace (LangChain serialises a model it cannot serialise by its repr): the text of a
    document is named by its length and digest; the answer cache's key still holds what the answers depend on."""
    text = "The fee is 9 euros. " * 1000
    for adapter in (ChatInfoKV, InfoKVLLM):
        llm = adapter(model=str(random_model_dir), document_text=text)
        assert len(repr(llm)) < 1000 and "20000 characters, sha256 " in repr(llm), repr(llm)
        assert len(json.dumps(dumpd(llm))) < 2000
        other = adapter(model=str(random_model_dir), document_text=text + ".")
        assert llm._identifying_params["document"] != other._identifying_params["document"]
        loaded = adapter(model=str(random_model_dir), document=document_from_text(text))  # a loaded Document too
        assert len(repr(loaded)) < 1000 and "20000 characters, sha256 " in repr(loaded), repr(loaded)
