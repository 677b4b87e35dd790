"""Quality of compressed caches on real documents: contracts and manuals, natural questions (issue 12).

Every row reads each document the way the product does: `load_document` on the rendered PDF, then
`engine.ingest_document(document, CompressionConfig(...))` (chunked ingestion as shipped), then answers
every question from that one compressed cache, greedily (the path of `CompressedDocument.ask`). Two
reference rows: `full` (the uncompressed cache) and `no document` (the same questions against a blank
document: what the model answers closed-book).

A question is document-dependent when the full cache answers it right and the blank document does not.
Per row: the share of the document-dependent questions it still answers (overall and per kind), accuracy
over all questions, exact agreement with the full cache's answer (same text), agreement of the verdict
(right or wrong as the full cache's answer is), mean KL(full || row) of next-token
distributions teacher-forced on the full cache's answer, cache bytes and ingestion seconds relative to
`full` (with the time split from `doc.stats`). `kvpress:PRESS@KEEP` rows are NVIDIA kvpress's presses on
the same prompt token ids and questions (benchmarks/kvpress_peer.py in `.venv-kvpress`; their KL is against
kvpress's own uncompressed cache, `kvpress:none`, a sanity row that should agree with `full`; no bytes or
times: KVzipPress masks keys instead of dropping them). A row with `stored_bits=4` or `8` holds its cache in codes
of that width (`CompressionConfig.stored_bits`), its bytes those of the codes.

Results are cached on disk per (model fingerprint, document sha256 and text, row's resolved config,
max_new_tokens), one entry per question, so iterating on one method recomputes only that method's rows:
`$INFOKV_CACHE_DIR/bench/realdocs` (default ~/.cache/infokv-rag/bench/realdocs). The key holds the
config, not the code: after changing a method's code, recompute its rows with `--fresh ROW ...`. A row answered by
other code (`code_digest`; the kvpress rows: `peer_digest`), or whose KL was teacher-forced on another full answer
than the full row's now, is reused and reported as answered by other code.

    python -m benchmarks.realdocs_quality --split test                      # the reported run
    python -m benchmarks.realdocs_quality --split dev --rows infokv@0.25 'infokv@0.25[tau=0.5]' --no-kvpress
    python -m benchmarks.realdocs_quality --split dev --rows 'infokv@1.0[stored_bits=4]' --no-kvpress
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import Tensor

import infokv_rag
import infokv_rag.kernels
from benchmarks import quality, variants
from benchmarks.quality import KVPRESS_PRESSES, FullAnswer, Task, kvpress_job, mean_kl, progress, run_kvpress_peer
from benchmarks.realdocs import KINDS, SPLITS, RealDoc, load_realdocs
from benchmarks.variants import teacher_forced_logits
from infokv_rag import CompressedDocument, CompressionConfig, ConfigError, InfoKVEngine
from infokv_rag.documents import Document, load_document
from infokv_rag.evaluation import BLANK_DOCUMENT, answer_matches
from infokv_rag.generation import Generation, GenerationOptions
from infokv_rag.models import cache_root
from infokv_rag.placement import DTYPES, dtype_name
from infokv_rag.prompt import question_turns
from infokv_rag.scorers import method_names

ROOT = Path(__file__).resolve().parent.parent
FULL = "full"
NO_DOCUMENT = "no document"
KVPRESS = "kvpress:"
DEFAULT_ROWS = (
    "infokv@0.25",
    "infokv@0.5",
    "infokv_quality@0.25",
    "infokv_quality@0.5",
    "kvzip@0.25",
    "kvzip@0.5",
    "snapkv@0.25",
    "tova@0.25",
    "knorm@0.25",
    "streaming_llm@0.25",
)
DEFAULT_PRESSES = ("kvzip", "snapkv")
CACHE_VERSION = 1
"""Bump when what a cached entry means changes (prompt, decoding, KL definition)."""
SHARED_FIELDS = tuple(
    f.name for f in dataclasses.fields(CompressionConfig) if f.name not in ("method", "keep", "settings")
)
"""CompressionConfig fields a row spec may set beside the method's own settings."""
_ROW_SPEC = re.compile(r"(?P<method>\w+)@(?P<keep>[^\[\]@]+)(?:\[(?P<settings>[^\[\]]*)\])?")


# --- rows ---------------------------------------------------------------------------------------------


class RowSpecError(ValueError):
    """A `--rows` spec that does not parse or names a method or setting that does not exist."""


@dataclass(frozen=True)
class EngineRow:
    """A row the engine computes: one CompressionConfig, on the document or on the blank one."""

    label: str
    config: CompressionConfig
    blank: bool = False

    def identity(self) -> dict[str, Any]:
        config = self.config.to_dict()
        identity: dict[str, Any] = {"config": config, "document": "blank" if self.blank else "own"}
        # Beside the config, where it was when rows simulated the codes (the twenty-eighth session), so that
        # their records stay valid: the product's codes answer the same (`tests/test_coded_cache.py`).
        if "stored_bits" in config:
            identity["stored_bits"] = config.pop("stored_bits")
        return identity


@dataclass(frozen=True)
class PeerRow:
    """A row kvpress computes: one press at one keep ratio."""

    press: str
    keep: float

    @property
    def label(self) -> str:
        return f"{KVPRESS}none" if self.press == "none" else f"{KVPRESS}{self.press}@{self.keep}"

    def identity(self) -> dict[str, Any]:
        return {"kvpress": self.press, "keep": self.keep}


FULL_ROW = EngineRow(FULL, CompressionConfig(method="full"))
NO_DOCUMENT_ROW = EngineRow(NO_DOCUMENT, CompressionConfig(method="full"), blank=True)


def parse_value(text: str) -> Any:
    """JSON when it parses (0.5, 3, true, null, "x"), else the string itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_row(spec: str) -> EngineRow:
    """`METHOD@KEEP` or `METHOD@KEEP[key=value,...]` -> a validated row.

    KEEP is a ratio (0.25) or a token count (512). A key is one of the method's settings or a shared
    CompressionConfig field (window, chunk_size, adaptive_budget, stored_bits, ...); values are parsed as JSON
    when they parse, else taken as strings (so `information=entropy` and `tau=0.5` both work).
    """
    label = spec.strip()
    match = _ROW_SPEC.fullmatch(label)
    if match is None:
        raise RowSpecError(
            f"row {spec!r}: expected METHOD@KEEP or METHOD@KEEP[key=value,...], e.g. infokv@0.25[tau=0.5]"
        )
    method = match["method"]
    if method not in method_names():
        raise RowSpecError(f"row {spec!r}: unknown method {method!r}; methods: {', '.join(method_names())}")
    if method == FULL:
        raise RowSpecError(f"row {spec!r}: the {FULL!r} and {NO_DOCUMENT!r} rows are always run")
    shared: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    for item in (match["settings"] or "").split(","):
        if not item.strip():
            continue
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key:
            raise RowSpecError(f"row {spec!r}: setting {item.strip()!r} is not key=value")
        if key in shared or key in settings:
            raise RowSpecError(f"row {spec!r}: setting {key!r} is given twice")
        (shared if key in SHARED_FIELDS else settings)[key] = parse_value(value)
    try:
        config = CompressionConfig(method=method, keep=parse_value(match["keep"]), settings=settings, **shared)
    except (ConfigError, TypeError, ValueError) as error:
        raise RowSpecError(f"row {spec!r}: {error}") from error
    return EngineRow(label, config)


def parse_rows(specs: Sequence[str]) -> list[EngineRow]:
    rows = [parse_row(spec) for spec in specs]
    labels = [row.label for row in rows]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise RowSpecError(f"rows given more than once: {', '.join(repeated)}")
    return rows


def default_rows() -> list[str]:
    """DEFAULT_ROWS whose method is registered today."""
    return [spec for spec in DEFAULT_ROWS if spec.partition("@")[0] in method_names()]


def peer_rows(presses: Sequence[str], rows: Sequence[EngineRow]) -> list[PeerRow]:
    """kvpress:none, then each press at each keep ratio (< 1) of the engine rows."""
    keeps = sorted({row.config.keep for row in rows if isinstance(row.config.keep, float) and row.config.keep < 1})
    return [PeerRow("none", 1.0), *(PeerRow(press, keep) for keep in keeps for press in presses)]


# --- metrics --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuestionResult:
    """One question's answers from every row (labels FULL and NO_DOCUMENT included)."""

    doc_id: str
    kind: str
    question: str
    expected: tuple[str, ...]
    answers: dict[str, str]
    kl: dict[str, float] = field(default_factory=dict)

    def correct(self, label: str) -> bool:
        return answer_matches(self.answers[label], self.expected)

    @property
    def dependent(self) -> bool:
        """The full cache answers it and the blank document does not: the answer needs the document."""
        return self.correct(FULL) and not self.correct(NO_DOCUMENT)

    def agrees(self, label: str) -> bool:
        return self.answers[label].strip() == self.answers[FULL].strip()


@dataclass(frozen=True)
class Ingest:
    """One row's ingestion of one document, beside the full cache's of the same document.

    `full_seconds` is the full cache's ingestion measured in the run that measured `seconds`.
    """

    seconds: float
    full_seconds: float
    cache_bytes: int
    full_cache_bytes: int
    split: dict[str, float]
    """Seconds by stage, from the `*_seconds` fields of `doc.stats` (prefill, scoring, compression, ...)."""

    @classmethod
    def from_records(cls, record: dict[str, Any], full: dict[str, Any]) -> Ingest:
        """From the `ingest` records of the row and of the full cache (the blank row's own full size is not it)."""
        stats = record["stats"]
        split = {name.removesuffix("_seconds"): value for name, value in stats.items() if name.endswith("_seconds")}
        full_bytes = full["stats"]["cache_bytes"]
        return cls(record["seconds"], record["full_seconds"], stats["cache_bytes"], full_bytes, split)


def share(kept: int, total: int) -> float | None:
    return kept / total if total else None


def row_metrics(label: str, results: Sequence[QuestionResult], ingests: Sequence[Ingest] = ()) -> dict[str, Any]:
    """Every reported number of one row; ratios are sums over documents (bytes: token-weighted)."""
    dependent = [r for r in results if r.dependent]
    by_kind = {}
    for kind in sorted({r.kind for r in results}):
        of_kind = [r for r in dependent if r.kind == kind]
        kept = sum(r.correct(label) for r in of_kind)
        by_kind[kind] = {"dependent": len(of_kind), "kept": kept, "share": share(kept, len(of_kind))}
    kept = sum(r.correct(label) for r in dependent)
    correct = sum(r.correct(label) for r in results)
    metrics: dict[str, Any] = {
        "questions": len(results),
        "correct": correct,
        "accuracy": share(correct, len(results)),
        "dependent": len(dependent),
        "kept": kept,
        "share": share(kept, len(dependent)),
        "by_kind": by_kind,
        "agreement": share(sum(r.agrees(label) for r in results), len(results)),
        "verdict_agreement": share(sum(r.correct(label) == r.correct(FULL) for r in results), len(results)),
        "kl": sum(r.kl.get(label, 0.0) for r in results) / len(results) if results else None,
    }
    if ingests:
        metrics["bytes_ratio"] = sum(i.cache_bytes for i in ingests) / sum(i.full_cache_bytes for i in ingests)
        metrics["ingest_seconds"] = sum(i.seconds for i in ingests)
        metrics["full_ingest_seconds"] = sum(i.full_seconds for i in ingests)
        metrics["ingest_ratio"] = metrics["ingest_seconds"] / metrics["full_ingest_seconds"]
        metrics["ingest_split"] = {stage: sum(i.split.get(stage, 0.0) for i in ingests) for stage in ingests[0].split}
    return metrics


def _count(kept: int, total: int) -> str:
    return f"{kept}/{total} ({kept / total:.0%})" if total else "-"


def table(metrics: dict[str, dict[str, Any]]) -> str:
    """The markdown table: one line per row, in the order given."""
    lines = [
        "| row | questions | accuracy | document-dependent kept | "
        + " | ".join(KINDS)
        + " | same answer as full | same verdict as full | KL(full‖row) | bytes × full | ingest × full (split, s) |",
        "|---|---|---|---|" + "---|" * len(KINDS) + "---|---|---|---|---|",
    ]
    for label, m in metrics.items():
        kinds = [
            _count(m["by_kind"][k]["kept"], m["by_kind"][k]["dependent"]) if k in m["by_kind"] else "-" for k in KINDS
        ]
        ingest, size = "-", "-"
        if "ingest_ratio" in m:
            size = f"{m['bytes_ratio']:.3f}"
            split = " / ".join(f"{stage} {seconds:.1f}" for stage, seconds in m["ingest_split"].items())
            ingest = f"{m['ingest_ratio']:.2f} ({split})"
        lines.append(
            f"| {label} | {m['questions']} | {m['accuracy']:.3f} | {_count(m['kept'], m['dependent'])} | "
            + " | ".join(kinds)
            + f" | {m['agreement']:.3f} | {m['verdict_agreement']:.3f} | {m['kl']:.3f} | {size} | {ingest} |"
        )
    return "\n".join(lines)


def summary_line(results: Sequence[QuestionResult], documents: int) -> str:
    full = sum(r.correct(FULL) for r in results)
    blank = sum(r.correct(NO_DOCUMENT) for r in results)
    dependent = [r for r in results if r.dependent]
    kinds = ", ".join(f"{kind} {sum(r.kind == kind for r in dependent)}" for kind in KINDS)
    return (
        f"{len(results)} questions over {documents} documents; the full cache answers {full}, a blank document "
        f"{blank}; document-dependent: {len(dependent)} ({kinds})."
    )


# --- the disk cache ------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    return cache_root() / "bench" / "realdocs"


def reference_digest(ids: Sequence[int]) -> str:
    """The full cache's answer ids that a row's KL is teacher-forced on, digested: stored with each KL, since the
    full row can be recomputed (`--fresh full`) after the row, leaving that KL measured on another answer."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def peer_digest(python: Path) -> str:
    """A digest of the code that answers the kvpress rows: `code_digest()` (the prompts and the job), the peer
    (benchmarks/kvpress_peer.py) and the versions of kvpress, transformers and torch in its environment."""
    versions = subprocess.run(
        [str(python), str(ROOT / "benchmarks/kvpress_peer.py"), "--versions"], capture_output=True, text=True
    )
    if versions.returncode:
        raise SystemExit(f"the kvpress peer could not report its versions: {versions.stderr.strip()}")
    digest = hashlib.sha256(code_digest().encode() + versions.stdout.encode())
    digest.update((ROOT / "benchmarks/kvpress_peer.py").read_bytes())
    return digest.hexdigest()[:16]


def code_digest() -> str:
    """A digest of the code that answers: the installed `infokv_rag` package (sources and shipped data such as
    the surrogates), its kernels (installed from another directory), this module and the benchmark modules it
    measures with (`benchmarks.quality`: the KL and the kvpress job; `benchmarks.variants`: teacher-forced
    logits), and the versions of torch and transformers.

    It is stamped on every cached record but kept out of the key: a change anywhere in the package would
    otherwise recompute hours of unrelated rows. A row answered by other code is reported instead."""
    digest = hashlib.sha256(f"torch {torch.__version__} transformers {transformers.__version__}".encode())
    for package in (Path(infokv_rag.__file__).parent, Path(infokv_rag.kernels.__file__).parent):
        files = (p for p in package.rglob("*") if p.is_file() and p.suffix in {".py", ".safetensors", ".json"})
        for path in sorted(files):
            digest.update(path.relative_to(package.parent).as_posix().encode() + b"\0" + path.read_bytes())
    for module in (Path(__file__), Path(quality.__file__), Path(variants.__file__)):
        digest.update(module.read_bytes())
    return digest.hexdigest()[:16]


class ResultCache:
    """JSON records keyed by everything their results depend on; `fresh(label)` makes a row's records unseen."""

    def __init__(self, directory: Path, fresh: Callable[[str], bool]) -> None:
        self.directory = directory
        self.fresh = fresh

    def _path(self, key: dict[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.directory / f"{digest[:32]}.json"

    def load(self, key: dict[str, Any], label: str) -> dict[str, Any]:
        path = self._path(key)
        if self.fresh(label) or not path.is_file():
            return {"key": key, "questions": {}}
        record: dict[str, Any] = json.loads(path.read_text())
        return record if record.get("key") == key else {"key": key, "questions": {}}

    def save(self, record: dict[str, Any]) -> None:
        path = self._path(record["key"])
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "w") as out:
            json.dump(record, out)
        os.replace(temporary, path)


# --- running --------------------------------------------------------------------------------------------


def answer(document: CompressedDocument, question: str, max_new_tokens: int) -> Generation:
    """Greedy answer: what `document.ask(question, max_new_tokens=...)` returns, with its token ids."""
    return document.generate(question_turns(question), GenerationOptions(max_new_tokens=max_new_tokens))


@dataclass
class DocumentResult:
    """One document's questions and its records (label -> cached JSON record)."""

    doc: RealDoc
    document: Document
    questions: tuple[tuple[str, tuple[str, ...]], ...]
    records: dict[str, dict[str, Any]] = field(default_factory=dict)

    def results(self) -> list[QuestionResult]:
        return [
            QuestionResult(
                self.doc.doc_id,
                self.doc.kind,
                question,
                expected,
                {label: record["questions"][question]["answer"] for label, record in self.records.items()},
                {label: record["questions"][question]["kl"] for label, record in self.records.items()},
            )
            for question, expected in self.questions
        ]

    def full_ids(self, question: str) -> list[int]:
        """The full cache's answer to `question`, token ids: what KL is teacher-forced on."""
        ids: list[int] = self.records[FULL]["questions"][question]["ids"]
        return ids

    def missing(self, label: str) -> list[str]:
        return [q for q, _ in self.questions if q not in self.records[label]["questions"]]

    def other_reference(self, label: str) -> bool:
        """Whether any of the row's cached KL was teacher-forced on another answer than the full record's now (or
        on one not recorded, as before the answers' digests were stored)."""
        cached = self.records[label]["questions"]
        return any(
            cached[q].get("reference") != reference_digest(self.full_ids(q)) for q, _ in self.questions if q in cached
        )


class Bench:
    """The engine, the cache and the run's options; `run_document` fills a document's engine rows."""

    def __init__(self, engine: InfoKVEngine, cache: ResultCache, max_new_tokens: int) -> None:
        self.engine = engine
        self.cache = cache
        self.max_new_tokens = max_new_tokens
        self.started = time.perf_counter()
        self._warm = False
        self.code = code_digest()
        self.other_code: set[str] = set()
        """Rows with answers (some or all) cached by other code than this checkout's."""

    def elapsed(self) -> str:
        return f"{time.perf_counter() - self.started:.0f}s"

    def key(self, document: Document, identity: dict[str, Any]) -> dict[str, Any]:
        # A float32 CPU run's key names neither dtype nor device, as before `--dtype` existed and GPU runs were
        # made, so that its cached results stay valid.
        dtype, device = self.engine.runner.dtype, self.engine.runner.device
        return {
            "benchmark": "realdocs",
            "version": CACHE_VERSION,
            "model": self.engine.fingerprint,
            **({} if dtype == torch.float32 else {"dtype": str(dtype).removeprefix("torch.")}),
            **({} if device.type == "cpu" else {"device": device.type}),
            "document": document.sha256,
            # The file's bytes do not say how they read: a change to how documents are read is another input.
            "text": hashlib.sha256(document.text.encode()).hexdigest()[:16],
            "max_new_tokens": self.max_new_tokens,
            "row": identity,
        }

    def ingest(self, document: Document, config: CompressionConfig) -> tuple[CompressedDocument, float]:
        """The product's ingestion, timed; the first call of a run warms up first (one-time costs untimed)."""
        if not self._warm:
            self.engine.ingest_document(BLANK_DOCUMENT, FULL_ROW.config)
            self._warm = True
        clock = time.perf_counter()
        compressed = self.engine.ingest_document(document, config)
        return compressed, time.perf_counter() - clock

    def run_document(self, result: DocumentResult, rows: Sequence[EngineRow]) -> None:
        """Loads each row's record, computes the questions it lacks, saves it. Full first: every KL's reference."""
        full: tuple[CompressedDocument, float] | None = None
        references: dict[str, Tensor] = {}
        # Rows that differ only in their recall budget read the document into the same cache: read it once.
        ingested: dict[str, tuple[CompressedDocument, float]] = {}

        def full_document() -> tuple[CompressedDocument, float]:
            nonlocal full
            if full is None:
                full = self.ingest(result.document, FULL_ROW.config)
            return full

        def reference(question: str) -> Tensor:
            if question not in references:
                references[question] = teacher_forced_logits(
                    full_document()[0], question_turns(question), result.full_ids(question)
                )
            return references[question]

        for row in [FULL_ROW, NO_DOCUMENT_ROW, *rows]:
            record = result.records[row.label] = self.cache.load(self.key(result.document, row.identity()), row.label)
            missing = result.missing(row.label)
            stale = bool(record["questions"]) and (
                record.get("code") != self.code or (row is not FULL_ROW and result.other_reference(row.label))
            )
            if stale:
                self.other_code.add(row.label)
            if not missing:
                note = f", by other code: --fresh '{row.label}' recomputes" if stale else ""
                progress(f"  {row.label}: cached ({self.elapsed()}{note})")
                continue
            full_seconds = full_document()[1]
            if row is FULL_ROW:
                compressed, seconds = full_document()
            else:
                identity = json.dumps([row.blank, row.config.cache_identity()], sort_keys=True)
                if identity not in ingested:
                    ingested[identity] = self.ingest(BLANK_DOCUMENT if row.blank else result.document, row.config)
                compressed, seconds = ingested[identity]
                compressed = dataclasses.replace(compressed, config=row.config)
            clock = time.perf_counter()
            for question in missing:
                generation = answer(compressed, question, self.max_new_tokens)
                entry: dict[str, Any] = {"answer": generation.text(), "ids": list(generation.token_ids), "kl": 0.0}
                if row is not FULL_ROW:
                    logits = teacher_forced_logits(compressed, question_turns(question), result.full_ids(question))
                    entry["kl"] = mean_kl(reference(question), logits)
                    entry["reference"] = reference_digest(result.full_ids(question))
                record["questions"][question] = entry
            record["ingest"] = {"seconds": seconds, "full_seconds": full_seconds, "stats": compressed.stats.to_dict()}
            record["code"] = "mixed" if stale else self.code
            self.cache.save(record)
            progress(
                f"  {row.label}: ingested in {seconds:.1f}s, {len(missing)} answers in "
                f"{time.perf_counter() - clock:.1f}s ({self.elapsed()})"
            )


def run_peer(
    bench: Bench, results: Sequence[DocumentResult], rows: Sequence[PeerRow], python: Path, stem: Path
) -> None:
    """Fills the kvpress rows: the documents with any question missing go to the peer in one job, which answers
    all of their rows anew; a document's cached rows by other code or on another full answer are reported."""
    code = peer_digest(python)
    for result in results:
        for row in rows:
            result.records[row.label] = bench.cache.load(bench.key(result.document, row.identity()), row.label)
    pending = [result for result in results if any(result.missing(row.label) for row in rows)]
    for result in results:
        if result not in pending:
            for row in rows:
                if result.records[row.label].get("code") != code or result.other_reference(row.label):
                    bench.other_code.add(row.label)
    if not pending:
        progress(f"kvpress peer: every row cached ({bench.elapsed()})")
        return
    presses = list(dict.fromkeys(row.press for row in rows if row.press != "none"))
    keeps = sorted({row.keep for row in rows if row.press != "none"})
    tasks = [Task(result.doc.doc_id, result.document, result.questions) for result in pending]
    full_answers = [
        [
            FullAnswer(result.records[FULL]["questions"][q]["answer"], tuple(result.full_ids(q)))
            for q, _ in result.questions
        ]
        for result in pending
    ]
    # The job answers only the questions asked (`--questions N`): a record's other answers by another peer stay.
    stale = {
        (result.doc.doc_id, row.label)
        for result in pending
        for row in rows
        if result.records[row.label].get("code") != code
        and set(result.records[row.label]["questions"]) - {question for question, _ in result.questions}
    }
    progress(f"kvpress peer: {len(pending)} documents, presses {presses} at keeps {keeps} ({bench.elapsed()})")
    job = kvpress_job(bench.engine, tasks, full_answers, presses, keeps, bench.max_new_tokens)
    peer: dict[str, Any] = run_kvpress_peer(python, job, stem)
    by_id = {result.doc.doc_id: result for result in pending}
    for output in peer["rows"]:
        result = by_id[output["document"]]
        question = result.questions[output["question"]][0]
        text = bench.engine.tokenizer.decode(output["ids"], skip_special_tokens=True)
        label = PeerRow(output["press"], output["keep"]).label
        result.records[label]["questions"][question] = {
            "answer": text,
            "ids": output["ids"],
            "kl": output["kl"],
            "reference": reference_digest(result.full_ids(question)),
        }
    timings = {timing["document"]: timing for timing in peer["timings"]}
    for result in pending:
        for row in rows:
            record = result.records[row.label]
            record["peer"] = {"versions": peer["versions"], "timing": timings[result.doc.doc_id]}
            if (result.doc.doc_id, row.label) in stale:
                record["code"] = "mixed"
                bench.other_code.add(row.label)
            else:
                record["code"] = code
            bench.cache.save(record)


# --- reporting ------------------------------------------------------------------------------------------


def metrics_of(results: Sequence[DocumentResult], labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    questions = [question for result in results for question in result.results()]
    metrics = {}
    for label in labels:
        ingests = [
            Ingest.from_records(result.records[label]["ingest"], result.records[FULL]["ingest"])
            for result in results
            if "ingest" in result.records[label]
        ]
        metrics[label] = row_metrics(label, questions, ingests if len(ingests) == len(results) else ())
    return metrics


def answer_records(results: Sequence[DocumentResult], labels: Sequence[str]) -> list[dict[str, Any]]:
    """Per question, for error analysis: expected, the two references and every row's answer."""

    def entry(question: QuestionResult, label: str) -> dict[str, Any]:
        return {"answer": question.answers[label], "correct": question.correct(label)}

    return [
        {
            "doc": question.doc_id,
            "kind": question.kind,
            "question": question.question,
            "expected": list(question.expected),
            "dependent": question.dependent,
            "full": entry(question, FULL),
            "no_document": entry(question, NO_DOCUMENT),
            "rows": {
                label: {**entry(question, label), "agrees": question.agrees(label), "kl": question.kl[label]}
                for label in labels
                if label not in (FULL, NO_DOCUMENT)
            },
        }
        for result in results
        for question in result.results()
    ]


def facts(args: argparse.Namespace, bench: Bench, results: Sequence[DocumentResult], command: str) -> dict[str, Any]:
    questions = [question for result in results for question in result.results()]
    peer = next(
        (r.records[label].get("peer") for r in results for label in r.records if label.startswith(KVPRESS)), None
    )
    return {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model,
        "model_fingerprint": bench.engine.fingerprint,
        "dtype": str(bench.engine.runner.dtype).removeprefix("torch."),
        "device": str(bench.engine.runner.device),
        "code": bench.code,
        "rows_by_other_code": sorted(bench.other_code),
        "split": args.split,
        "max_new_tokens": args.max_new_tokens,
        "documents": [
            {
                "doc_id": r.doc.doc_id,
                "kind": r.doc.kind,
                "title": r.doc.title,
                "pages": len(r.document.pages),
                "tokens": r.records[FULL]["ingest"]["stats"]["document_tokens"],
                "questions": len(r.questions),
            }
            for r in results
        ],
        "questions": len(questions),
        "full_correct": sum(q.correct(FULL) for q in questions),
        "no_document_correct": sum(q.correct(NO_DOCUMENT) for q in questions),
        "dependent": {kind: sum(q.dependent and q.kind == kind for q in questions) for kind in KINDS},
        "rows": {label: record["key"]["row"] for label, record in results[0].records.items()} if results else {},
        "kvpress": peer["versions"] if peer else None,
        "cache_dir": str(args.cache_dir),
    }


# --- command line ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.realdocs_quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="default")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="fp32",
        help="the model's and the cache's precision (default fp32, as every published figure; bf16 is the GPU default)",
    )
    parser.add_argument("--split", choices=SPLITS, default="test")
    parser.add_argument("--docs", nargs="+", metavar="ID", help="only these documents of the split")
    parser.add_argument("--questions", type=int, metavar="N", help="only the first N questions of each document")
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="SPEC",
        default=default_rows(),
        help="METHOD@KEEP or METHOD@KEEP[key=value,...] (method settings or CompressionConfig fields; "
        "values parsed as JSON when they parse); full and no-document rows are always run",
    )
    parser.add_argument("--kvpress-presses", nargs="+", choices=KVPRESS_PRESSES, default=list(DEFAULT_PRESSES))
    parser.add_argument("--no-kvpress", action="store_true", help="skip the kvpress rows")
    parser.add_argument(
        "--kvpress-python",
        type=Path,
        default=ROOT / ".venv-kvpress/bin/python",
        help="interpreter of the kvpress environment (make kvpress-env)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument(
        "--cache-dir", type=Path, default=default_cache_dir(), help="cached results (default: %(default)s)"
    )
    parser.add_argument(
        "--fresh",
        nargs="*",
        metavar="ROW",
        help="ignore cached results: of every row, or of the rows named (labels as in the table)",
    )
    args = parser.parse_args(argv)
    try:
        args.engine_rows = parse_rows(args.rows)
    except RowSpecError as error:
        parser.error(str(error))
    args.peer_rows = [] if args.no_kvpress else peer_rows(args.kvpress_presses, args.engine_rows)
    if args.peer_rows and dtype_name(args.dtype) != "float32":
        parser.error("--dtype applies to this project's rows only (kvpress runs in float32): add --no-kvpress")
    if args.peer_rows and not args.kvpress_python.is_file():
        # Fail now rather than after the long evaluation.
        parser.error(
            f"{args.kvpress_python} not found: run `make kvpress-env` (or pass --kvpress-python, or --no-kvpress)"
        )
    labels = [FULL, NO_DOCUMENT, *(row.label for row in args.engine_rows), *(row.label for row in args.peer_rows)]
    unknown = sorted(set(args.fresh or ()) - set(labels))
    if unknown:
        parser.error(f"--fresh: no rows {unknown}; rows: {labels}")
    if args.questions is not None and args.questions < 1:
        parser.error("--questions must be at least 1")
    args.labels = labels
    args.command = list(sys.argv[1:] if argv is None else argv)
    return args


def run(args: argparse.Namespace, engine: InfoKVEngine | None = None) -> int:
    """Runs the benchmark as `args` say (from `parse_args`); `engine`, when given, must be `args.model`'s."""
    try:
        docs = load_realdocs(args.split, doc_ids=args.docs)
    except ValueError as error:
        raise SystemExit(f"--docs: {error}") from error
    fresh = set(args.labels) if args.fresh == [] else set(args.fresh or ())
    torch.manual_seed(0)
    bench = Bench(
        engine or InfoKVEngine.from_pretrained(args.model, dtype=args.dtype),
        ResultCache(args.cache_dir, lambda label: label in fresh),
        args.max_new_tokens,
    )
    progress(
        f"model={args.model} dtype={args.dtype} split={args.split} documents={len(docs)} rows={len(args.labels)} "
        f"cache={args.cache_dir} ({bench.elapsed()})"
    )
    results = []
    for index, doc in enumerate(docs):
        result = DocumentResult(doc, load_document(doc.pdf_path), doc.questions[: args.questions])
        progress(f"[{index + 1}/{len(docs)}] {doc.doc_id} ({doc.kind}, {len(result.questions)} questions)")
        bench.run_document(result, args.engine_rows)
        results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"realdocs-{args.split}"
    if args.peer_rows:
        run_peer(bench, results, args.peer_rows, args.kvpress_python, stem)
    command = " ".join(["python -m benchmarks.realdocs_quality", *args.command])
    metrics = metrics_of(results, args.labels)
    summary = summary_line([question for result in results for question in result.results()], len(results))
    markdown = f"`{command}`\n\n{summary}\n\n{table(metrics)}\n"
    if bench.other_code:
        rows = ", ".join(f"`{label}`" for label in args.labels if label in bench.other_code)
        markdown += f"\nAnswered (in part) by other code than this checkout's, from the cache: {rows} (`--fresh`).\n"
    stem.with_suffix(".md").write_text(markdown)
    report = {"facts": facts(args, bench, results, command), "rows": metrics}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    stem.with_name(f"{stem.name}-answers.json").write_text(json.dumps(answer_records(results, args.labels), indent=1))
    print(markdown)
    progress(f"done in {bench.elapsed()}: {stem}.md, .json, -answers.json")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
