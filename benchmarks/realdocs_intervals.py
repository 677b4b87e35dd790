"""How far the real-document figures could move with other documents: bootstrap intervals over documents.

    python -m benchmarks.realdocs_intervals benchmarks/results/realdocs-{test,fresh,fresh2,fresh3}-answers.json

Reads the per-question answers that `benchmarks.realdocs_quality` writes (`realdocs-<split>-answers.json`, one
file per split; this script answers nothing itself) and pools them, as the README's held-out column does. For
every row present in each file it prints the document-dependent answers kept, their share, and a 95% interval
for that share; beside the reference row (`--against`, by default the first row of the first file) the paired
difference in share points, with its own interval.

The intervals are a percentile bootstrap over documents, stratified by split: each resample draws every split's
documents with replacement (its own number of them) and pools their questions, so the questions of one document,
which stand or fall together, move together. The difference is taken on the same resample for both rows: it
measures how much of a gap between two rows the choice of documents could make, which is narrower than the two
intervals side by side. What it does not cover: the flips that any small change of the input brings (re-wrapped
text, another chunk boundary), questions written otherwise about the same documents, other models.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CONFIDENCE = 0.95


class AnswersFileError(ValueError):
    """An answers file that cannot be read as `benchmarks.realdocs_quality` writes it."""


@dataclass(frozen=True)
class DocumentCounts:
    """One document's document-dependent questions and how many of them each row kept."""

    dependent: int
    kept: dict[str, int]


@dataclass(frozen=True)
class Split:
    name: str
    documents: tuple[DocumentCounts, ...]
    rows: tuple[str, ...]
    """Row labels in the order the file gives them (the full and no-document references are not rows)."""


def read_split(path: Path) -> Split:
    """A split's per-document counts from its `realdocs-<split>-answers.json`; `AnswersFileError` when it is not one."""
    try:
        records = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AnswersFileError(f"{path}: cannot be read as JSON ({error})") from error
    if not isinstance(records, list) or not records:
        raise AnswersFileError(f"{path}: no questions (expected the list that benchmarks.realdocs_quality writes)")
    try:
        rows = tuple(records[0]["rows"])
        dependent: dict[str, int] = {}
        kept: dict[str, dict[str, int]] = {}
        for record in records:
            if tuple(record["rows"]) != rows:
                raise AnswersFileError(f"{path}: questions answered by different rows ({record['question']!r})")
            doc = record["doc"]
            dependent.setdefault(doc, 0)
            counts = kept.setdefault(doc, dict.fromkeys(rows, 0))
            if record["dependent"]:
                dependent[doc] += 1
                for label in rows:
                    counts[label] += bool(record["rows"][label]["correct"])
    except (KeyError, TypeError) as error:
        raise AnswersFileError(f"{path}: not an answers file of benchmarks.realdocs_quality ({error!r})") from error
    if not rows:
        raise AnswersFileError(f"{path}: no rows beside the full cache and the blank document")
    name = path.name.removeprefix("realdocs-").removesuffix("-answers.json")
    return Split(name, tuple(DocumentCounts(dependent[doc], kept[doc]) for doc in dependent), rows)


def common_rows(splits: Sequence[Split]) -> list[str]:
    """The rows every split has, in the first split's order."""
    return [label for label in splits[0].rows if all(label in split.rows for split in splits[1:])]


def resample_shares(splits: Sequence[Split], rows: Sequence[str], resamples: int, seed: int) -> list[dict[str, float]]:
    """`resamples` stratified bootstrap draws, each the pooled share of every row in `rows`; a draw with no dependent
    question at all (every drawn document closed-book) is drawn again."""
    rng = random.Random(seed)
    draws: list[dict[str, float]] = []
    while len(draws) < resamples:
        drawn = [document for split in splits for document in rng.choices(split.documents, k=len(split.documents))]
        total = sum(document.dependent for document in drawn)
        if total:
            draws.append({label: sum(document.kept[label] for document in drawn) / total for label in rows})
    return draws


def percentile_interval(values: Sequence[float]) -> tuple[float, float]:
    """The central `CONFIDENCE` interval of `values` (nearest-rank percentiles)."""
    ordered = sorted(values)
    tail = (1 - CONFIDENCE) / 2
    low = ordered[int(tail * (len(ordered) - 1))]
    high = ordered[round((1 - tail) * (len(ordered) - 1))]
    return low, high


@dataclass(frozen=True)
class RowInterval:
    label: str
    kept: int
    dependent: int
    interval: tuple[float, float]
    difference: float
    """Share minus the reference row's share, on the documents as they are."""
    difference_interval: tuple[float, float]


def intervals(splits: Sequence[Split], against: str, resamples: int, seed: int) -> list[RowInterval]:
    """Every common row's share and paired difference to `against`, with their bootstrap intervals."""
    rows = common_rows(splits)
    if against not in rows:
        raise AnswersFileError(f"--against {against!r} is not a row of every file; rows: {rows}")
    documents = [document for split in splits for document in split.documents]
    dependent = sum(document.dependent for document in documents)
    if not dependent:
        raise AnswersFileError("no document-dependent question in these files: there is no share to bound")
    draws = resample_shares(splits, rows, resamples, seed)
    reference_kept = sum(document.kept[against] for document in documents)
    result = []
    for label in rows:
        kept = sum(document.kept[label] for document in documents)
        result.append(
            RowInterval(
                label,
                kept,
                dependent,
                percentile_interval([draw[label] for draw in draws]),
                (kept - reference_kept) / dependent,
                percentile_interval([draw[label] - draw[against] for draw in draws]),
            )
        )
    return result


def table(rows: Sequence[RowInterval], against: str) -> str:
    interval = f"{CONFIDENCE:.0%} interval"
    lines = [
        f"| row | dependent kept | share | {interval} | − `{against}` (points) | {interval} |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        low, high = row.interval
        d_low, d_high = row.difference_interval
        lines.append(
            f"| {row.label} | {row.kept}/{row.dependent} | {row.kept / row.dependent:.1%} | {low:.1%} to {high:.1%} "
            f"| {100 * row.difference:+.1f} | {100 * d_low:+.1f} to {100 * d_high:+.1f} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realdocs_intervals",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("answers", nargs="+", type=Path, help="realdocs-<split>-answers.json files, one per split")
    parser.add_argument("--against", help="the reference row of the differences (default: the first row)")
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.resamples < 100:
        parser.error("--resamples must be at least 100")
    names = [path.name for path in args.answers]
    if len(set(names)) != len(names):
        parser.error("a split given twice would count its documents twice")
    return args


def run(args: argparse.Namespace) -> str:
    splits = [read_split(path) for path in args.answers]
    against = args.against or splits[0].rows[0]
    result = intervals(splits, against, args.resamples, args.seed)
    documents = sum(len(split.documents) for split in splits)
    names = ", ".join(split.name for split in splits)
    skipped = sorted({label for split in splits for label in split.rows} - set(common_rows(splits)))
    header = (
        f"{names}: {documents} documents, {result[0].dependent} document-dependent questions; {args.resamples} "
        f"bootstrap resamples over documents, stratified by split (seed {args.seed})."
    )
    if skipped:
        header += f" Rows not in every file, left out: {', '.join(skipped)}."
    return f"{header}\n\n{table(result, against)}\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        print(run(args))
    except AnswersFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
