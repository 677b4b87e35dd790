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
from collections.abc import Callable

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
    # How a model frames an answer ("According to the document, ...", "Yes, ...").
    "answer according document says states yes true false".split()
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


_EDGE_LINES = 3
"""How many lines at the top and at the bottom of a page are looked at for a running header or footer."""
_PAGE_NUMBER = re.compile(r"(?:page\s*)?\d+(?:\s*(?:of|/)\s*\d+)?|-\s*\d+\s*-")
"""A line that is a page's number only: "3", "Page 3", "Page 3 of 12", "3/12", "- 3 -"."""


def _without_running_lines(texts: list[str]) -> list[str]:
    """Each page's text without its running headers and footers: the lines at its top and bottom that stand there,
    word for word (or as a page's number), on half of the pages or more (two at least); a page that has none is its
    text as it is. Only for finding an answer that runs across a page break, which they would interrupt: a header
    may hold what is asked (a contract's number), and lines alike but for their figures (a table's rows, invoices)
    are data."""
    pages = [[line for line in text.splitlines() if line.strip()] for text in texts]
    keys = [[_line_key(line) for line in lines] for lines in pages]
    recurring = Counter(key for page in keys for key in set(page[:_EDGE_LINES] + page[-_EDGE_LINES:]))
    running = {key for key, count in recurring.items() if count >= max(2, len(texts) / 2)}
    kept = []
    for text, lines, page in zip(texts, pages, keys, strict=True):
        first, last = 0, len(lines)
        while first < last and page[first] in running:
            first += 1
        while last > first and page[last - 1] in running:
            last -= 1
        kept.append(text if (first, last) == (0, len(lines)) else "\n".join(lines[first:last]))
    return kept


def _line_key(line: str) -> str:
    words = " ".join(line.split()).lower()
    return "#" if _PAGE_NUMBER.fullmatch(words) else words


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


def _best_run(
    holding: Callable[[str], set[int]], words: list[str], weights: dict[str, float]
) -> tuple[set[int], float, set[str]]:
    """The pages holding the run of the answer's words that carries most of its own words' weight (`weights`: the
    answer's own words, not the question's, each by its rarity; `holding`: the pages holding a run), that weight,
    and the words of the runs found. "It is 15 years." is found as "15 years"; "The answer is Joe Bloggs." as "Joe
    Bloggs", not as "the answer is" on another page; a run of the question's words that the answer repeats carries
    nothing. Runs that carry as much count alike."""

    def carried(run: list[str]) -> float:
        held = set(run) | {a + b for a, b in zip(run, run[1:], strict=False)}
        return sum(weight for term, weight in weights.items() if term in held)

    whole = holding(" ".join(words))
    if whole:  # the answer verbatim: no run carries more
        return whole, carried(words), set(words)
    found: set[int] = set()
    covered: set[str] = set()
    best, last = 0.0, 0
    for first in range(len(words)):
        # From each word, the longest run any page holds: a run no page holds is in no longer run held either, and
        # the rest of the run found from the word before is held (so each word is tried once as a run's end).
        last = max(last, first)
        held = holding(" ".join(words[first:last])) if last > first else set()
        while last < len(words) and (more := holding(" ".join(words[first : last + 1]))):
            last, held = last + 1, more
        weight = carried(words[first:last])
        if weight > 0 and weight >= best:
            run = set(words[first:last])
            found, covered = (found | held, covered | run) if weight == best else (held, run)
            best = weight
    return found, best, covered


def _pair_within(term: str, words: set[str]) -> bool:
    """Whether `term` is a pair of characters of a script without spaces (`_terms`) both of which are in `words`."""
    return len(term) == 2 and UNSPACED_CHARACTER.fullmatch(term[0]) is not None and set(term) <= words


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
    words is not cited where another holds some, nor, where the run carries half the answer's weight or more, a page
    without it that holds none of the answer's own words outside it (a second fact's page is cited)."""
    pages = document.pages
    if not pages or limit < 1:
        return []
    texts = [page.text for page in pages]
    page_words = [_normalised(text) for text in texts]
    page_terms = [_terms(words) for words in page_words]
    frequency = Counter(term for terms in page_terms for term in terms)
    weight = {term: math.log(1 + len(pages) / count) for term, count in frequency.items()}
    rarest = math.log(1 + len(pages))
    needle = _normalised(answer)
    unsupported = [(0, 0.0)] if len(pages) == 1 else []  # a document of one page is always its answers' source
    if not needle:
        return unsupported
    asked = _terms(_normalised(question))
    # An answer of one-letter words only ("B", "a.b") has no terms: its words are then what a run must hold. One of
    # stopwords only ("Yes.", "No.") has nothing of its own: its pages are those the question's words point to.
    answer_terms = _terms(needle) or set(needle.split()) - _STOPWORDS
    own = answer_terms - asked
    carried = {term: weight.get(term, rarest) for term in own or answer_terms}
    run_pages: set[int] = set()
    run_words: set[str] = set()
    run_share = 0.0
    if carried:
        # A run is found in the pages as they are, or across a page break with running headers and footers aside.
        read_on = [
            words if kept is text else _normalised(kept)
            for words, text, kept in zip(page_words, texts, _without_running_lines(texts), strict=True)
        ]
        as_read, read_on_joined = _JoinedPages(page_words), _JoinedPages(read_on)
        run_pages, run_weight, run_words = _best_run(
            lambda phrase: as_read.holding(phrase) | read_on_joined.holding(phrase), needle.split(), carried
        )
        run_share = run_weight / sum(carried.values())
    holding_own = [bool(own & terms) or index in run_pages for index, terms in enumerate(page_terms)]
    if own and not any(holding_own):
        return unsupported  # nothing of the answer's own is in the document
    # A run of half the answer's own weight or more settles where that part of it is: another page is cited only
    # for the answer's own words outside the run (the second of two facts).
    outside = {term for term in own if term not in run_words and not _pair_within(term, run_words)}
    total = sum(weight.get(t, rarest) for t in own) + 0.5 * sum(weight.get(t, 0.0) for t in asked)
    shares = {}
    for index, terms in enumerate(page_terms):
        if index in run_pages or (outside & terms if run_share >= 0.5 else not own or holding_own[index]):
            hit = sum(weight[t] for t in own & terms) + 0.5 * sum(weight[t] for t in asked & terms)
            shares[index] = hit / total if total else 0.0
    if not shares:
        return unsupported
    # Pages are ranked by the share of the answer they hold and the run they hold; one without the run is cited
    # when its share is half the best page's share or more.
    enough = 0.5 * max(shares.values())
    scored = sorted(
        ((index, share + run_share if index in run_pages else share) for index, share in shares.items()),
        key=lambda item: -item[1],
    )
    cited = [(index, score) for index, score in scored if score > 0 and (index in run_pages or shares[index] >= enough)]
    return [(index, round(score, 4)) for index, score in cited[:limit]] or unsupported
