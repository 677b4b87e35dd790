"""Which pages of a document support an answer: the citations a query engine returns beside its answer.

The answer comes from the compressed cache, which holds no page map; the pages are found afterwards by
matching the answer (and the question) against each page's text.
"""

from __future__ import annotations

import math
import re

from .documents import Document

__all__ = ["supporting_pages"]

_WORD = re.compile(r"\w+", re.UNICODE)
_STOPWORDS = frozenset(
    "the a an and or of to in on at by for with from is are was were be been this that these those it its "
    "as any all not no shall may will which who whom what when where how per such than then there their".split()
)


def _terms(text: str) -> set[str]:
    return {
        w
        for w in (m.group().lower() for m in _WORD.finditer(text))
        if w not in _STOPWORDS and (len(w) > 2 or w.isdigit())
    }


def supporting_pages(document: Document, answer: str, question: str = "", limit: int = 3) -> list[tuple[int, float]]:
    """(index in `document.pages`, score) of the pages that best support an answer, best first (an index, not
    a page number: pages gathered from several files may share numbers).

    A page holding the whole answer verbatim scores highest; otherwise pages are ranked by the
    rarity-weighted share of the answer's words they contain (the question's words count half).
    """
    pages = document.pages
    if not pages:
        return []
    page_terms = [_terms(page.text) for page in pages]
    frequency: dict[str, int] = {}
    for terms in page_terms:
        for term in terms:
            frequency[term] = frequency.get(term, 0) + 1
    weight = {term: math.log(1 + len(pages) / count) for term, count in frequency.items()}
    answer_terms, question_terms = _terms(answer), _terms(question) - _terms(answer)
    total = sum(weight.get(t, 0.0) for t in answer_terms) + 0.5 * sum(weight.get(t, 0.0) for t in question_terms)
    needle = " ".join(answer.split()).lower().rstrip(".")
    scored: list[tuple[int, float]] = []
    for page, terms in zip(pages, page_terms, strict=True):
        hit = sum(weight[t] for t in answer_terms & terms) + 0.5 * sum(weight[t] for t in question_terms & terms)
        score = hit / total if total else 0.0
        if len(needle) >= 3 and needle in " ".join(page.text.split()).lower():
            score += 1.0
        scored.append((len(scored), score))
    scored.sort(key=lambda item: -item[1])
    best = scored[0][1]
    if best <= 0:
        return [(0, 0.0)] if len(pages) == 1 else []
    return [(index, round(score, 4)) for index, score in scored[:limit] if score >= 0.5 * best]
