"""The small shared helpers: the document cache of the service and the integrations, the page map."""

from __future__ import annotations

import threading
import time

from infokv_rag.documents import PAGE_SEPARATOR, Document, Page
from infokv_rag.loaded import LoadOnceCache


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


def test_the_least_recently_used_key_is_dropped_and_reported() -> None:
    dropped: list[str] = []
    cache: LoadOnceCache[str, int] = LoadOnceCache(capacity=2, on_drop=dropped.append)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert dropped == ["b"]
    assert cache.get("b") is None and cache.pop("a") == 1 and cache.get("a") is None


def test_a_failed_load_is_retried_by_the_next_caller() -> None:
    cache: LoadOnceCache[str, int] = LoadOnceCache(capacity=1)

    def fail() -> int:
        raise OSError("disk")

    try:
        cache.get_or_load("k", fail)
    except OSError:
        pass
    assert cache.get_or_load("k", lambda: 7) == 7


def test_the_page_map_rebuilds_the_document() -> None:
    pages = (Page(1, "First page."), Page(3, "Third page,\nafter a skipped one."))
    text = PAGE_SEPARATOR.join(page.text for page in pages)
    document = Document(text=text, pages=pages, source="a.pdf", sha256="0" * 64, skipped_pages=(2,))
    assert Document.from_layout(text, document.layout()) == document
