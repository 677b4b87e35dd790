"""LlamaIndex adapters: the InfoKV LLM (metadata, complete/chat, streaming, async) and the query engine."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import math
import pickle
import re
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core import SimpleDirectoryReader
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.base.response.schema import Response
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.prompts import PromptTemplate
from llama_index.core.schema import Document as LlamaDocument
from pydantic import SecretStr, ValidationError

from infokv_rag import CompressedDocument, CompressionConfig
from infokv_rag.citations import supporting_pages
from infokv_rag.documents import Document, document_from_pages, document_from_text
from infokv_rag.errors import ConfigError, EmptyQuestionError, EncryptedPDFError, ModelError
from infokv_rag.generation import GenerationOptions
from infokv_rag.integrations import _common
from infokv_rag.integrations._common import call_options, get_engine
from infokv_rag.integrations.llama_index import DocumentQueryEngine, InfoKV, messages_to_turns
from infokv_rag.prompt import question_turns
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
from .pdf_factory import encrypted_pdf, text_pdf

# Without weights -----------------------------------------------------------------------------------


def test_messages_to_turns() -> None:
    turns = messages_to_turns(
        [
            ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
            ChatMessage(role=MessageRole.USER, content="Hi"),
            ChatMessage(role=MessageRole.ASSISTANT, content="Hello"),
            ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="Q"), TextBlock(text="?")]),
        ]
    )
    assert turns == [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello"), ("user", "Q?")]
    with pytest.raises(ValueError, match="text only"):
        messages_to_turns([ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(image=b"\x89PNG")])])
    with pytest.raises(ValueError, match="no tool calling"):
        messages_to_turns([ChatMessage(role=MessageRole.TOOL, content="3")])


def test_supporting_pages_prefer_the_page_holding_the_answer() -> None:
    document = document_from_pages(list(enumerate(FACT_PAGES, start=1)))
    # Indices into the pages (the second and third page here).
    assert supporting_pages(document, "Maria Lindqvist", "Who is the account manager?")[0][0] == 1
    assert supporting_pages(document, "It is governed by Swedish law (the laws of Sweden).")[0][0] == 2
    assert supporting_pages(document, "zzz qqq") == []
    single = document_from_text("Only one page here.")
    assert supporting_pages(single, "nothing related") == [(0, 0.0)]
    assert supporting_pages(single, "nothing related", limit=0) == [], "max_sources=0: no page at all"


def test_citations_match_whole_words() -> None:
    # "ten" is in "tenant" and "often", "50%" in "150%", as letters but not as words: those pages are not cited.
    lease = document_from_pages(
        [
            (1, "The landlord and the tenant agree as follows."),
            (2, "Either party may end this lease by giving ten days notice in writing."),
            (3, "The tenant keeps the premises in repair; rent is often reviewed."),
        ]
    )
    assert [index for index, _ in supporting_pages(lease, "ten", "How many days of notice end the lease?")] == [1]
    shares = document_from_pages(
        [
            (1, "Control means ownership of fifty percent (50%) or more of the outstanding shares."),
            (2, "Late payments accrue interest at 150% of the base rate, compounded on outstanding amounts."),
        ]
    )
    assert [index for index, _ in supporting_pages(shares, "50%", "What share of the shares is control?")] == [0]


@pytest.mark.parametrize(
    ("first", "second", "answer"),
    [
        ("Die Verzugszinsen betragen 0,5 % pro Monat.", "Die Vertragsstrafe beträgt 5 % des Auftragswerts.", "5 %"),
        ("Le dépôt est de 1\u202f500 € à la signature.", "Les frais sont de 500 € à la signature.", "500 €"),
        ("The deposit is EUR 1\u00a0500, paid on signing.", "The fee is EUR 500, paid on signing.", "EUR 500"),
        ("رسوم ١٬٥٠٠ دينار عند التوقيع.", "رسوم ٥٠٠ دينار عند التوقيع.", "٥٠٠ دينار"),
        ("Zinsen: 1,25 % jährlich.", "Zinsen: 25 % bei Verzug.", "25 %"),
    ],
)
def test_a_figure_is_not_cited_from_inside_a_number_written_as_another_language_writes_it(
    first: str, second: str, answer: str
) -> None:
    """A decimal comma and digits grouped by spaces split a number in two words: "5 %" was found in "0,5 %", "500"
    in "1 500", and the page of the larger figure was cited."""
    document = document_from_pages([(1, first), (2, second)])
    assert [index for index, _ in supporting_pages(document, answer, "")] == [1]
    # The same figure written either way is found: an answer given as "7,400" on a page that writes "7 400".
    amounts = document_from_pages([(1, "Intro."), (2, "Die Miete beträgt 7\u00a0400 EUR."), (3, "0,5 und 1,5.")])
    assert [index for index, _ in supporting_pages(amounts, "7,400 EUR", "")] == [1]
    assert [index for index, _ in supporting_pages(amounts, "1.5", "")] == [2]


def test_figures_side_by_side_in_a_table_or_a_list_stay_apart_for_citations() -> None:
    """A table's row read from a PDF ("250 310 420"), a TSV or CSV line, a list: merged into one number as if
    grouped by thousands or read as decimals, their figures were cited from no page, or from the wrong one."""
    tables = document_from_pages(
        [(1, "Units per site: 250 310 420.\n2024\t120\t310\t95\nnorth,12,45,7"), (2, "Units in 2023: 12, 45.")]
    )
    for answer in ("310", "250 310 420", "120", "north 12, 45, 7", "12, 45, 7"):
        assert [index for index, _ in supporting_pages(tables, answer, "")] == [0], answer


@pytest.mark.parametrize(
    ("pages", "answer", "question"),
    [
        (  # Cyrillic: the figure alone ("30") is on the first page too, the answer's words only on the second
            ["Статья 30. Оплата производится ежемесячно.", "Срок уведомления составляет 30 дней.", "Подписи сторон."],
            "30 дней",
            "Какой срок уведомления?",
        ),
        (  # case-folded: "ß" is "ss" in capitals
            ["Die Miete steigt um 5 Prozent.", "Anschrift: HAUPTSTRASSE 5, Berlin.", "Die Zahlung erfolgt monatlich."],
            "Hauptstraße 5",
            "Wie lautet die Anschrift?",
        ),
        (["本合同由甲方和乙方签订。", "通知期为三十天。", "付款按月进行。"], "三十天", "通知期是多长？"),
        # No verbatim answer: the pairs of characters it shares with the page (通知, 知期) find it.
        (["本合同由甲方和乙方签订。", "通知期为三十天。", "付款按月进行。"], "通知期是一个月", ""),
        (["この契約は甲と乙の間で結ばれる。", "通知期間は三十日です。", "支払いは毎月。"], "三十日", "通知期間は？"),
        # Korean: its particles and endings join the word ("30일입니다"), so the answer's "30일" is no word of the text.
        (["계약 기간은 30개월이다.", "통지 기간은 30일입니다.", "지급은 매월 한다."], "30일", "통지 기간은?"),
    ],
)
def test_citations_find_the_page_in_any_script(pages: list[str], answer: str, question: str) -> None:
    document = document_from_pages(list(enumerate(pages, start=1)))
    assert [index for index, _ in supporting_pages(document, answer, question)] == [1]


def test_an_answer_across_a_page_break_cites_both_pages() -> None:
    document = document_from_pages(
        [
            (1, "Intro words.\nThe notice period for termination of this agreement is"),
            (2, "ninety days from the date of the written notice.\nPayment terms follow."),
            (3, "Termination for cause: notice period not applicable; ninety percent refunded."),
        ]
    )
    answer = "The notice period for termination of this agreement is ninety days."
    cited = supporting_pages(document, answer, "What is the notice period?")
    assert sorted(index for index, _ in cited) == [0, 1] and all(score > 1 for _, score in cited)


def test_an_answer_as_a_model_words_it_cites_the_page_that_holds_it() -> None:
    """Measured on the real-document corpus (no model): with the accepted answer inside a sentence, 3 in 10 cited
    pages did not hold it. Only the whole answer counted as verbatim, words it repeats from the question weighed as
    its own, a two-letter answer ("-tt") had no word to match, and an answer no page holds cited pages in full."""
    records = document_from_pages(
        [
            (1, "Study records must be retained as Section 10 requires."),
            (2, "Record Retention: 15 years after completion of the Study."),
            (3, "A party seeking indemnity shall notify the other within 15 business days."),
        ]
    )
    question = "For how many years must Study records be retained?"
    for answer in ("15 years", "It is 15 years.", "Study records must be retained for 15 years."):
        assert [index for index, _ in supporting_pages(records, answer, question)] == [1], answer
    fsck = document_from_pages(
        [
            (1, "OPTIONS. The command-line option -v makes e2fsck verbose; it is always given by the boot scripts."),
            (2, "report_time: if true, e2fsck will run as if the options -tt are always specified."),
        ]
    )
    question = "Which command-line option does report_time make e2fsck behave as if it were always given?"
    for answer in ("-tt", "The -tt option."):
        assert [index for index, _ in supporting_pages(fsck, answer, question)] == [1], answer
    nda = document_from_pages(
        [
            (1, "Cover Page. Marrowgate Foods Cooperative and Quillfeather Robotics, Inc. enter into this NDA."),
            (2, "Signatures. For Marrowgate: Darius Vellacott, Director. For Quillfeather: Ana Ruiz."),
        ]
    )
    restated = "Darius Vellacott signed the NDA on behalf of Marrowgate Foods Cooperative."
    cited = supporting_pages(nda, restated, "Who signed the NDA on behalf of Marrowgate Foods Cooperative?")
    assert [index for index, _ in cited] == [1]
    lease = document_from_pages([(1, "Rent is due monthly."), (2, "The notice period is ninety days.")])
    for unanswered in ("", "I don't know.", "45", "The document does not say."):
        assert supporting_pages(lease, unanswered, "What is the notice period?") == [], unanswered
    # An answer of one-letter words has no terms of its own, and is still found where a page holds it.
    schedules = document_from_pages([(1, "Schedule C applies to resellers."), (2, "Schedule B applies to you.")])
    assert [index for index, _ in supporting_pages(schedules, "B", "Which schedule applies to me?")] == [1]


def test_an_answer_across_a_page_break_is_read_past_running_headers_and_footers() -> None:
    """A real PDF's pages end with a footer ("Mutual NDA ... / Page 3"): the two halves of an answer across the break
    were never beside each other, and a page holding neither half could outrank them."""
    footer = "Mutual Non-Disclosure Agreement: Quillfeather and Marrowgate\nPage {}"
    bodies = [
        "Term. This agreement lasts three years.",
        "Assignment. Neither party may assign this agreement, except that either party may assign it in",
        "connection with a merger or acquisition of all of its assets.\nNotices are in writing.",
        "Governing law. The law of Ontario governs this agreement and any merger dispute.",
    ]
    pages = [(number, f"{body}\n{footer.format(number)}") for number, body in enumerate(bodies, start=1)]
    answer = "either party may assign it in connection with a merger or acquisition"
    cited = supporting_pages(document_from_pages(pages), answer, "May a party assign the agreement?")
    assert sorted(index for index, _ in cited) == [1, 2] and all(score > 1 for _, score in cited), cited


def test_data_in_lines_alike_headers_a_second_fact_and_a_yes_are_still_cited() -> None:
    """A review of the rewrite: lines alike but for their figures (invoices, a table's rows) were set aside as running
    headers, so their figures were cited from no page; a header holding what is asked was set aside too; a run
    settling one fact's page dropped the page of a second fact; "Yes." cited nothing; a two-page document's footer
    was never seen as running, so an answer across its break cited one page."""
    invoices = document_from_pages(
        [
            (n, f"Invoice no. {10230 + n}\nDate: 2024-03-{10 + n}\nItems as agreed.\nTotal: {n},950.40 EUR")
            for n in range(1, 6)
        ]
    )
    assert [index for index, _ in supporting_pages(invoices, "10232", "What is the invoice number?")] == [1]
    assert [index for index, _ in supporting_pages(invoices, "3,950.40 EUR", "What is the total?")] == [2]
    header = "Services Agreement No. SA-2291 between Northwind Traders Ltd and Contoso plc"
    headed = document_from_pages([(n, f"{header}\nClause {n} text about fees.") for n in range(1, 4)])
    assert len(supporting_pages(headed, "SA-2291", "What is the agreement number?")) == 3
    lease = document_from_pages(
        [
            (1, "Parties and premises."),
            (2, "The initial term is 36 months from the start date."),
            (3, "Rent is due monthly."),
            (4, "The security deposit is refundable at the end of the term."),
            (5, "Either party may terminate on 90 days' notice in writing."),
        ]
    )
    answer = "The initial term is 36 months and either party may terminate on 90 days' notice."
    assert sorted(index for index, _ in supporting_pages(lease, answer, "What are the term and the notice?")) == [1, 4]
    for yes in ("Yes.", "Yes, the security deposit is refundable."):
        assert [index for index, _ in supporting_pages(lease, yes, "Is the security deposit refundable?")] == [3]
    footer = "Mutual NDA between Quillfeather and Marrowgate\nPage {}"
    two = document_from_pages(
        [
            (1, "Either party may assign this agreement in connection with\n" + footer.format(1)),
            (2, "a merger or acquisition of all of its assets.\n" + footer.format(2)),
        ]
    )
    cited = supporting_pages(two, "either party may assign this agreement in connection with a merger")
    assert sorted(index for index, _ in cited) == [0, 1] and all(score > 1 for _, score in cited), cited


def test_an_answer_across_two_page_breaks_cites_all_three_pages() -> None:
    """Only pairs of neighbouring pages were joined: an answer that a short page holds the middle of cited the
    last page alone. An empty page between two is passed over as a page break is."""
    document = document_from_pages(
        [
            (1, "Schedule of fees. The total fee payable under this order form is"),
            (2, "USD 312,000"),
            (3, "per year, invoiced quarterly in advance.\nOther terms follow."),
            (4, "Notes."),
        ]
    )
    answer = "The total fee payable under this order form is USD 312,000 per year"
    cited = supporting_pages(document, answer, "What is the total fee?")
    assert sorted(index for index, _ in cited) == [0, 1, 2] and all(score > 1 for _, score in cited), cited
    spaced = document_from_pages([(1, "The fee is"), (2, "\u200b"), (3, "USD 9 per year.")])
    assert sorted(index for index, _ in supporting_pages(spaced, "The fee is USD 9")) == [0, 1]


def test_from_documents_cites_each_files_own_page_labels() -> None:
    manual = {"file_name": "m.pdf"}
    documents = [
        LlamaDocument(text="Preface. This manual covers pump P-301.", metadata={"page_label": "i", **manual}),
        LlamaDocument(text="Contents. Valves, filters.", metadata={"page_label": "ii", **manual}),
        # A page of invisible characters only (a zero-width space): left out of the document, and of whose it is.
        LlamaDocument(text="\u200b\n", metadata={"page_label": "iii", **manual}),
        LlamaDocument(text="Chapter 1. Valve V-2 relieves pressure.", metadata={"page_label": "1", **manual}),
        LlamaDocument(text="Annex. Torques.", metadata={"page_label": "A-1", "page": 9, **manual}),
        # Text files as SimpleDirectoryReader reads them: no page metadata, one page each.
        LlamaDocument(text="Lease A. The notice period is thirty days.", metadata={"file_name": "a.txt"}),
        LlamaDocument(text="Lease B. The deposit is two months of rent.", metadata={"file_name": "b.txt"}),
    ]
    engine = DocumentQueryEngine.from_documents(documents, model="no-such-model")
    document = engine.llm.document
    assert isinstance(document, Document)
    assert [(page.number, page.label) for page in document.pages] == [
        (1, "i"), (2, "ii"), (1, None), (9, "A-1"), (1, None), (1, None)
    ]  # fmt: skip
    assert Document.from_layout(document.text, document.layout()) == document  # labels persist

    def cited(answer: str, question: str) -> dict[str, Any]:
        return engine._source_nodes(document, answer, question)[0].node.metadata

    assert cited("This manual covers pump P-301.", "What does this manual cover?") == {
        "page_label": "i", "page": 1, "file_name": "m.pdf"
    }  # fmt: skip
    assert cited("Torques.", "What does the annex hold?") == {"page_label": "A-1", "page": 9, "file_name": "m.pdf"}
    assert cited("The deposit is two months of rent.", "What is the deposit?") == {
        "page_label": "1", "page": 1, "file_name": "b.txt"
    }  # fmt: skip


def test_from_documents_tells_apart_pages_of_one_file_labelled_alike() -> None:
    """Chapters each numbered from 1, as a PDF reader gives their pages: cited by their place in the file too, as
    `load_document` cites them; a page labelled alike in another file is told apart by its file's name."""
    documents = [
        LlamaDocument(text="Chapter 1. Scope of services.", metadata={"page_label": "1", "file_name": "c.pdf"}),
        LlamaDocument(text="\n", metadata={"page_label": "2", "file_name": "c.pdf"}),  # blank: still a place
        LlamaDocument(text="Chapter 2. Notice is 90 days.", metadata={"page_label": "1", "file_name": "c.pdf"}),
        LlamaDocument(text="Schedule. Fees.", metadata={"page_label": "1", "file_name": "d.pdf"}),
    ]
    document = DocumentQueryEngine.from_documents(documents, model="no-such-model").llm.document
    assert [page.cited_as for page in document.pages] == ["1 (file page 1)", "1 (file page 3)", "1"]


def test_from_file_opens_an_encrypted_pdf_with_its_password(random_model_dir: Path, tmp_path: Path) -> None:
    path = encrypted_pdf(tmp_path / "locked.pdf", FACT_PAGES, "s3cret")
    with pytest.raises(EncryptedPDFError, match="password="):
        _ = DocumentQueryEngine.from_file(path, model=str(random_model_dir)).document
    engine = DocumentQueryEngine.from_file(path, model=str(random_model_dir), password="s3cret", max_tokens=2)
    assert "Lindqvist" in engine.document.document.text
    assert "s3cret" not in repr(engine.llm) and "s3cret" not in engine.llm.to_json()
    with pytest.raises(TypeError, match="pasword"):
        DocumentQueryEngine.from_file(path, model=str(random_model_dir), pasword="s3cret")
    with pytest.raises(TypeError, match="max_new_tokens"):
        DocumentQueryEngine.from_documents([LlamaDocument(text="x")], max_new_tokens=2)


def test_llm_loads_nothing_until_used() -> None:
    llm = InfoKV(model="no-such-model", document_text="some text")
    payload = llm.to_payload()  # what instrumentation sees before first use: no loading
    assert payload["model_name"] == "no-such-model"


@pytest.mark.parametrize("system_prompt", [None, "You are a careful assistant."])
def test_a_prompt_as_long_as_the_metadata_allows_fits(random_model_dir: Path, system_prompt: str | None) -> None:
    """LlamaIndex packs a prompt up to `context_window - num_output` tokens, less its system prompt's own tokens
    (PromptHelper): that must fit beside the document."""
    llm = InfoKV(model=str(random_model_dir), document_text=" ".join(CORPUS), max_tokens=2, system_prompt=system_prompt)
    metadata = llm.metadata
    tokenizer = llm.compressed_document().engine.tokenizer

    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    budget = metadata.context_window - metadata.num_output - (tokens(system_prompt) if system_prompt else 0)
    prompt = " ".join(["notice"] * budget)
    while tokens(prompt) > budget:
        prompt = prompt.rsplit(" ", 1)[0]
    assert tokens(prompt) == budget
    assert llm.complete(prompt).additional_kwargs["completion_tokens"] == 2


def test_fields_changed_after_use_choose_the_document_again(random_model_dir: Path) -> None:
    llm = InfoKV(model=str(random_model_dir), document_text="The notice period is ninety days.", max_tokens=2)
    first = llm.compressed_document()
    llm.document_text = "The penalty is 500 euros."
    assert llm.compressed_document().document.text == "The penalty is 500 euros." != first.document.text
    assert llm.to_payload()["context_window"] == llm.metadata.context_window


def test_an_llm_that_answered_can_be_copied_and_pickled(random_model_dir: Path) -> None:
    """As the LangChain adapters: LlamaIndex dropped the held document from a pickle with a warning, and a deep
    copy failed on its engine's locks."""
    llm = InfoKV(model=str(random_model_dir), document_text="The notice period is ninety days.", max_tokens=2)
    first = llm.complete("What is the notice period?").text
    for copied in (copy.deepcopy(llm), llm.model_copy(deep=True), pickle.loads(pickle.dumps(llm))):
        assert copied.complete("What is the notice period?").text == first
    # Given a document held in memory: a deep copy shares it; a pickle is refused (LlamaIndex's own dropped it,
    # with a log line only, and the copy had no document).
    given = InfoKV(document=llm.compressed_document(), max_tokens=2)
    for copied in (copy.deepcopy(given), given.model_copy(deep=True)):
        assert copied.document is given.document and copied.complete("What is the notice period?").text == first
    with pytest.raises(TypeError, match="not pickled: save it"):
        pickle.dumps(given)


def test_options_every_call_would_refuse_are_refused_when_the_llm_is_made(no_document_read: None) -> None:
    made = InfoKV(model=Path("tiny"), document_text="The notice period is ninety days.", stop="\n")  # type: ignore[arg-type]
    assert made.stop == ["\n"] and made.model == "tiny"  # one string is one sequence; a path is a path's text
    for field, value in (("temperature", math.inf), ("recall", -1), ("recall", 1.5), ("seed", 2**70)):
        refused: dict[str, Any] = {field: value}
        with pytest.raises(ValidationError, match=field):
            InfoKV(model="tiny", document_text="The notice period is ninety days.", **refused)


def test_a_misspelt_option_is_refused(random_model_dir: Path) -> None:
    llm = InfoKV(model=str(random_model_dir), document_text="The notice period is ninety days.", max_tokens=2)
    for option in ("max_new_tokens", "max_token", "stop_sequences"):
        with pytest.raises(ValueError, match=f"unknown option.*{option}"):
            llm.complete("Q?", **{option: 2})


def test_a_keyword_that_is_no_field_is_refused_when_the_llm_is_made(no_document_read: None) -> None:
    """pydantic drops a keyword that is no field: the core's `max_new_tokens` or a misspelling would leave the LLM
    answering with its defaults (256 greedy tokens), where a call's kwargs and the query engine's factories refuse
    the same names."""
    misspelt: dict[str, Any] = {"max_new_tokens": 5, "temprature": 0.7}
    takes = r"which takes callback_manager, completion_to_prompt, compression, .*max_tokens, .*temperature, top_p$"
    with pytest.raises(TypeError, match=rf"max_new_tokens, temprature: not a field of InfoKV, {takes}"):
        InfoKV(model="tiny", document_text="The notice period is ninety days.", **misspelt)
    llm = InfoKV(model="tiny", document_text="The notice period is ninety days.", max_tokens=5, system_prompt="Hi.")
    assert (llm.max_tokens, llm.system_prompt) == (5, "Hi.")  # LlamaIndex's fields are fields too
    assert InfoKV.from_dict(llm.to_dict()).max_tokens == 5  # its dict's class_name is no field: from_dict drops it
    # Its dumps name the class too: one of this class makes it again; another class's name is no field of it.
    assert InfoKV(**llm.model_dump()).max_tokens == InfoKV.model_validate_json(llm.model_dump_json()).max_tokens == 5
    with pytest.raises(TypeError, match="class_name: not a field of InfoKV"):
        InfoKV(**{**llm.model_dump(), "class_name": "OpenAI"})


def test_the_compression_survives_serialisation_with_its_method_settings(no_document_read: None) -> None:
    """pydantic wrote a config's method settings as their base class, which has no fields (`{}`), and
    `CompressionConfig.to_dict` leaves out values (`summaries` 0, `layer_budgets` "uniform") that the constructor
    fills with today's defaults: `from_json(to_json())` compressed its document otherwise, and every instrumentation
    event's `model_dict` showed no settings."""
    configs = [
        CompressionConfig(method="snapkv", keep=0.5, settings={"pooling_kernel": 7}),
        CompressionConfig(keep=64, recall=0.1, summaries=0, settings={"tau": 0.5, "layer_budgets": "uniform"}),
    ]
    for config in configs:
        llm = InfoKV(model="tiny", document_text="The notice period is ninety days.", compression=config)
        assert llm.to_dict()["compression"]["settings"] == dataclasses.asdict(config)["settings"]
        assert InfoKV.from_json(llm.to_json()).compression == config
        assert InfoKV.from_dict(llm.to_dict()).compression == config
    assert json.loads(InfoKV(model="tiny").to_json())["compression"] is None


def test_a_documents_text_given_as_its_path_is_refused_saying_where_it_goes(no_document_read: None) -> None:
    """Text passed as `document=`: one longer than a file name may be (or holding a NUL) made the filesystem raise a
    bare OSError (ValueError); text with a line break was "not found"."""
    as_text = r"is no file: it looks like the document's text, which goes in document_text="
    for text in ("The notice period is ninety days. " * 10, "Notice period:\nninety days.", "ninety\x00days"):
        with pytest.raises(FileNotFoundError, match=as_text):
            InfoKV(model="tiny", document=text).complete("What is the notice period?")
        with pytest.raises(FileNotFoundError, match=as_text):
            DocumentQueryEngine.from_file(text, model="tiny").query("What is the notice period?")


def test_bad_options_and_questions_are_refused_before_the_document_is_read(no_document_read: None) -> None:
    """A call's options and messages are checked before its document is read (seconds to minutes); an empty
    question (whitespace or control characters only) is refused on every path, a system prompt beside it or not."""
    llm = InfoKV(model="tiny", document_text="A text no other test reads.", system_prompt="Be brief.")
    user = MessageRole.USER
    refusals: list[tuple[type[Exception], str, Any]] = [
        (ConfigError, "max_tokens must be >= 1", lambda: llm.complete("hi", max_tokens=0)),
        (ConfigError, "unknown option.*max_new_tokens", lambda: llm.complete("hi", max_new_tokens=4)),
        (ConfigError, "lone surrogate", lambda: llm.stream_complete("hi \ud800")),
        (EmptyQuestionError, "empty", lambda: llm.complete("")),
        (EmptyQuestionError, "empty", lambda: llm.chat([ChatMessage(role=user, content=" \x00\n")])),
        (EmptyQuestionError, "empty", lambda: asyncio.run(llm.acomplete("\t"))),
        (EmptyQuestionError, "empty", lambda: DocumentQueryEngine(llm=llm).query("   ")),
    ]
    for kind, message, call in refusals:
        with pytest.raises(kind, match=message):
            call()
    # No messages at all: refused, the system prompt not asked alone as the question.
    with pytest.raises(ValueError, match="no messages: ask a question about the document"):
        llm.chat([])
    # A bool is no number here: pydantic's lax mode read seed=True as the seed 1 and recall=True as all of it.
    for field in ("max_tokens", "temperature", "top_p", "seed", "max_cache_tokens", "recall"):
        with pytest.raises(ValueError, match=field):
            bad: dict[str, Any] = {field: True}
            InfoKV(model="tiny", document_text="A text no other test reads.", **bad)


def test_a_directory_that_is_no_saved_cache_is_named_as_the_core_names_it(
    tmp_path: Path, no_document_read: None
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    with pytest.raises(IsADirectoryError, match="reports is a directory; give the path of a PDF or text file"):
        DocumentQueryEngine.from_file(reports, model="tiny").query("What is the notice period?")


def test_a_wrong_or_missing_password_is_refused_after_the_file_was_read(random_model_dir: Path, tmp_path: Path) -> None:
    path = encrypted_pdf(tmp_path / "locked.pdf", FACT_PAGES, "s3cret")
    model = str(random_model_dir)
    assert InfoKV(model=model, document=str(path), password="s3cret", max_tokens=2).complete("Who?").text
    for password, message in ((None, "needs a password"), ("wrong", "Wrong password")):
        with pytest.raises(EncryptedPDFError, match=message):
            InfoKV(model=model, document=str(path), password=password, max_tokens=2).complete("Who?")
        with pytest.raises(EncryptedPDFError, match=message):
            DocumentQueryEngine.from_file(path, model=model, password=password, max_tokens=2).query("Who?")


def test_the_query_engine_keeps_the_llms_system_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple[str, str]]] = []

    def start(self: InfoKV, turns: list[tuple[str, str]], kwargs: dict[str, Any]) -> Any:
        seen.append(turns)
        raise RuntimeError("no generation needed")

    monkeypatch.setattr(InfoKV, "_start", start)
    llm = InfoKV(model="no-such-model", document_text="some text", system_prompt="Answer in French.")
    with pytest.raises(RuntimeError, match="no generation needed"):
        DocumentQueryEngine(llm=llm).query("Who pays?")
    assert seen == [[("system", "Answer in French."), *question_turns("Who pays?")]]


def test_every_path_sends_the_system_prompt_once(random_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM.predict` and `stream` (and their async forms) prepend `system_prompt` before calling `chat`, which a
    direct `chat` call does not: the document hears it once either way."""
    seen: list[list[tuple[str, str]]] = []
    generate = CompressedDocument.generate

    def spy(self: CompressedDocument, turns: list[tuple[str, str]], *args: Any, **kwargs: Any) -> Any:
        seen.append(list(turns))
        return generate(self, turns, *args, **kwargs)

    monkeypatch.setattr(CompressedDocument, "generate", spy)
    llm = InfoKV(model=str(random_model_dir), document_text=" ".join(CORPUS), system_prompt="Be brief.", max_tokens=1)
    prompt = PromptTemplate("What is {x}?")
    messages = [ChatMessage(role=MessageRole.USER, content="Who pays?")]

    async def consume(stream: Any) -> None:
        async for _ in await stream:
            pass

    paths: dict[str, Any] = {
        "complete": lambda: llm.complete("Who pays?"),
        "stream_complete": lambda: list(llm.stream_complete("Who pays?")),
        "chat": lambda: llm.chat(messages),
        "stream_chat": lambda: list(llm.stream_chat(messages)),
        "predict": lambda: llm.predict(prompt, x="the notice period"),
        "stream": lambda: list(llm.stream(prompt, x="the notice period")),
        "acomplete": lambda: asyncio.run(llm.acomplete("Who pays?")),
        "astream_complete": lambda: asyncio.run(consume(llm.astream_complete("Who pays?"))),
        "achat": lambda: asyncio.run(llm.achat(messages)),
        "astream_chat": lambda: asyncio.run(consume(llm.astream_chat(messages))),
        "apredict": lambda: asyncio.run(llm.apredict(prompt, x="the notice period")),
        "astream": lambda: asyncio.run(consume(llm.astream(prompt, x="the notice period"))),
    }
    for name, call in paths.items():
        call()
        system_turns = [content for role, content in seen[-1] if role == "system"]
        assert system_turns == ["Be brief."], name


def test_an_llm_keeps_its_document_when_the_shared_cache_evicts_it(
    random_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ingested = record_texts_read_with_one_shared_document(monkeypatch)
    first, second = (
        InfoKV(model=str(random_model_dir), document_text=f"Contract {number}: the notice period is {number} days.")
        for number in (1, 2)
    )
    for llm in (first, second, first, second):
        llm.complete("What is the notice period?", max_tokens=1)
    assert len(ingested) == 2, "each instance reads its document once, though the shared cache holds one"
    first.document_text = "Contract 3: the notice period is 3 days."
    assert first.compressed_document().document.text == first.document_text and len(ingested) == 3


# On the tiny model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fact_pdf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return text_pdf(tmp_path_factory.mktemp("li") / "agreement.pdf", FACT_PAGES)


@pytest.fixture(scope="module")
def llm(fact_pdf: Path) -> InfoKV:
    return InfoKV(model="tiny", document=str(fact_pdf), compression=COMPRESSION, max_tokens=12)


@pytest.mark.tiny
def test_metadata_counts_the_cached_document(llm: InfoKV) -> None:
    document = llm.compressed_document()
    metadata = llm.metadata
    template = len(document.engine.prompt.conversation_ids([("user", "")]))  # around every prompt
    assert metadata.context_window == get_engine("tiny").context_window - document.stats.document_tokens - template
    assert metadata.is_chat_model and not metadata.is_function_calling_model
    assert metadata.num_output == 12 and metadata.model_name == "tiny"
    assert [page.number for page in document.document.pages] == [1, 2, 3]


@pytest.mark.tiny
def test_metadata_without_a_bound_document_is_the_model_window(fact_pdf: Path) -> None:
    unbound = InfoKV(model="tiny", compression=COMPRESSION, max_tokens=12)  # each call passes its document
    engine = get_engine("tiny")
    template = len(engine.prompt.conversation_ids([("user", "")]))
    metadata = unbound.metadata
    assert metadata.context_window == engine.context_window - template and metadata.model_name == "tiny"
    answer = unbound.complete("Who is the account manager?", document=str(fact_pdf)).text
    assert answer and unbound.metadata.context_window == metadata.context_window


def _check_stream(responses: list[Any], final_text: str) -> None:
    text = ""
    for response in responses:
        assert response.delta is not None
        text += response.delta
        current = response.text if hasattr(response, "text") else response.message.content
        assert current == text  # cumulative text, the delta is what is new
    assert text == final_text
    assert responses[-1].additional_kwargs["cached_tokens"] > 0


@pytest.mark.tiny
def test_complete_chat_streaming_and_async(llm: InfoKV) -> None:
    prompt = QUESTION.format(question="Who is the account manager?")
    completion = llm.complete(prompt)
    assert "Lindqvist" in completion.text
    usage = completion.additional_kwargs
    assert usage["cached_tokens"] == llm.compressed_document().stats.document_tokens
    assert usage["completion_tokens"] <= 12 and usage["model_name"] == "tiny"
    _check_stream(list(llm.stream_complete(prompt)), completion.text)

    messages = [
        ChatMessage(role=MessageRole.SYSTEM, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content=prompt),
    ]
    chat = llm.chat(messages)
    assert chat.message.role == MessageRole.ASSISTANT and "Lindqvist" in chat.message.content
    _check_stream(list(llm.stream_chat(messages)), chat.message.content)

    async def run_async() -> None:
        assert (await llm.acomplete(prompt)).text == completion.text
        _check_stream([r async for r in await llm.astream_complete(prompt)], completion.text)
        assert (await llm.achat(messages)).message.content == chat.message.content
        _check_stream([r async for r in await llm.astream_chat(messages)], chat.message.content)

    asyncio.run(run_async())


@pytest.mark.tiny
def test_query_engine_from_pdf_cites_the_page(fact_pdf: Path) -> None:
    engine = DocumentQueryEngine.from_file(fact_pdf, model="tiny", compression=COMPRESSION, max_tokens=12)
    response = engine.query("Who is the account manager?")
    assert isinstance(response, Response) and response.response is not None and response.metadata is not None
    assert "Lindqvist" in response.response
    pages = [node.node.metadata["page"] for node in response.source_nodes]
    assert pages and pages[0] == 2
    first = response.source_nodes[0].node
    assert first.metadata["page_label"] == "2" and first.metadata["file_name"] == "agreement.pdf"
    assert "Lindqvist" in first.get_content()
    assert response.metadata["cached_tokens"] == engine.document.stats.document_tokens

    again = asyncio.run(engine.aquery("Who is the account manager?"))
    assert isinstance(again, Response)
    assert again.response == response.response
    assert [n.node.metadata["page"] for n in again.source_nodes] == pages


@pytest.mark.tiny
def test_query_engine_from_llamaindex_documents(tmp_path: Path) -> None:
    # Pages as a PDF reader yields them (page_label metadata), and files as SimpleDirectoryReader reads them.
    documents = [
        LlamaDocument(text=text, metadata={"page_label": str(i), "file_name": "a.pdf"})
        for i, text in enumerate(FACT_PAGES, 1)
    ]
    engine = DocumentQueryEngine.from_documents(documents, model="tiny", compression=COMPRESSION, max_tokens=12)
    assert [p.number for p in engine.document.document.pages] == [1, 2, 3]
    response = engine.query("Who is the account manager?")
    assert isinstance(response, Response) and response.response is not None
    assert "Lindqvist" in response.response and response.source_nodes[0].node.metadata["page"] == 2

    (tmp_path / "memo.txt").write_text(FACT_PAGES[1])
    loaded = SimpleDirectoryReader(input_files=[str(tmp_path / "memo.txt")]).load_data()
    engine = DocumentQueryEngine.from_documents(loaded, model="tiny", compression=COMPRESSION, max_tokens=12)
    response = engine.query("What is the notice period?")
    assert isinstance(response, Response) and response.response is not None
    assert "90" in response.response or "ninety" in response.response.lower()
    assert response.source_nodes[0].node.metadata == {"page_label": "1", "page": 1, "file_name": "memo.txt"}

    # Pages of several files share numbers: each is cited by its own file and page, never another's.
    documents = [
        LlamaDocument(text=FACT_PAGES[0], metadata={"page_label": "1", "file_name": "a.pdf"}),
        LlamaDocument(text=FACT_PAGES[1], metadata={"page_label": "1", "file_name": "b.pdf"}),
        LlamaDocument(text=FACT_PAGES[2], metadata={"page_label": "2", "file_name": "b.pdf"}),
    ]
    engine = DocumentQueryEngine.from_documents(documents, model="tiny", compression=COMPRESSION, max_tokens=12)
    response = engine.query("Who is the account manager?")
    assert isinstance(response, Response) and "Lindqvist" in str(response.response)
    cited = response.source_nodes[0].node
    assert cited.metadata == {"page_label": "1", "page": 1, "file_name": "b.pdf"} and "Lindqvist" in cited.get_content()
    assert len({node.node.node_id for node in response.source_nodes}) == len(response.source_nodes)


@pytest.mark.tiny
def test_query_engine_on_a_compressed_cache_returns_the_engines_answer() -> None:
    documents = [LlamaDocument(text=text, metadata={"page_label": str(i)}) for i, text in enumerate(FACT_PAGES, 1)]
    engine = DocumentQueryEngine.from_documents(documents, model="tiny", compression=COMPRESSED, max_tokens=12)
    response = engine.query("Who is the account manager?")
    assert isinstance(response, Response) and response.metadata is not None
    document = engine.document
    assert document.stats.method == "infokv" and document.stats.compression_ratio < 1
    expected = document.generate(question_turns("Who is the account manager?"), GenerationOptions(max_new_tokens=12))
    assert response.response == expected.text().strip()
    assert response.metadata["cached_tokens"] == document.stats.document_tokens
    assert response.metadata["compression"] == document.stats.to_dict()
    for node in response.source_nodes:
        assert node.node.get_content() == FACT_PAGES[node.node.metadata["page"] - 1]


@pytest.mark.tiny
def test_example_llamaindex_query_engine_runs(fact_pdf: Path) -> None:
    lines = run_example("llamaindex_query_engine.py", fact_pdf, "Who is the account manager?")
    assert lines[0].startswith("document: ") and "3 pages" in lines[0]
    assert lines[1] == "Q: Who is the account manager?"
    assert lines[2].startswith("A: ") and "Lindqvist" in lines[2]
    assert lines[3].startswith("pages: 2")


# The cold tier, on the random model -------------------------------------------------------------------

COLD_TEXT = " ".join(CORPUS * 6)
# Passed as a dict, which the adapters take: pydantic types their __init__ by a field's validated type
# (CompressionConfig), not by what its before-validator accepts, hence `type: ignore[arg-type]` where one is passed.
COLD = {"keep": 0.25, "recall": 0.1, "cold_bits": 8}


def test_recall_from_compression_and_per_call(random_model_dir: Path, tmp_path: Path) -> None:
    llm = InfoKV(model=str(random_model_dir), document_text=COLD_TEXT, compression=COLD, max_tokens=2)  # type: ignore[arg-type]
    document = llm.compressed_document()
    assert document.cold_tier is not None and document.cold_tier.bits == 8
    layers = len(document.cold_tier.layers)
    by_default = llm.complete("What is the notice period?")
    assert by_default.additional_kwargs["recalled_tokens"] > 0  # the compression's recall
    assert by_default.additional_kwargs["compression"]["cold_bytes"] == document.stats.cold_bytes > 0
    per_call = llm.complete("What is the notice period?", recall=16)
    assert per_call.additional_kwargs["recalled_tokens"] == 16 * layers
    expected = document.generate(
        [("user", "What is the notice period?")], GenerationOptions(max_new_tokens=2, recall=16)
    )
    assert per_call.text == expected.text()
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content="Q?")], recall=0)
    assert chat.additional_kwargs["recalled_tokens"] == 0

    path = tmp_path / "contract.txt"
    path.write_text(COLD_TEXT)
    engine = DocumentQueryEngine.from_file(path, model=str(random_model_dir), compression=COLD, max_tokens=2, recall=4)
    response = engine.query("What is the notice period?")
    assert isinstance(response, Response) and response.metadata is not None
    assert response.metadata["recalled_tokens"] == 4 * layers


def test_the_token_counts_hold_the_document_in_the_prompt(random_model_dir: Path) -> None:
    """As OpenAI's usage, the service's `/v1/chat/completions` and `ChatInfoKV` count them: the prompt tokens left the
    document out, though the total held it. `TokenCountingHandler` counts the model's own (`raw["usage"]`), not the
    messages again with its tokenizer, without the document."""
    counter = TokenCountingHandler(tokenizer=str.split)
    llm = InfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_tokens=3)
    llm.callback_manager = CallbackManager([counter])
    question = "What is the notice period?"
    document = llm.compressed_document()
    answered = document.generate([("user", question)], GenerationOptions.build(max_new_tokens=3))
    answered.text()
    expected = {
        "prompt_tokens": answered.usage.prompt_tokens + document.stats.document_tokens,
        "cached_tokens": document.stats.document_tokens,
        "completion_tokens": 3,
        "total_tokens": answered.usage.prompt_tokens + document.stats.document_tokens + 3,
    }
    messages = [ChatMessage(role=MessageRole.USER, content=question)]
    responses: dict[str, Any] = {
        "complete": lambda: llm.complete(question),
        "stream_complete": lambda: list(llm.stream_complete(question))[-1],
        "chat": lambda: llm.chat(messages),
        "stream_chat": lambda: list(llm.stream_chat(messages))[-1],
    }
    for path, respond in responses.items():
        counter.reset_counts()
        response = respond()
        assert {name: response.additional_kwargs[name] for name in expected} == expected, path
        assert response.raw == {"usage": expected}, path
        assert (counter.prompt_llm_token_count, counter.completion_llm_token_count) == (expected["prompt_tokens"], 3)


def test_a_compressed_document_refuses_another_compression(random_model_dir: Path) -> None:
    """As a saved cache directory: a `CompressedDocument` cannot be compressed again, so a compression given for it
    (field or per call) must be its own, where only `recall`, each answer's default, may differ."""
    document = get_engine(str(random_model_dir)).ingest_text(COLD_TEXT, CompressionConfig(keep=0.25, recall=0.1))
    assert document.cold_tier is not None
    layers = len(document.cold_tier.layers)
    refused = r"CompressedDocument given is a cache compressed with method=infokv, .*but the compression given has"
    with pytest.raises(ConfigError, match=refused + r" method=full"):
        InfoKV(document=document, max_tokens=2).complete("What is the notice period?", compression={"method": "full"})
    with pytest.raises(ConfigError, match=refused + r" method=infokv, .*keep=0.9"):
        InfoKV(document=document, compression={"keep": 0.9, "recall": 0.1}, max_tokens=2).complete("Q?")  # type: ignore[arg-type]
    fewer = InfoKV(document=document, compression={"keep": 0.25, "recall": 4}, max_tokens=2)  # type: ignore[arg-type]
    assert fewer.complete("What is the notice period?").additional_kwargs["recalled_tokens"] == 4 * layers


def test_document_errors_say_what_an_infokv_takes(no_document_read: None) -> None:
    with pytest.raises(ValueError, match=r"no document bound: .*llm.complete\(prompt, document=...\)") as refused:
        InfoKV(model="tiny").complete("What is the notice period?")
    assert ".bind" not in str(refused.value), "a LlamaIndex LLM has no .bind"
    pages = [LlamaDocument(text="The notice period is ninety days.")]
    for document in (pages[0], pages):
        with pytest.raises(TypeError, match=r"not LlamaIndex Documents: .*DocumentQueryEngine.from_documents"):
            InfoKV(model="tiny", document=document)
    with pytest.raises(TypeError, match="DocumentQueryEngine.from_documents"):
        InfoKV(model="tiny").complete("What is the notice period?", document=pages[0])
    # Anything else no adapter takes is refused naming what is taken, as the LangChain adapters refuse it.
    for other, named in ((3, "int"), (b"contract.txt", "bytes"), (["contract.txt"], "list")):
        with pytest.raises(TypeError, match=rf"InfoKV's document is a .pdf/.txt/.md path .*; got {named}$"):
            InfoKV(model="tiny", document=other)
        with pytest.raises(TypeError, match=rf"; got {named}$"):
            InfoKV(model="tiny", document_text="The notice period is ninety days.").complete("Q?", document=other)
        # A call's text of another type is refused as the field's is (pydantic), not by an AttributeError later.
        with pytest.raises(TypeError, match=rf"InfoKV's document_text is the document's text, a str; got {named}"):
            InfoKV(model="tiny", document_text="The notice period is ninety days.").complete("Q?", document_text=other)


def test_an_option_given_as_none_keeps_the_llms_own(random_model_dir: Path) -> None:
    """None leaves a call's option unset (the field holds), where it has no meaning of its own."""
    fields: dict[str, Any] = {"max_tokens": 2, "temperature": 1.5, "top_p": 0.5, "seed": 7, "stop": ["ninety"]}
    capped = InfoKV(model=str(random_model_dir), document_text=COLD_TEXT, max_cache_tokens=64, recall=4, **fields)
    unset = {name: None for name in (*fields, "max_cache_tokens", "recall")}
    assert call_options(capped, unset) == GenerationOptions.build(
        max_new_tokens=2, temperature=1.5, top_p=0.5, stop=["ninety"], seed=7, max_cache_tokens=None, recall=None
    )
    llm = InfoKV(model=str(random_model_dir), document_text=COLD_TEXT, **fields)
    answer = llm.complete("What is the notice period?", max_tokens=None, temperature=None, seed=None)
    assert answer.text == llm.complete("What is the notice period?").text
    assert answer.additional_kwargs["completion_tokens"] <= 2


def test_every_spelling_of_one_placement_shares_one_engine_and_one_reading(random_model_dir: Path) -> None:
    """ "auto", None and "cpu" (on a machine without a GPU), "fp32" and "float32" are one placement: the weights load
    once and a document is read once, as the README promises per (model, device, dtype)."""
    model = str(random_model_dir)
    engines = {
        id(get_engine(model, device, dtype)) for device, dtype in [(None, None), ("auto", "fp32"), ("cpu", "float32")]
    }
    assert len(engines) == 1
    documents = {
        id(InfoKV(model=model, document_text=COLD_TEXT, **placement).compressed_document())  # type: ignore[arg-type]
        for placement in ({}, {"device": "cpu"}, {"device": "auto", "dtype": "fp32"})
    }
    assert len(documents) == 1


@pytest.mark.parametrize("method", ["apredict", "astream"])
def test_apredict_and_astream_read_the_document_off_the_event_loop(
    method: str, random_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LlamaIndex's async predictions (every query engine's `aquery`) read `metadata` on the loop first, and on
    first use that reads the document: it must happen in a thread, not stall every other task on the loop."""
    llm = InfoKV(model=str(random_model_dir), document_text=f"{method}: {COLD_TEXT}", max_tokens=2)
    on_the_loop: list[bool] = []
    read = InfoKV.compressed_document

    def spy(self: InfoKV, **kwargs: Any) -> CompressedDocument:
        on_the_loop.append(threading.current_thread() is threading.main_thread())
        return read(self, **kwargs)

    async def predict() -> str:
        result = await getattr(llm, method)(PromptTemplate("What is the notice period?"))
        return result if isinstance(result, str) else "".join([piece async for piece in result])

    monkeypatch.setattr(InfoKV, "compressed_document", spy)
    assert isinstance(asyncio.run(predict()), str)
    assert on_the_loop and not on_the_loop[0], "the first read ran on the event loop's thread"


def test_a_saved_cache_is_answered_by_the_model_that_made_it(
    random_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in the LangChain adapters: with `model` unset, a saved cache directory is answered and named with the model
    its manifest names, never the default; a model named there that does not load here is refused saying so."""
    model = str(random_model_dir)
    saved = tmp_path / "cache"
    save_document(get_engine(model).ingest_text(COLD_TEXT, COMPRESSION), saved)
    loaded = record_engine_loads(monkeypatch)
    llm = InfoKV(document=str(saved), max_tokens=2)
    assert llm.to_payload()["model_name"] == model  # before the first call, which reads the document
    assert llm.complete("What is the notice period?").additional_kwargs["model_name"] == model
    assert llm.metadata.model_name == model
    response = DocumentQueryEngine.from_file(saved, max_tokens=2).query("What is the notice period?")
    assert isinstance(response, Response) and response.metadata is not None and response.metadata["model_name"] == model
    per_call = InfoKV(max_tokens=2).complete("What is the notice period?", document=str(saved))
    assert per_call.additional_kwargs["model_name"] == model
    assert set(loaded) == {model}

    moved = str(tmp_path / "moved" / "model")
    rename_saved_model(saved, moved)
    refused = f"the saved cache {saved.resolve()} was made by model {moved!r}, which does not load here"
    with pytest.raises(ModelError, match=re.escape(refused)):
        InfoKV(document=str(saved), max_tokens=2).complete("What is the notice period?")
    assert InfoKV(model=model, document=str(saved), max_tokens=2).complete("What is the notice period?").text


def test_a_query_emits_the_llm_events_a_direct_chat_emits(random_model_dir: Path) -> None:
    """Token counters and tracers see a query's answer: LlamaIndex's query span and events, and the LLM's chat
    callbacks and instrumentation events, on `query` and `aquery`."""

    class Recorder(BaseEventHandler):
        seen: list[str] = []

        def handle(self, event: BaseEvent, **kwargs: Any) -> None:
            self.seen.append(type(event).__name__)

    counter = TokenCountingHandler(tokenizer=str.split)
    engine = DocumentQueryEngine.from_documents(
        [LlamaDocument(text=COLD_TEXT)],
        model=str(random_model_dir),
        max_tokens=2,
        callback_manager=CallbackManager([counter]),
    )
    recorder = Recorder()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(recorder)
    try:
        for query in (engine.query, lambda question: asyncio.run(engine.aquery(question))):
            recorder.seen.clear()
            counter.reset_counts()
            query("What is the notice period?")
            assert recorder.seen == ["QueryStartEvent", "LLMChatStartEvent", "LLMChatEndEvent", "QueryEndEvent"]
            assert len(counter.llm_token_counts) == 1
    finally:
        dispatcher.event_handlers.remove(recorder)


def test_from_documents_numbers_and_cites_same_named_files_apart(tmp_path: Path) -> None:
    for year, days in (("2023", "thirty"), ("2024", "ninety")):
        (tmp_path / year).mkdir()
        (tmp_path / year / "lease.txt").write_text(f"Lease {year}. The notice period is {days} days.")
    (tmp_path / "2024" / "annex.txt").write_text("Annex. The deposit is two months of rent.")
    documents = SimpleDirectoryReader(str(tmp_path), recursive=True).load_data()
    engine = DocumentQueryEngine.from_documents(documents, model="no-such-model")
    document = engine.llm.document
    assert isinstance(document, Document)
    assert [page.number for page in document.pages] == [1, 1, 1], "each file's pages are numbered from 1"

    def cited(answer: str) -> Any:
        return engine._source_nodes(document, answer, "What is it?")[0].node.metadata["file_name"]

    assert cited("The notice period is ninety days.") == str(tmp_path / "2024" / "lease.txt")
    assert cited("The deposit is two months of rent.") == "annex.txt"


def test_from_file_and_from_documents_refuse_each_others_arguments(no_document_read: None) -> None:
    pages = [LlamaDocument(text="The notice period is ninety days.", metadata={"file_name": "a.txt"})]
    for documents in (pages, pages[0]):
        with pytest.raises(TypeError, match=r"not LlamaIndex Documents: .*DocumentQueryEngine.from_documents"):
            DocumentQueryEngine.from_file(documents, model="tiny")  # type: ignore[arg-type]
    refusals: list[tuple[Any, str]] = [
        ("contract.pdf", r"not a path: DocumentQueryEngine.from_file\(path\)"),
        (Path("contract.pdf"), r"not a path"),
        (pages[0], r"not one Document: pass a list of it, \[document\]"),
        (["some text"], r"got a list holding str$"),
        (3, r"; got int$"),
    ]
    for wrong, message in refusals:
        with pytest.raises(TypeError, match="from_documents takes a sequence of LlamaIndex Documents" + ".*" + message):
            DocumentQueryEngine.from_documents(wrong, model="tiny")


def test_to_json_keeps_a_path_and_describes_a_document_held_in_memory(random_model_dir: Path, tmp_path: Path) -> None:
    model = str(random_model_dir)
    path = tmp_path / "contract.txt"
    path.write_text(COLD_TEXT)
    by_path = InfoKV(model=model, document=path, password="s3cret")
    assert InfoKV.from_json(by_path.to_json()).document == str(path)
    document = document_from_text(COLD_TEXT)
    for held in (document, get_engine(model).ingest_text(COLD_TEXT, COMPRESSION)):
        serialised = InfoKV(model=model, document=held, password=SecretStr("s3cret")).to_json()
        described = json.loads(serialised)["document"]
        assert described == {
            "not_serialised": type(held).__name__,
            "source": None,
            "pages": 1,
            "sha256": document.sha256,
        }
        assert "s3cret" not in serialised and "password" not in serialised
        with pytest.raises(TypeError, match=rf"serialised with a {type(held).__name__} .*from_json\(text, document="):
            InfoKV.from_json(serialised)
        assert InfoKV.from_json(serialised, document=held).document is held


def test_the_payload_describes_no_document_the_fields_no_longer_choose(random_model_dir: Path) -> None:
    llm = InfoKV(model=str(random_model_dir), document_text="The notice period is ninety days.", max_tokens=2)
    llm.complete("What is the notice period?")
    assert llm.to_payload()["context_window"] == llm.metadata.context_window
    llm.document_text = COLD_TEXT  # another document: the one read before no longer describes this LLM
    assert "context_window" not in llm.to_payload()
    llm.compressed_document()
    assert llm.to_payload()["context_window"] == llm.metadata.context_window


def test_the_factories_take_the_engines_max_sources_and_callback_manager(tmp_path: Path) -> None:
    path = tmp_path / "contract.txt"
    path.write_text(COLD_TEXT)
    callbacks = CallbackManager([])
    for engine in (
        DocumentQueryEngine.from_file(path, model="no-such-model", max_sources=5, callback_manager=callbacks),
        DocumentQueryEngine.from_documents(
            [LlamaDocument(text=COLD_TEXT)], model="no-such-model", max_sources=5, callback_manager=callbacks
        ),
    ):
        assert engine.max_sources == 5
        assert engine.callback_manager is callbacks and engine.llm.callback_manager is callbacks


def test_a_password_may_be_a_secret_str(random_model_dir: Path, tmp_path: Path) -> None:
    path = encrypted_pdf(tmp_path / "locked.pdf", FACT_PAGES, "s3cret")
    model = str(random_model_dir)
    llm = InfoKV(model=model, document=str(path), password=SecretStr("s3cret"), max_tokens=2)
    assert llm.complete("Who is the account manager?").text
    engine = DocumentQueryEngine.from_file(path, model=model, password=SecretStr("s3cret"), max_tokens=2)
    assert "Lindqvist" in engine.document.document.text
    assert isinstance(InfoKV(model=model, password="s3cret").password, SecretStr), "a str is held as a SecretStr"
    assert "s3cret" not in repr(engine) + repr(engine.model_dump()) + engine.llm.to_json()


def test_a_call_s_own_document_is_read_by_the_model_of_the_bound_one(random_engine: Any) -> None:
    """As in LangChain: a call's text is read by the engine that read the bound document, not the default model."""
    bound = random_engine.ingest_text(COLD_TEXT, CompressionConfig(keep=0.5))
    loaded = _common.loaded_models()
    llm = InfoKV(document=bound, max_tokens=2)
    text = f"{COLD_TEXT} Read per call."
    assert llm.compressed_document(document_text=text).engine is random_engine
    llm.complete("What is the fee?", document_text=text)
    assert _common.loaded_models() == loaded
