"""Measuring what compression loses: planted-fact documents, the closed-book control and the answer check.

Facts with short, unambiguous answers (codes, amounts, dates, names) are inserted between sentences of
real legal text at random depths. The filler comes from free-software licenses bundled in
`infokv_rag/data/corpus` (GPL-2.0, GPL-3.0, LGPL-2.1, MPL-2.0; verbatim copying is permitted).
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

from .documents import Document, Page

BLANK_DOCUMENT = Document(text="", pages=(Page(1, ""),), source="blank", sha256="")
"""The closed-book control: a document with no text (the prompt's instruction and an empty body), so that a
question asked against it is answered from the model's memory alone; an answer right there does not need the
document. `load_document` and `document_from_text` refuse an empty document: pass this to `ingest_document`."""

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


UNSPACED_CHARACTER = re.compile(
    "["
    "\u0e00-\u0eff"  # Thai, Lao
    "\u1000-\u109f"  # Myanmar
    "\u1780-\u17ff"  # Khmer
    "\u3040-\u30ff"  # Hiragana, Katakana
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003134f"  # Han
    "\uac00-\ud7a3"  # Hangul syllables
    "]"
)
"""A character of a script written without spaces between words: `normalize_answer(..., unicode=True)` makes each
one a word of its own. Korean has spaces, but between phrases whose particles and endings join the word ("30일입니다",
"is 30 days"): its syllables are words too, or no answer would be found as words in the text."""


def normalize_answer(text: str, *, unicode: bool = False) -> str:
    """Lower case, thousands separators dropped ("7,400" -> "7400"), "%" -> " percent ", zero decimals dropped
    ("265.00" -> "265") and a cents figure's trailing zero too ("2.50" -> "2.5"), letters and digits apart
    ("RFC2373" -> "rfc 2373"), a number's decimal or version dots and its sign kept with it ("0.5" -> "0p5",
    "1.20.1" -> "1p20p1", "-10" -> "minus10": none of them contains "5", "1" or "10"), other punctuation ->
    spaces, whitespace collapsed.

    By default only ASCII letters and digits are kept (the benchmarks' answer checker, `answer_matches`, whose
    verdicts must not move). `unicode`: every script's letters, marks and digits are kept, case-folded ("Straße"
    as "strasse"), so that text in Cyrillic or Greek reads as words; ASCII text normalises exactly as by default.
    A script written without spaces (Chinese, Japanese, Thai; Korean, `UNSPACED_CHARACTER`) has no words to find, so
    each of its characters is a word: "通知期为三十天" -> "通 知 期 为 三 十 天", in which "三十天" is found as the
    words "三 十 天" and "十" is not found in "三十" by accident of a neighbouring word. Characters rather than a
    dictionary's words (a segmenter would be a dependency and guess on legal terms) or n-grams (which a caller
    can build from the characters, as `infokv_rag.citations` does)."""
    # NFKC leaves a minus sign or an en dash before a figure as it is: it is a sign as "-" is (U+2212 10 is not 10).
    text = re.sub(r"[\u2212\u2013](?=\d)", "-", unicodedata.normalize("NFKC", text))
    text = (text.casefold() if unicode else text.lower()).replace("%", " percent ")
    letter, word = (r"[^\W\d_]", r"[^\W_]") if unicode else ("[a-z]", "[0-9a-z]")
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    text = re.sub(r"(?<![\d.])(\d+)\.0+(?!\d|\.\d)", r"\1", text)
    text = re.sub(r"(?<![\d.])(\d+\.\d)0(?!\d|\.\d)", r"\1", text)
    text = re.sub(rf"(?<={letter})(?=\d)|(?<=\d)(?={letter})", " ", text)
    text = re.sub(r"(?<=\d)\.(?=\d)", "p", text)
    text = re.sub(rf"(?<!{word})-(?=\d)", "minus", text)
    if unicode:
        text = "".join(char if unicodedata.category(char)[0] in "LMN" else " " for char in text)
        text = UNSPACED_CHARACTER.sub(r" \g<0> ", text)
    else:
        text = re.sub(r"[^0-9a-z]+", " ", text)
    return " ".join(text.split())


_NUMBER_WORD = re.compile(r"(minus)?\d+(p\d+)*")
_NAME = re.compile(r"[-_%/.~@]*[0-9A-Za-z]+(?:[-_./:@%=~]+[0-9A-Za-z]+)*")
"""A run of letters and digits joined by punctuation, with a path's, a hidden file's or a format's leading mark."""
_JOINED = re.compile(r"[A-Za-z][-_./:@%=]+[0-9A-Za-z]|%[A-Za-z]")
_FORMAT = re.compile(r"%[A-Za-z]")
_NUMBER_WORDS = re.compile(
    r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen"
    r"|seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundred|thousand)"
    r"(?:-(?:one|two|three|four|five|six|seven|eight|nine))?",
    re.IGNORECASE,
)
_ABBREVIATION = re.compile(r"[A-Za-z](?:\.[A-Za-z])+")


def _identifiers(accepted: str) -> list[str]:
    """The names in an accepted string whose punctuation is part of them ("home-lennart.mount", "IMAGE_VERSION",
    "%Y%m%d"): punctuation between a letter and a letter or digit, or a format's "%" before a letter. A number
    written in words ("thirty-six") and an abbreviation of single letters ("p.m.", "U.S.C.") are words."""
    return [
        name
        for name in _NAME.findall(accepted)
        if _JOINED.search(name) and not _NUMBER_WORDS.fullmatch(name) and not _ABBREVIATION.fullmatch(name)
    ]


def _names_whole(answer: str, accepted: str) -> bool:
    """Whether every identifier of `accepted` occurs in `answer` as written (lower case, but a format's own case:
    "%Y" is not "%y"), with its punctuation, as whole words: no letter or digit on either side, as the normalised
    words' rule has it (a file name that joins a site's name to a path with "_" still names the site)."""
    answer = unicodedata.normalize("NFKC", answer)
    for name in _identifiers(accepted):
        text = answer if _FORMAT.search(name) else answer.lower()
        name = name if _FORMAT.search(name) else name.lower()
        if not re.search(rf"(?<![^\W_]){re.escape(name)}(?![^\W_])", text):
            return False
    return True


def answer_matches(answer: str, accepted: Sequence[str]) -> bool:
    """Whether `answer` contains any accepted string, compared as whole normalised words (`normalize_answer`:
    "basis" does not hold "as is", nor "148213" "48213", nor "Section 5.3" "53").

    An accepted string that holds an identifier (`_identifiers`: "home-lennart.mount", "IMAGE_VERSION",
    "_workstation._tcp", "Multi-Arch", "%Y%m%d") must also hold it whole in the answer with its punctuation as
    written, and a format with its case: the normalised words cannot tell "/home/lennart.mount" from
    "home-lennart.mount", "power switch" from "power-switch", or "%y%m%d" from "%Y%m%d", and for such a question
    that difference is the answer. Numbers ("1,400", "97.5%", "07:00", "thirty-six") and plain words are
    compared as normalised words only, as before.

    An answer that is nothing but several different figures ("100000, 600100000, 65536") lists candidates:
    it is right only as a whole accepted answer ("1024:524288", "15-20"), or when every figure it lists is one
    (both IDs a question asks for: "65535, 4294967295")."""
    normalised = normalize_answer(answer)
    targets = [normalize_answer(text) for text in accepted if _names_whole(answer, text)]
    targets = [target for target in targets if target]
    words = normalised.split()
    if len(set(words)) > 1 and all(_NUMBER_WORD.fullmatch(word) for word in words):
        return normalised in targets or set(words) <= set(targets)
    return any(f" {target} " in f" {normalised} " for target in targets)
