"""Which pages of a document support an answer: the citations a query engine returns beside its answer.

The answer comes from the compressed cache, which holds no page map; the pages are found afterwards by
matching the answer (and the question) against each page's text, in any script: text is normalised with
`normalize_answer(..., unicode=True)`, where a script written without spaces (Chinese, Japanese, Thai) is one word
per character, and its content words are the pairs of neighbouring characters (most Chinese words are two
characters, and a single character is too common to tell pages apart).
"""

from __future__ import annotations

import bisect
import math
import re

from .documents import Document
from .evaluation import UNSPACED_CHARACTER, normalize_answer

__all__ = ["supporting_pages"]

_GROUP_SEPARATOR = "[\u00a0\u2009\u202f\u066c]"
_GROUPED_DIGITS = re.compile(rf"(?<![\d.,])\d{{1,3}}(?:{_GROUP_SEPARATOR}\d{{3}})+(?!\d)")
"""Digits grouped by thousands with a no-break, thin or narrow no-break space ("1\u202f500") or the Arabic separator.
Not by a plain space or a tab: figures in a table's row ("250 310 420") or a TSV line stay apart."""
_DECIMAL_COMMA = re.compile(r"(?<![\d,])(\d+)(?:,|\u066b)(\d{1,2})(?![\d,])")
"""A figure with a decimal comma ("0,5", "1,25") or the Arabic decimal separator: one comma, one or two digits after
it, none of a list's ("12,45,7") nor a thousands separator ("7,400")."""


def _normalised(text: str) -> str:
    """`normalize_answer(text, unicode=True)` with numbers read as other languages write them (before it splits
    them at their separators: "5 %" was found in "0,5 %", "500" in "1\u202f500"): digits grouped by no-break
    spaces are one number, a decimal comma a decimal point. Citations only; the benchmarks' checker reads text as it
    did."""
    text = _GROUPED_DIGITS.sub(lambda grouped: re.sub(_GROUP_SEPARATOR, "", grouped[0]), text)
    return normalize_answer(_DECIMAL_COMMA.sub(r"\1.\2", text), unicode=True)


_STOPWORDS = frozenset(
    "the a an and or of to in on at by for with from is are was were be been this that these those it its "
    "as any all not no shall may will which who whom what when where how per such than then there their".split()
)


def _terms(words: str) -> set[str]:
    """The content words of normalised text (`_normalised`); in a script without spaces, each pair of neighbouring
    characters."""
    split = words.split()
    terms = {w for w in split if w not in _STOPWORDS and (len(w) > 2 or w.isdigit())}
    pairs = zip(split, split[1:], strict=False)
    terms.update(a + b for a, b in pairs if UNSPACED_CHARACTER.fullmatch(a) and UNSPACED_CHARACTER.fullmatch(b))
    return terms


def _verbatim_pages(pages: list[str], needle: str) -> set[int]:
    """Indices of the pages that hold `needle` as whole words, and of every page an occurrence runs across (an answer
    over two page breaks cites all three pages). `pages` and `needle` are normalised (`_normalised`: words joined by
    single spaces); an empty page is passed over, as a page break is."""
    offsets, indices, parts = [], [], []
    offset = 1  # joined's leading space
    for index, page in enumerate(pages):
        if page:
            offsets.append(offset)
            indices.append(index)
            parts.append(page)
            offset += len(page) + 1
    joined = f" {' '.join(parts)} "
    found: set[int] = set()
    start = joined.find(f" {needle} ")
    while start != -1:
        begin, end = start + 1, start + 1 + len(needle)
        part = bisect.bisect_right(offsets, begin) - 1
        while part < len(offsets) and offsets[part] < end:
            found.add(indices[part])
            part += 1
        start = joined.find(f" {needle} ", start + 1)
    return found


def supporting_pages(document: Document, answer: str, question: str = "", limit: int = 3) -> list[tuple[int, float]]:
    """(index in `document.pages`, score) of the pages that best support an answer, best first (an index, not
    a page number: pages gathered from several files may share numbers).

    A page holding the whole answer verbatim, as whole words (`_normalised`'s: "ten" is not in "tenant",
    nor "50%" in "150%"), scores highest, and so does every page of an answer split across page breaks; otherwise
    pages are ranked by the rarity-weighted share of the answer's words they contain (the question's words count
    half).
    """
    pages = document.pages
    if not pages or limit < 1:
        return []
    page_words = [_normalised(page.text) for page in pages]
    page_terms = [_terms(words) for words in page_words]
    frequency: dict[str, int] = {}
    for terms in page_terms:
        for term in terms:
            frequency[term] = frequency.get(term, 0) + 1
    weight = {term: math.log(1 + len(pages) / count) for term, count in frequency.items()}
    needle = _normalised(answer)
    answer_terms = _terms(needle)
    question_terms = _terms(_normalised(question)) - answer_terms
    total = sum(weight.get(t, 0.0) for t in answer_terms) + 0.5 * sum(weight.get(t, 0.0) for t in question_terms)
    # A needle of one or two characters ("5", "no") would be found on most pages.
    verbatim = _verbatim_pages(page_words, needle) if len(needle) >= 3 else set()
    scored: list[tuple[int, float]] = []
    for index, terms in enumerate(page_terms):
        hit = sum(weight[t] for t in answer_terms & terms) + 0.5 * sum(weight[t] for t in question_terms & terms)
        score = hit / total if total else 0.0
        scored.append((index, score + 1.0 if index in verbatim else score))
    scored.sort(key=lambda item: -item[1])
    best = scored[0][1]
    if best <= 0:
        return [(0, 0.0)] if len(pages) == 1 else []
    return [(index, round(score, 4)) for index, score in scored[:limit] if score >= 0.5 * best]
