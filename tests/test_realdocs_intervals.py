"""benchmarks/realdocs_intervals.py: bootstrap intervals over documents, on hand-made answers files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import realdocs_intervals
from benchmarks.realdocs_intervals import AnswersFileError, intervals, read_split


def record(doc: str, dependent: bool, **rows: bool) -> dict[str, Any]:
    """One question as `benchmarks.realdocs_quality.answer_records` writes it (only the fields read here)."""
    return {
        "doc": doc,
        "question": f"a question about {doc}",
        "dependent": dependent,
        "rows": {label: {"answer": "", "correct": correct} for label, correct in rows.items()},
    }


def write(tmp_path: Path, split: str, records: list[dict[str, Any]]) -> Path:
    path = tmp_path / f"realdocs-{split}-answers.json"
    path.write_text(json.dumps(records))
    return path


def varied_split(tmp_path: Path) -> Path:
    """Four documents of four dependent questions; `a` keeps 4, 3, 2, 1 of them, `b` the same, `c` all."""
    records = [
        record(f"doc{doc}", True, a=question < 4 - doc, b=question < 4 - doc, c=True)
        for doc in range(4)
        for question in range(4)
    ]
    records.append(record("doc0", False, a=False, b=True, c=True))  # not dependent: counts for no row
    return write(tmp_path, "test", records)


def test_shares_and_paired_differences_over_documents(tmp_path: Path) -> None:
    split = read_split(varied_split(tmp_path))
    assert split.name == "test" and split.rows == ("a", "b", "c")
    result = {row.label: row for row in intervals([split], "a", resamples=2000, seed=0)}
    assert (result["a"].kept, result["a"].dependent) == (10, 16)
    low, high = result["a"].interval
    assert low < 10 / 16 < high, "documents that differ make the share move"
    assert result["c"].interval == (1.0, 1.0), "a row that keeps everything keeps it on every resample"
    # A row that answers as the reference does differs by nothing on every resample, however wide its own interval.
    assert result["b"].interval == result["a"].interval
    assert result["b"].difference == 0.0 and result["b"].difference_interval == (0.0, 0.0)
    c_low, c_high = result["c"].difference_interval
    assert result["c"].difference == pytest.approx(6 / 16) and 0 < c_low < 6 / 16 < c_high


def test_documents_are_drawn_within_their_own_split(tmp_path: Path) -> None:
    # One document a split: drawn within the split, every resample is the two documents as they are; drawn from
    # the pool, some resamples would hold the same document twice.
    kept_all = write(tmp_path, "fresh", [record("lease", True, a=True) for _ in range(10)])
    kept_none = write(tmp_path, "fresh2", [record("manual", True, a=False) for _ in range(10)])
    [row] = intervals([read_split(kept_all), read_split(kept_none)], "a", resamples=500, seed=1)
    assert row.interval == (0.5, 0.5)


def test_a_seed_gives_the_same_intervals(tmp_path: Path) -> None:
    split = read_split(varied_split(tmp_path))
    first = intervals([split], "a", resamples=500, seed=3)
    assert intervals([split], "a", resamples=500, seed=3) == first


def test_the_command_prints_the_table_and_leaves_out_rows_a_split_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = write(tmp_path, "fresh", [record("sublease", True, a=True, b=False, d=True)])
    assert realdocs_intervals.main([str(varied_split(tmp_path)), str(other), "--resamples", "200"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("test, fresh: 5 documents, 17 document-dependent questions; 200 bootstrap resamples")
    assert "Rows not in every file, left out: c, d." in printed
    assert "| a | 11/17 | 64.7% |" in printed and "| b | 10/17 | 58.8% |" in printed
    assert "| c |" not in printed


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "cannot be read as JSON"),
        ("[]", "no questions"),
        (json.dumps([{"doc": "x"}]), "not an answers file"),
        (json.dumps([record("x", True)]), "no rows"),
        (json.dumps([record("x", True, a=True), record("x", True, b=True)]), "different rows"),
    ],
)
def test_a_file_that_is_no_answers_file_is_refused(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "realdocs-dev-answers.json"
    path.write_text(content)
    with pytest.raises(AnswersFileError, match=message):
        read_split(path)


def test_the_command_names_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = varied_split(tmp_path)
    assert realdocs_intervals.main([str(path), "--against", "z"]) == 2
    assert "--against 'z' is not a row of every file; rows: ['a', 'b', 'c']" in capsys.readouterr().err
    closed_book = write(tmp_path, "fresh", [record("x", False, a=True)])
    assert realdocs_intervals.main([str(closed_book)]) == 2
    assert "no document-dependent question" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        realdocs_intervals.main([str(path), str(path)])
    assert "a split given twice would count its documents twice" in capsys.readouterr().err
