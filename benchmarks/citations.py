"""How well citations find the page that holds an answer, on the real-document corpus, with no model.

    python -m benchmarks.citations [--split SPLIT]

For every question of `benchmarks/realdocs` and each of its accepted answers, the document is read through the PDF
path (`load_document`, page by page) and `infokv_rag.citations.supporting_pages` is asked for the answer in three
forms a model gives it: as written, in a sentence ("It is X."), and after the question restated ("The notice
period is X."). The pages that hold the answer are those whose text `answer_matches` (or the two pages a break
runs through). Printed per form: how often the first page cited holds the answer, how often any does, the share of
cited pages that hold it, and how often nothing is cited; then, for the first answers of a document's neighbouring
questions that different pages hold, given as one answer ("X, and Y."), how often a page of each is cited. What it
does not show: answers a model words otherwise (a figure reformatted, a unit added), answers no page holds verbatim
(left out: their pages cannot be told), and documents other than this corpus's 38 rendered ones.
"""

from __future__ import annotations

import argparse
import itertools
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence

from infokv_rag.citations import supporting_pages
from infokv_rag.documents import Document, load_document
from infokv_rag.evaluation import answer_matches

from .realdocs import SPLITS, RealDoc, load_realdocs

_ASKED = re.compile(
    r"(?i)(?:what|which|how many|how much|how long|who|when)\s+(?:is|are|was|does|do|must|can)?\s*(?:the\s+)?(.*?)\??$"
)

FORMS: dict[str, Callable[[str, str], str | None]] = {
    "as written": lambda question, answer: answer,
    "in a sentence": lambda question, answer: f"It is {answer}.",
    "question restated": lambda question, answer: (
        f"The {asked[1]} is {answer}." if (asked := _ASKED.match(question)) and asked[1] else None
    ),
}
"""How a model may give an answer: each form, from (question, answer); None where the form does not apply."""
TWO_FACTS = "two answers"


def pages_holding(document: Document, answer: str) -> set[int]:
    """Indices of the pages whose text holds `answer`, or of the two pages a break within it runs through."""
    texts = [page.text for page in document.pages]
    held = {index for index, text in enumerate(texts) if answer_matches(text, [answer])}
    if not held:
        for index in range(len(texts) - 1):
            if answer_matches(f"{texts[index]}\n\n{texts[index + 1]}", [answer]):
                held |= {index, index + 1}
    return held


def evaluate(documents: Sequence[RealDoc]) -> dict[str, Counter[str]]:
    """Per form: answers asked ("answers"), first cited right ("first"), any cited right ("any"), pages cited
    ("cited"), of them right ("right"), none cited ("none"); and under TWO_FACTS, pairs of one document's answers
    held by different pages given as one ("X, and Y."): "pairs", "both" (a page of each cited), "none"."""
    counts: dict[str, Counter[str]] = {form: Counter() for form in (*FORMS, TWO_FACTS)}
    for real in documents:
        document = load_document(real.pdf_path)
        first_answers = [(answers[0], pages_holding(document, answers[0])) for _, answers in real.questions]
        placed = [(answer, held) for answer, held in first_answers if held]
        for (one, one_held), (other, other_held) in itertools.pairwise(placed):
            if one_held.isdisjoint(other_held):
                both = {index for index, _ in supporting_pages(document, f"{one}, and {other}.")}
                counts[TWO_FACTS]["pairs"] += 1
                counts[TWO_FACTS]["both"] += bool(both & one_held) and bool(both & other_held)
                counts[TWO_FACTS]["none"] += not both
        for question, answers in real.questions:
            for answer in answers:
                held = pages_holding(document, answer)
                if not held:
                    continue
                for form, given in FORMS.items():
                    text = given(question, answer)
                    if text is None:
                        continue
                    cited = [index for index, _ in supporting_pages(document, text, question)]
                    count = counts[form]
                    count["answers"] += 1
                    count["first"] += bool(cited) and cited[0] in held
                    count["any"] += bool(held.intersection(cited))
                    count["cited"] += len(cited)
                    count["right"] += len(held.intersection(cited))
                    count["none"] += not cited
    return counts


def table(counts: dict[str, Counter[str]]) -> str:
    lines = [
        "| the answer | answers | first cited holds it | any cited holds it | cited pages holding it | none cited |",
        "|---|---|---|---|---|---|",
    ]
    for form, count in counts.items():
        if form == TWO_FACTS:
            continue
        answers = max(count["answers"], 1)
        lines.append(
            f"| {form} | {count['answers']} | {count['first'] / answers:.3f} | {count['any'] / answers:.3f} | "
            f"{count['right'] / max(count['cited'], 1):.3f} | {count['none']} |"
        )
    pairs = counts[TWO_FACTS]
    lines += [
        "",
        "| two answers on different pages, as one | pairs | a page of each cited | none cited |",
        "|---|---|---|---|",
        f"| X, and Y. | {pairs['pairs']} | {pairs['both'] / max(pairs['pairs'], 1):.3f} | {pairs['none']} |",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.citations", description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=SPLITS, help="one split of the corpus (default: every document)")
    args = parser.parse_args(argv)
    documents = load_realdocs(args.split)
    print(f"citations on {len(documents)} documents of benchmarks/realdocs ({args.split or 'every split'}):")
    print(table(evaluate(documents)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
