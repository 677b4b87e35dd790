"""The small shared helpers: the document cache of the service and the integrations, the page map, the examples'
command lines."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from infokv_rag.config import CompressionConfig
from infokv_rag.documents import PAGE_SEPARATOR, Document, Page, load_document
from infokv_rag.errors import InfoKVError
from infokv_rag.evaluation import answer_matches
from infokv_rag.loaded import LoadOnceCache

from . import pdf_factory as pdfs


def test_concurrent_callers_of_one_key_share_one_load() -> None:
    cache: LoadOnceCache[str, str] = LoadOnceCache(capacity=2)
    loads: list[str] = []

    def load() -> str:
        loads.append("a")
        time.sleep(0.05)
        return "value"

    threads = [threading.Thread(target=cache.get_or_load, args=("a", load)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert loads == ["a"]
    assert cache.get("a") == "value"


def test_the_least_recently_used_key_is_dropped() -> None:
    cache: LoadOnceCache[str, int] = LoadOnceCache(capacity=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert cache.get("c") == 3 and cache.get("b") is None and cache.pop("a") == 1 and cache.get("a") is None


def test_a_failed_load_is_retried_by_the_next_caller() -> None:
    cache: LoadOnceCache[str, int] = LoadOnceCache(capacity=1)

    def fail() -> int:
        raise OSError("disk")

    try:
        cache.get_or_load("k", fail)
    except OSError:
        pass
    assert cache.get_or_load("k", lambda: 7) == 7


def test_after_a_failed_load_callers_still_share_one_load_at_a_time() -> None:
    """A load fails while callers wait on it: one of them loads again while the rest, and a newcomer, wait for it."""
    cache: LoadOnceCache[str, object] = LoadOnceCache(capacity=2)
    first_started, fail_first, retry_started, finish_retry = (threading.Event() for _ in range(4))
    guard = threading.Lock()
    loads = active = most_at_once = 0

    def load() -> object:
        nonlocal loads, active, most_at_once
        with guard:
            loads += 1
            first = loads == 1
            active += 1
            most_at_once = max(most_at_once, active)
        try:
            (first_started if first else retry_started).set()
            (fail_first if first else finish_retry).wait(5)
            if first:
                raise OSError("transient read error")
            return object()
        finally:
            with guard:
                active -= 1

    results: dict[str, object] = {}

    def caller(name: str) -> None:
        try:
            results[name] = cache.get_or_load("k", load)
        except OSError as error:
            results[name] = error

    def start(name: str) -> threading.Thread:
        thread = threading.Thread(target=caller, args=(name,))
        thread.start()
        thread.join(0.05)  # time to queue on the key's lock (a load of their own would not wait for a signal)
        return thread

    first = start("first")
    assert first_started.wait(5)
    waiting = [start("waiting 1"), start("waiting 2")]
    fail_first.set()
    assert retry_started.wait(5)
    newcomer = start("newcomer")
    finish_retry.set()
    for thread in (first, *waiting, newcomer):
        thread.join(5)
    assert isinstance(results.pop("first"), OSError)
    assert (loads, most_at_once) == (2, 1)
    assert len({id(value) for value in results.values()}) == 1 and len(results) == 3
    assert cache._loading == {}  # the key's lock is let go once nobody waits


def test_the_page_map_rebuilds_the_document() -> None:
    pages = (Page(1, "First page."), Page(3, "Third page,\nafter a skipped one."))
    text = PAGE_SEPARATOR.join(page.text for page in pages)
    document = Document(text=text, pages=pages, source="a.pdf", sha256="0" * 64, skipped_pages=(2,))
    assert Document.from_layout(text, document.layout()) == document


# The examples' command lines: what they refuse before a model loads ---------------------------------------


def _example(name: str) -> ModuleType:
    """examples/<name>.py as a module (the examples import their `_common` from their own folder)."""
    folder = Path(__file__).resolve().parents[1] / "examples"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", folder / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(folder))


def _refused(main: Callable[[list[str]], object], argv: list[str]) -> str:
    """The refusal of `argv`, before any model loads (`--model no-such-model` would fail on loading): an error the
    examples' `run` reports in one line."""
    with pytest.raises((InfoKVError, OSError)) as refusal:
        main(argv)
    return str(refusal.value)


def test_the_examples_check_the_document_and_options_first(tmp_path: Path) -> None:
    parse_args = _example("_common").parse_args

    def main(argv: list[str]) -> object:
        return parse_args("example", ["--model", "no-such-model", *argv])

    assert "is a directory" in _refused(main, ["--document", str(tmp_path)])
    assert "damaged" in _refused(main, ["--document", str(pdfs.corrupt_pdf(tmp_path / "bad.pdf"))])
    locked = pdfs.encrypted_pdf(tmp_path / "locked.pdf", ["The fee is 40 EUR."], "pw")
    assert "--password" in _refused(main, ["--document", str(locked)])
    assert "--max-tokens must be at least 1" in _refused(main, ["--max-tokens", "0"])
    args = main(["--document", str(locked), "--password", "pw"])
    assert isinstance(args, argparse.Namespace) and "40 EUR" in args.source.text
    assert (args.compression.method, args.compression.keep) == ("infokv", 0.25)
    # A saved cache is answered as it was made (with recall, codes or settings no flag here sets), unless a
    # --method or --keep is given, which the adapters then check against it.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text("{}")

    def compression(*argv: str) -> CompressionConfig | None:
        given = ["--model", "tiny", "--document", str(cache), *argv]  # unset, the model the manifest names
        config: CompressionConfig | None = parse_args("example", given).compression
        return config

    assert compression() is None
    assert compression("--keep", "0.5") == CompressionConfig(keep=0.5)
    assert compression("--method", "full") == CompressionConfig(method="full")


def test_the_demo_checks_its_options_first_and_answers_by_whole_words() -> None:
    demo = _example("demo")
    refusal = _refused(demo.main, ["--model", "no-such-model", "--max-new-tokens", "0"])
    assert "--max-new-tokens must be at least 1" in refusal

    class Answered:
        """A document whose every answer is `text`: what the demo's check credits."""

        def __init__(self, text: str) -> None:
            self.text = text

        def generate(self, turns: object, options: object) -> SimpleNamespace:
            return SimpleNamespace(text=lambda: self.text, usage=SimpleNamespace(time_to_first_token=0.1))

    def right(answer: str, expected: list[str]) -> bool:
        return demo.ask_checked(Answered(answer), "Q?", expected, 8)[1]

    assert not right("Ownership of 150% of the shares.", ["50%", "fifty percent"])
    assert not right("The Licensor has issued the Work under the License.", ["AS IS"])
    assert right("On an AS IS basis.", ["AS IS"]) and right("Fifty percent (50%).", ["50%"])


def test_the_sample_agreement_reads_whole_and_holds_every_expected_answer() -> None:
    common = _example("_common")
    document = load_document(common.SAMPLE)
    text = (common.SAMPLE.parent / "maintenance-agreement.txt").read_text(encoding="utf-8")
    assert document.text.split() == text.split()  # the PDF path reads every word, in order
    questions = common.read_questions()
    assert len(questions) >= 5 and common.parse_args("example", []).questions == [q for q, _ in questions]
    for question, expected in questions:
        assert expected and answer_matches(document.text, expected), question


def test_the_demo_takes_a_method_that_keeps_every_token() -> None:
    """`--method full` leaves the demo's --recall at none (its 0.1 would ask a cold tier of a method that evicts
    nothing): the run gets past its options to loading the model. A --recall given with it is still refused."""
    demo = _example("demo")
    assert "no-such-model" in _refused(demo.main, ["--model", "no-such-model", "--method", "full"])
    refusal = _refused(demo.main, ["--model", "no-such-model", "--method", "full", "--recall", "0.1"])
    assert "recall needs a method that evicts tokens" in refusal
