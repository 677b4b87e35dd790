"""Planted-fact documents for measuring what compression loses.

Facts with short, unambiguous answers (codes, amounts, dates, names) are inserted between sentences of
real legal text at random depths. The filler comes from free-software licenses bundled in
`infokv_rag/data/corpus` (GPL-2.0, GPL-3.0, LGPL-2.1, MPL-2.0; verbatim copying is permitted).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from importlib import resources

_FIRST_NAMES = ["Hilda", "Tomasz", "Ingrid", "Rafael", "Amara", "Kenji", "Oksana", "Dmitri", "Lucia", "Nadia"]
_LAST_NAMES = ["Marchetti", "Okafor", "Lindqvist", "Tanaka", "Brennan", "Kowalski", "Haddad", "Ferreira"]
_MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
_CITIES = ["Rotterdam", "Valparaiso", "Tromso", "Marrakesh", "Adelaide", "Winnipeg", "Ljubljana", "Cartagena"]


@dataclass(frozen=True)
class Fact:
    sentence: str
    question: str
    answer: str


@dataclass(frozen=True)
class FactDocument:
    text: str
    facts: tuple[Fact, ...]
    depths: tuple[float, ...]
    """Where each fact sits, as a fraction of the document's characters."""


def _fact_templates(rng: random.Random) -> list[Fact]:
    code = str(rng.randint(10000, 99999))
    amount = f"{rng.randint(11, 98)},{rng.randint(100, 999)}"
    day, month, year = rng.randint(2, 28), rng.choice(_MONTHS), rng.randint(2027, 2039)
    name = f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"
    city = rng.choice(_CITIES)
    days = str(rng.choice([17, 23, 37, 43, 47, 53, 67, 73]))
    return [
        Fact(f"The access code for the archive room is {code}.", "What is the access code for the archive room?", code),
        Fact(
            f"The penalty for late delivery is {amount} euros.",
            "How many euros is the penalty for late delivery?",
            amount,
        ),
        Fact(
            f"The warranty expires on {day} {month} {year}.",
            "On what date does the warranty expire?",
            f"{day} {month} {year}",
        ),
        Fact(f"The contract manager is {name}.", "Who is the contract manager?", name),
        Fact(
            f"All disputes are settled in the courts of {city}.", "In which city's courts are disputes settled?", city
        ),
        Fact(
            f"Either party may terminate with {days} days notice.", "How many days notice is needed to terminate?", days
        ),
    ]


def corpus_sentences(name: str) -> list[str]:
    """Sentences of one bundled license text (whitespace normalised)."""
    text = resources.files("infokv_rag.data.corpus").joinpath(name).read_text(encoding="utf-8")
    text = re.sub(r"\s+", " ", text)
    return [s.strip() for s in re.split(r"(?<=[.;:])\s+", text) if len(s.strip()) > 20]


CORPUS_FILES = ("gpl-3.0.txt", "gpl-2.0.txt", "lgpl-2.1.txt", "mpl-2.0.txt")


def make_fact_document(seed: int, target_words: int = 1200, facts: int = 4) -> FactDocument:
    """A document of about `target_words` words of license text with `facts` facts at random depths."""
    rng = random.Random(seed)
    sentences = corpus_sentences(CORPUS_FILES[seed % len(CORPUS_FILES)])
    start = rng.randrange(0, max(1, len(sentences) // 2))
    body: list[str] = []
    words = 0
    index = start
    while words < target_words:
        sentence = sentences[index % len(sentences)]
        body.append(sentence)
        words += len(sentence.split())
        index += 1
    chosen = rng.sample(_fact_templates(rng), facts)
    slots = sorted(rng.sample(range(1, len(body)), facts))
    for offset, (slot, fact) in enumerate(zip(slots, chosen, strict=True)):
        body.insert(slot + offset, fact.sentence)
    text = " ".join(body)
    depths = tuple(text.index(fact.sentence) / len(text) for fact in chosen)
    return FactDocument(text=text, facts=tuple(chosen), depths=depths)


def answer_matches(answer: str, expected: str) -> bool:
    """Whether `answer` contains `expected`, ignoring case, spacing and thousands separators, and not as part of
    a longer number ("14000" does not answer "1400")."""

    def canonical(text: str) -> str:
        return re.sub(r"[\s,.]", "", text.lower())

    return re.search(rf"(?<!\d){re.escape(canonical(expected))}(?!\d)", canonical(answer)) is not None
