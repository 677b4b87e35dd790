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
from collections import Counter

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
    "as any all not no shall may will which who whom what when where how per such than then there their "
    "if so do we us he me my up am "  # two letters, which are words since options like "-tt" are
    "answer according document says states".split()  # how a model frames its answer ("According to the document")
)


def _terms(words: str) -> set[str]:
    """The content words of normalised text (`_normalised`): every word of two characters or more that is no stopword,
    and every number ("-tt" is the word "tt", an option asked about; how common a word is weighs it); in a script
    without spaces, each pair of neighbouring characters."""
    split = words.split()
    terms = {w for w in split if w not in _STOPWORDS and (len(w) > 1 or w.isdigit())}
    pairs = zip(split, split[1:], strict=False)
    terms.update(a + b for a, b in pairs if UNSPACED_CHARACTER.fullmatch(a) and UNSPACED_CHARACTER.fullmatch(b))
    return terms


_EDGE_LINES = 2
"""How many lines at the top and at the bottom of a page may be a running header or footer."""


def _without_running_lines(texts: list[str]) -> list[str]:
    """Each page's text without its running headers and footers: a line among a page's first or last `_EDGE_LINES`
    that stands there (its figures aside: "Page 3") on at least three pages and half of them. With them left in,
    no answer running across a page break read as one run of words."""
    edges = []
    for text in texts:
        lines = [line for line in text.splitlines() if line.strip()]
        edges.append({_masked(line) for line in lines[:_EDGE_LINES] + lines[-_EDGE_LINES:]})
    recurring = Counter(line for lines in edges for line in lines)
    running = {line for line, pages in recurring.items() if pages >= max(3, len(texts) / 2)}
    if not running:
        return texts
    kept = []
    for text in texts:
        lines = [line for line in text.splitlines() if line.strip()]
        edge = set(range(_EDGE_LINES)) | set(range(len(lines) - _EDGE_LINES, len(lines)))
        kept.append("\n".join(line for at, line in enumerate(lines) if at not in edge or _masked(line) not in running))
    return kept


def _masked(line: str) -> str:
    return re.sub(r"\d+", "#", " ".join(line.split()).lower())


class _JoinedPages:
    """The normalised text of every page (`_normalised`: words joined by single spaces) in one string, so that a run
    of words is found across page breaks too; an empty page is passed over, as a page break is."""

    def __init__(self, pages: list[str]) -> None:
        self.offsets: list[int] = []
        self.indices: list[int] = []
        parts, offset = [], 1  # the joined text's leading space
        for index, page in enumerate(pages):
            if page:
                self.offsets.append(offset)
                self.indices.append(index)
                parts.append(page)
                offset += len(page) + 1
        self.joined = f" {' '.join(parts)} "

    def holding(self, phrase: str) -> set[int]:
        """Indices of the pages that hold `phrase` as whole words, and of every page an occurrence runs across (an
        answer over two page breaks cites all three pages)."""
        found: set[int] = set()
        start = self.joined.find(f" {phrase} ")
        while start != -1:
            begin, end = start + 1, start + 1 + len(phrase)
            part = bisect.bisect_right(self.offsets, begin) - 1
            while part < len(self.offsets) and self.offsets[part] < end:
                found.add(self.indices[part])
                part += 1
            start = self.joined.find(f" {phrase} ", start + 1)
        return found


def _best_run(pages: _JoinedPages, words: list[str], weights: dict[str, float]) -> tuple[set[int], float]:
    """The pages holding the run of the answer's words that carries most of its own words' weight (`weights`: the
    answer's own words, not the question's, each by its rarity), and that weight. "It is 15 years." is found as "15
    years"; "The answer is Joe Bloggs." as "Joe Bloggs", not as "the answer is" on another page; a run of the
    question's words that the answer repeats carries nothing. Runs that carry as much count alike."""

    def carried(run: list[str]) -> float:
        held = set(run) | {a + b for a, b in zip(run, run[1:], strict=False)}
        return sum(weight for term, weight in weights.items() if term in held)

    whole = pages.holding(" ".join(words))
    if whole:  # the answer verbatim: no run carries more
        return whole, carried(words)
    found: set[int] = set()
    best = 0.0
    last = 0
    for first in range(len(words)):
        # From each word, the longest run any page holds: a run no page holds is in no longer run held either, and
        # the rest of the run found from the word before is held (so each word is tried once as a run's end).
        last = max(last, first)
        held = pages.holding(" ".join(words[first:last])) if last > first else set()
        while last < len(words) and (holding := pages.holding(" ".join(words[first : last + 1]))):
            last, held = last + 1, holding
        weight = carried(words[first:last])
        if weight > 0 and weight >= best:
            found, best = (found | held if weight == best else held), weight
    return found, best


def supporting_pages(document: Document, answer: str, question: str = "", limit: int = 3) -> list[tuple[int, float]]:
    """(index in `document.pages`, score) of the pages that best support an answer, best first (an index, not
    a page number: pages gathered from several files may share numbers); none for an answer whose own words (those
    not in the question) no page holds, or that has no words, but for the one page of a document of one page.

    A page holding the whole answer verbatim, as whole words (`_normalised`'s: "ten" is not in "tenant",
    nor "50%" in "150%"), scores highest, and so does every page of an answer split across page breaks (running
    headers and footers aside); an answer in a sentence of the model's ("It is 15 years.") is found by the run of its
    words carrying most of its own words' rarity, scoring the share of that weight the run carries. Pages are also
    ranked by the rarity-weighted share of the answer's words they hold, a word on no page counting as the rarest:
    the question's words, also where the answer repeats them, count half. A page holding none of the answer's own
    words is not cited where another holds some, nor is a page without the run where the run carries half the
    answer's weight or more.
    """
    pages = document.pages
    if not pages or limit < 1:
        return []
    page_words = [_normalised(text) for text in _without_running_lines([page.text for page in pages])]
    page_terms = [_terms(words) for words in page_words]
    frequency = Counter(term for terms in page_terms for term in terms)
    weight = {term: math.log(1 + len(pages) / count) for term, count in frequency.items()}
    rarest = math.log(1 + len(pages))
    needle = _normalised(answer)
    unsupported = [(0, 0.0)] if len(pages) == 1 else []  # a document of one page is always its answers' source
    if not needle:
        return unsupported
    asked = _terms(_normalised(question))
    # An answer of one-letter words only ("B", "a.b") has no terms: its words are then what a run must hold.
    answer_terms = _terms(needle) or set(needle.split())
    own = answer_terms - asked
    carried = {term: weight.get(term, rarest) for term in own or answer_terms}
    run_pages, run_weight = _best_run(_JoinedPages(page_words), needle.split(), carried)
    run_share = run_weight / sum(carried.values())
    holding_own = [bool(own & terms) or index in run_pages for index, terms in enumerate(page_terms)]
    if own and not any(holding_own):
        return unsupported  # nothing of the answer's own is in the document
    total = sum(weight.get(t, rarest) for t in own) + 0.5 * sum(weight.get(t, 0.0) for t in asked)
    settled = run_share >= 0.5  # a run of most of the answer's own weight settles where it is: no other page is cited
    scored: list[tuple[int, float]] = []
    for index, terms in enumerate(page_terms):
        if index not in run_pages and (settled or (own and not holding_own[index])):
            continue
        hit = sum(weight[t] for t in own & terms) + 0.5 * sum(weight[t] for t in asked & terms)
        score = hit / total if total else 0.0
        scored.append((index, score + run_share if index in run_pages else score))
    scored.sort(key=lambda item: -item[1])
    best = scored[0][1] if scored else 0.0
    if best <= 0:
        return unsupported
    return [(index, round(score, 4)) for index, score in scored[:limit] if score >= 0.5 * best]
