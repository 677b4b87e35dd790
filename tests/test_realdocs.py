"""The real-document corpus (benchmarks/realdocs): its manifest is well formed and its committed texts
hold every question's answer. Reads JSON and text only: no model, no network, no PDF rendering."""

from __future__ import annotations

import json
import random
import string
from collections import Counter
from typing import Any

import pytest

from benchmarks.realdocs import (
    KINDS,
    QUESTIONS_FILE,
    SPLITS,
    document_text,
    load_realdocs,
)
from infokv_rag.evaluation import answer_matches, normalize_answer

MANIFEST: list[dict[str, Any]] = json.loads(QUESTIONS_FILE.read_text(encoding="utf-8"))["documents"]
COMMITTED = [entry for entry in MANIFEST if "file" in entry["source"]]


def test_manifest_is_well_formed() -> None:
    ids = [entry["id"] for entry in MANIFEST]
    assert len(ids) == len(set(ids)), f"repeated document ids: {[i for i, n in Counter(ids).items() if n > 1]}"
    for entry in MANIFEST:
        assert entry["split"] in SPLITS and entry["kind"] in KINDS, entry["id"]
        assert entry["title"].strip() and entry["questions"], entry["id"]
        assert ("file" in entry["source"]) != ("pypi" in entry["source"]), f"{entry['id']}: one source"
        questions = [q["question"] for q in entry["questions"]]
        assert len(questions) == len(set(questions)), f"{entry['id']}: a question is repeated"
        for question in entry["questions"]:
            assert question["question"].strip(), entry["id"]
            answers = question["answers"]
            assert answers and all(normalize_answer(a) for a in answers), (entry["id"], question["question"])


def test_split_is_fixed() -> None:
    """The held-out set is what results are reported on: moving a document between splits is a decision."""
    documents = Counter(entry["split"] for entry in MANIFEST)
    questions: Counter[str] = Counter()
    for entry in MANIFEST:
        questions[entry["split"]] += len(entry["questions"])
    assert (documents["dev"], questions["dev"]) == (9, 87)
    assert (documents["test"], questions["test"]) == (7, 68)
    assert (documents["fresh"], questions["fresh"]) == (4, 36)
    assert (documents["fresh2"], questions["fresh2"]) == (6, 60)
    assert (documents["fresh3"], questions["fresh3"]) == (6, 60)
    assert (documents["dev2"], questions["dev2"]) == (6, 60)
    assert set(documents) == set(SPLITS)


@pytest.mark.parametrize(
    ("answer", "accepted", "right"),
    [
        ("The rent is USD 6,385.00.", "6,385", True),
        ("$265.00 per pass", "265", True),
        ("See RFC2373.", "RFC 2373", True),
        ("Build-Depends-Arch needs dpkg v1.16.4", "1.16.4", True),
        ("It is 31%.", "31 percent", True),
        ("Pin-Priority: -10", "-10", True),
        # A part of another number is no answer: a decimal, a version, a sign, a longer number.
        ("0.5 days", "5 days", False),
        ("10.5 days", "5 days", False),
        ("version 1.21.3", "3", False),
        ("Pin-Priority: -10", "10", False),
        ("The nice level is \u221210.", "10", False),  # a minus sign (U+2212), as "-"
        ("The nice level is \u201310.", "-10", True),  # an en dash before a figure
        ("about 2373.5", "2373", False),
        ("14000 cases", "1400", False),
        ("either party may terminate as set out in Section 5.3.", "53", False),
        # Whole words: the planted facts' "AS IS" is not in "basis".
        ("The Licensor provides the Work on a royalty-free basis.", "AS IS", False),
        ('The Work is provided on an "AS IS" basis.', "AS IS", True),
        # A cents figure's trailing zero is no part of its value; a version's stays.
        ("USD 2.5 per pound", "2.50", True),
        ("6,482,915.4", "6,482,915.40", True),
        ("dpkg 1.2.1", "1.20.1", False),
        # Nothing but candidates is no answer; a range or ratio that is the answer is one.
        ("100000, 600100000, 65536", "65536", False),
        ("1024:524288", "1024:524288", True),
        ("10000 messages in 30s.", "10000", True),
    ],
)
def test_the_checker_takes_a_number_whole(answer: str, accepted: str, right: bool) -> None:
    assert answer_matches(answer, [accepted]) is right


@pytest.mark.parametrize(
    ("answer", "accepted", "right"),
    [
        # Cached answers the normalised words took for right (review of 2026-12-06): the unit name's escaping, and
        # a description of the field instead of its name.
        ("/home/lennart.mount", "home-lennart.mount", False),
        ("It must be named home-lennart.mount.", "home-lennart.mount", True),
        ("The %A specifier reads the operating system image version identifier.", "IMAGE_VERSION", False),
        ("It reads IMAGE_VERSION= from /etc/os-release.", "IMAGE_VERSION=", True),
        ("Devices with the power switch tag", "power-switch", False),
        ("Devices tagged power-switch", "power-switch", True),
        ("initrd fs target", "initrd-fs.target", False),
        ("Before=initrd-fs.target", "initrd-fs.target", True),
        ("workstation tcp", "_workstation._tcp", False),
        ("The service type is `_workstation._tcp`.", "_workstation._tcp", True),
        ("Multi Arch: allowed", "Multi-Arch: allowed", False),
        ("multi-arch: allowed", "Multi-Arch: allowed", True),
        # A format's case is its meaning: "%y" is a two-digit year.
        ("%y%m%d", "%Y%m%d", False),
        ("It is %Y%m%d.", "%Y%m%d", True),
        # Whole words: another path that ends in it is not it; a name joined to it by punctuation holds it, as the
        # normalised words do.
        ("/var/run/food.pid", "/run/food.pid", False),
        ("debian.lcs.mit.edu_debian_dists_unstable_Release", "debian.lcs.mit.edu", True),
    ],
)
def test_an_identifier_is_right_only_with_its_punctuation(answer: str, accepted: str, right: bool) -> None:
    assert answer_matches(answer, [accepted]) is right


@pytest.mark.parametrize(
    ("answer", "accepted"),
    [
        ("1400 cases", "1,400"),
        ("97.5 percent", "97.5%"),
        ("It opens at 07 00.", "07:00"),
        ("USD 1400", "$1,400.00"),
        ("at 5 p. m.", "5 p.m."),
        ("17 U. S. C.", "17 U.S.C."),
        ("thirty six hours", "thirty-six hours"),
        ("Superior Wisconsin", "Superior, Wisconsin"),
    ],
)
def test_numbers_and_words_keep_the_normalised_words(answer: str, accepted: str) -> None:
    """A figure, a time, an abbreviation or a number in words is no identifier: punctuation still does not count."""
    assert answer_matches(answer, [accepted])


def test_a_list_of_figures_is_right_when_every_one_is_accepted() -> None:
    """Both IDs a question asks for are one answer; one candidate among figures that are not accepted is none."""
    accepted = ["65535", "4294967295"]
    assert answer_matches("65535, 4294967295", accepted) and answer_matches("65535", accepted)
    assert not answer_matches("65535, 100000", accepted)


def test_unicode_normalisation_leaves_ascii_text_as_it_was() -> None:
    """`normalize_answer(..., unicode=True)` (what citations match in any script) normalises ASCII text exactly as
    the checker's default does, which is pinned here: no verdict on English text moves."""
    pinned = {
        "RFC2373": "rfc 2373",
        "0.5 days": "0p5 days",
        "dpkg 1.20.1": "dpkg 1p20p1",
        "Pin-Priority: -10": "pin priority minus10",
        "USD 7,400.00": "usd 7400",
        "USD 2.50": "usd 2p5",
        "It's 31%!": "it s 31 percent",
        "snake_case x-ray": "snake case x ray",
    }
    for text, expected in pinned.items():
        assert normalize_answer(text) == normalize_answer(text, unicode=True) == expected
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits * 3 + ".,-%_ " * 3 + string.punctuation + string.whitespace
    samples = ["".join(rng.choices(alphabet, k=60)) for _ in range(3000)]
    samples += [q["question"] for entry in MANIFEST for q in entry["questions"]]
    samples += [answer for entry in MANIFEST for q in entry["questions"] for answer in q["answers"]]
    samples += [text for text in map(document_text, (entry["id"] for entry in COMMITTED)) if text.isascii()]
    for text in filter(str.isascii, samples):
        assert normalize_answer(text, unicode=True) == normalize_answer(text), text


@pytest.mark.parametrize("entry", COMMITTED, ids=[entry["id"] for entry in COMMITTED])
def test_committed_text_holds_every_answer(entry: dict[str, Any]) -> None:
    text = document_text(entry["id"])
    missing = [q["question"] for q in entry["questions"] if not answer_matches(text, q["answers"])]
    assert not missing, f"{entry['id']}: no accepted answer in the text for {missing}"


def test_load_realdocs_selects_documents_by_id(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="no document nosuch in the dev split"):
        load_realdocs("dev", cache_dir=tmp_path, doc_ids=["nosuch"])
    test_only = next(entry["id"] for entry in MANIFEST if entry["split"] == "test")
    with pytest.raises(ValueError, match=test_only):
        load_realdocs("dev", cache_dir=tmp_path, doc_ids=[test_only])
    fresh_only = next(entry["id"] for entry in MANIFEST if entry["split"] == "fresh")
    with pytest.raises(ValueError, match=f"no document {fresh_only} in the test split"):
        load_realdocs("test", cache_dir=tmp_path, doc_ids=[fresh_only])


def test_the_citations_benchmark_finds_the_page_of_each_answer(tmp_path: Any) -> None:
    """`python -m benchmarks.citations` on one committed document, through its rendered PDF: every accepted answer
    is cited first as written, and in a sentence the page holding it still comes first."""
    from benchmarks.citations import evaluate, table

    documents = load_realdocs("dev", cache_dir=tmp_path, doc_ids=["mnda-quillfeather-marrowgate"])
    counts = evaluate(documents)
    written, sentence = counts["as written"], counts["in a sentence"]
    assert written["answers"] >= 8 and written["first"] == written["answers"] and written["right"] == written["cited"]
    assert sentence["first"] == sentence["answers"] and sentence["none"] == 0
    assert table(counts).splitlines()[2].startswith(f"| as written | {written['answers']} | 1.000 |")
