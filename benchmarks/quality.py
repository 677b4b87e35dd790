"""Quality of compressed caches on planted-fact documents and real-document questions.

One prefill per document; every method and keep ratio compresses that same prefill (query-agnostic),
then answers all of the document's questions. Reported per (method, keep): accuracy (the expected
answer appears in the answer), agreement with the full-cache answer, and the mean KL divergence
KL(full || compressed) of next-token distributions teacher-forced on the full-cache answer.

Rows `kvpress:PRESS` come from NVIDIA kvpress's own presses on the same model, prompts (token ids),
questions and keep ratios, run by benchmarks/kvpress_peer.py in `.venv-kvpress` (`make kvpress-env`;
kvpress pins an older transformers); `kvpress:none` is that side's uncompressed cache, a sanity row.

    python -m benchmarks.quality --split test                      # the reported run
    python -m benchmarks.quality --split dev --ablate              # choose InfoKV defaults here
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.documents import Document, document_from_text, load_document
from infokv_rag.evaluation import answer_matches, make_fact_document
from infokv_rag.generation import GenerationOptions
from infokv_rag.prompt import question_turns
from infokv_rag.scorers import method_names

from .variants import compress_variants, teacher_forced_logits

ROOT = Path(__file__).resolve().parent.parent
KVPRESS_PRESSES = ("snapkv", "streaming_llm", "knorm", "tova", "expected_attention", "kvzip")
KVPRESS_SANITY = "kvpress:none"
SPLIT_SEEDS = {"dev": range(0, 1000), "test": range(1000, 2000)}
ABLATIONS: dict[str, dict[str, Any]] = {
    # CompressionConfig keyword arguments that change one InfoKV default (the README's ablation table was printed
    # with the previous default's, window attention with sentence means and minmax normalisation)
    "information=entropy": {"settings": {"information": "entropy"}},
    "information=entropy,top_k=0": {"settings": {"information": "entropy", "entropy_top_k": 0}},
    "information=entropy,top_k=5": {"settings": {"information": "entropy", "entropy_top_k": 5}},
    "attribution=outgoing": {"settings": {"attribution": "outgoing"}},
    "vocabulary=all": {"settings": {"entropy_vocabulary": 0}},
    "tau=0.75": {"settings": {"tau": 0.75}},
    "tau=0.75,evolution=mean": {"settings": {"tau": 0.75, "evolution": "mean"}},
    "tau=0.5": {"settings": {"tau": 0.5}},
    "lam=0": {"settings": {"lam": 0.0}},
    "lam=0.5": {"settings": {"lam": 0.5}},
    "normalization=minmax": {"settings": {"normalization": "minmax"}},
    "aggregation=sentence": {"settings": {"aggregation": "sentence"}},
    "units=token": {"settings": {"units": "token"}},
    "adaptive_budget": {"adaptive_budget": True, "settings": {"layer_budgets": "uniform"}},
    "accumulated_attention": {"settings": {"accumulated_attention": True}},
}


@dataclass(frozen=True)
class Task:
    name: str
    document: Document
    questions: tuple[tuple[str, tuple[str, ...]], ...]
    """(question, accepted answer substrings)."""


def fact_tasks(split: str, count: int, words: int) -> list[Task]:
    tasks = []
    for seed in list(SPLIT_SEEDS[split])[:count]:
        generated = make_fact_document(seed=seed, target_words=words)
        tasks.append(
            Task(
                f"facts-{seed}",
                document_from_text(generated.text, source=f"facts-{seed}"),
                tuple((fact.question, (fact.answer,)) for fact in generated.facts),
            )
        )
    return tasks


def sample_task() -> Task:
    """Questions about the bundled Apache License 2.0 PDF whose answers are literally in the text."""
    markdown = (ROOT / "examples/sample/QUESTIONS.md").read_text()
    questions = []
    for row in re.findall(r"^\|\s*\d+\s*\|(.+?)\|(.+?)\|", markdown, re.M):
        alternatives = tuple(re.findall(r"`([^`]+)`", row[1]))
        questions.append((row[0].strip(), alternatives))
    return Task("apache-2.0", load_document(ROOT / "examples/sample/apache-license-2.0.pdf"), tuple(questions))


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(p_ref || p) for (positions, vocab) logits."""
    reference = torch.log_softmax(reference_logits.float(), dim=-1)
    other = torch.log_softmax(logits.float(), dim=-1)
    return float((reference.exp() * (reference - other)).sum(dim=-1).mean())


def progress(message: str) -> None:
    print(message, file=sys.stderr)


def correct(answer: str, expected: tuple[str, ...]) -> bool:
    return answer_matches(answer, expected)


@dataclass(frozen=True)
class FullAnswer:
    """The full cache's greedy answer to one question: the reference of agreement and KL."""

    text: str
    ids: tuple[int, ...]


def tally(row: dict[str, float], answer: str, full: FullAnswer, expected: tuple[str, ...], kl: float) -> None:
    """Adds one compressed-cache answer to a method's running totals."""
    row["questions"] += 1
    row["correct"] += correct(answer, expected)
    row["agree"] += answer.strip() == full.text.strip()
    row["full_correct_kept"] += correct(full.text, expected) and correct(answer, expected)
    row["kl"] += kl


def evaluate(
    engine: InfoKVEngine,
    tasks: list[Task],
    configs: dict[str, CompressionConfig],
    max_new_tokens: int,
    log: Callable[[str], None] = print,
) -> tuple[dict[str, dict[str, float]], list[list[FullAnswer]]]:
    """Returns the totals per method and the full-cache answers (per task, per question)."""
    options = GenerationOptions(max_new_tokens=max_new_tokens)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    full_answers: list[list[FullAnswer]] = []
    names = list(configs)
    for task_index, task in enumerate(tasks):
        started = time.perf_counter()
        variants = dict(
            zip(
                ["__full__", *names],
                compress_variants(
                    engine, task.document, [CompressionConfig(method="full", chunk_size=8192), *configs.values()]
                ),
                strict=True,
            )
        )
        full: CompressedDocument = variants.pop("__full__")
        full_answers.append([])
        for question, expected in task.questions:
            turns = question_turns(question)
            generation = full.generate(turns, options)
            full_answer = FullAnswer(generation.text(), tuple(generation.token_ids))
            full_answers[-1].append(full_answer)
            full_logits = teacher_forced_logits(full, turns, full_answer.ids)
            totals["full"]["questions"] += 1
            totals["full"]["correct"] += correct(full_answer.text, expected)
            totals["full"]["agree"] += 1
            for name, doc in variants.items():
                answer = doc.generate(turns, options).text()
                kl = mean_kl(full_logits, teacher_forced_logits(doc, turns, full_answer.ids))
                tally(totals[name], answer, full_answer, expected, kl)
        log(
            f"[{task_index + 1}/{len(tasks)}] {task.name}: {len(task.questions)} questions, "
            f"{full.stats.document_tokens} tokens, {time.perf_counter() - started:.0f}s"
        )
    return {name: dict(row) for name, row in totals.items()}, full_answers


def kvpress_job(
    engine: InfoKVEngine,
    tasks: list[Task],
    full_answers: list[list[FullAnswer]],
    presses: list[str],
    keeps: list[float],
    max_new_tokens: int,
) -> dict[str, object]:
    """The peer's job: our exact prompt token ids, full-cache answers to teacher-force, and the stop ids."""
    return {
        "model_dir": str(engine.model_dir),
        "dtype": str(engine.runner.dtype).removeprefix("torch."),
        "device": engine.runner.device.type,
        "presses": presses,
        "keeps": keeps,
        "max_new_tokens": max_new_tokens,
        # The same stop tokens as our decoder's, so both sides stop alike.
        "eos_token_ids": sorted(engine.stop_ids),
        "documents": [
            {
                "name": task.name,
                "prefix_ids": engine.prompt.document_ids(task.document.text),
                "questions": [
                    {"suffix_ids": engine.prompt.question_ids(question), "reference_ids": list(full.ids)}
                    for (question, _), full in zip(task.questions, answers, strict=True)
                ],
            }
            for task, answers in zip(tasks, full_answers, strict=True)
        ],
    }


def run_kvpress_peer(python: Path, job: dict[str, object], stem: Path) -> dict[str, Any]:
    """Runs benchmarks/kvpress_peer.py in the kvpress environment.

    Leaves the job and the peer's raw output (answer ids, KL, timings, versions) beside the results as
    `stem`-kvpress-job.json and `stem`-kvpress.json; the job can be rerun alone, e.g. with --check.
    """
    job_path, out_path = stem.with_name(f"{stem.name}-kvpress-job.json"), stem.with_name(f"{stem.name}-kvpress.json")
    job_path.write_text(json.dumps(job))
    command = [str(python), str(ROOT / "benchmarks/kvpress_peer.py"), str(job_path), str(out_path)]
    started = time.perf_counter()
    # The peer logs to stderr; its stdout goes there too, so that ours carries only the table.
    completed = subprocess.run(command, stdout=sys.stderr)
    if completed.returncode:
        raise SystemExit(f"the kvpress peer failed (exit {completed.returncode}): {' '.join(command)}")
    progress(f"kvpress peer: done in {time.perf_counter() - started:.0f}s")
    return json.loads(out_path.read_text())


def kvpress_results(
    engine: InfoKVEngine, tasks: list[Task], full_answers: list[list[FullAnswer]], peer: dict[str, Any]
) -> tuple[dict[str, dict[str, float]], dict[str, tuple[str, str]]]:
    """Scores the peer's answers exactly as ours: our tokenizer, `correct`, agreement with our full cache."""
    by_name = {task.name: (task, answers) for task, answers in zip(tasks, full_answers, strict=True)}
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    labels: dict[str, tuple[str, str]] = {}
    for row in peer["rows"]:
        task, answers = by_name[row["document"]]
        method = f"kvpress:{row['press']}"
        name = f"{method}@{row['keep']}"
        labels[name] = (method, str(row["keep"]))
        answer = engine.tokenizer.decode(row["ids"], skip_special_tokens=True)
        tally(totals[name], answer, answers[row["question"]], task.questions[row["question"]][1], row["kl"])
    return {name: dict(row) for name, row in totals.items()}, labels


def table(results: dict[str, dict[str, float]], labels: dict[str, tuple[str, str]]) -> str:
    full_correct = int(results["full"]["correct"])
    lines = [
        f"| method | keep | questions | accuracy | of the {full_correct} the full cache answers | "
        "agreement with full | KL(full‖method) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        method, keep = labels.get(name, (name, "1.0"))
        n = row["questions"]
        kl = "0" if name == "full" else f"{row['kl'] / n:.3f}"
        kept = full_correct if name == "full" else int(row["full_correct_kept"])
        lines.append(
            f"| {method} | {keep} | {int(n)} | {row['correct'] / n:.3f} | {kept} ({kept / max(full_correct, 1):.0%}) | "
            f"{row['agree'] / n:.3f} | {kl} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, float]], labels: dict[str, tuple[str, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for name, row in results.items():
        method, keep = labels.get(name, (name, "1.0"))
        if name != "full" and method != KVPRESS_SANITY:
            series[method].append((float(keep), row["correct"] / row["questions"]))
    figure, axis = plt.subplots(figsize=(10, 5))
    # More series than a default colour cycle has colours: give each its own, InfoKV drawn heaviest.
    colours = plt.get_cmap("tab20")
    for index, (method, points) in enumerate(sorted(series.items())):
        points.sort()
        axis.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            linestyle="--" if method.startswith("kvpress:") else "-",
            linewidth=2.5 if method.startswith("infokv") else 1.2,
            color=colours(index % colours.N),
            label=method,
        )
    full = results["full"]
    axis.axhline(full["correct"] / full["questions"], color="black", linestyle="--", label="full cache")
    axis.set_xlabel("keep ratio")
    axis.set_ylabel("accuracy")
    axis.legend(fontsize=7, ncol=2, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--split", choices=["dev", "test"], default="test")
    parser.add_argument("--docs", type=int, default=8, help="planted-fact documents (4 questions each)")
    parser.add_argument("--words", type=int, default=900)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument(
        "--methods", nargs="+", choices=method_names(), default=[m for m in method_names() if m != "full"]
    )
    parser.add_argument(
        "--recalls",
        type=float,
        nargs="+",
        default=[],
        help="also infokv with a cold tier, recalling this ratio per question (issue 13)",
    )
    parser.add_argument(
        "--cold-bits",
        type=int,
        default=None,
        choices=(4, 8),
        help="code width of those cold tiers (default: the engine's choice for the model's dtype)",
    )
    parser.add_argument(
        "--stored-bits",
        type=int,
        nargs="+",
        default=[],
        choices=(4, 8),
        help="also infokv with its kept entries held in codes of this width (CompressionConfig.stored_bits)",
    )
    parser.add_argument("--ablate", action="store_true", help="also sweep each InfoKV knob (dev split)")
    parser.add_argument("--no-sample", action="store_true", help="skip the Apache-2.0 PDF questions")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument(
        "--kvpress-python",
        type=Path,
        default=ROOT / ".venv-kvpress/bin/python",
        help="interpreter of the kvpress environment (make kvpress-env)",
    )
    parser.add_argument("--kvpress-presses", nargs="+", choices=KVPRESS_PRESSES, default=list(KVPRESS_PRESSES))
    parser.add_argument("--no-kvpress", action="store_true", help="skip the kvpress rows")
    args = parser.parse_args()
    if not args.no_kvpress and not args.kvpress_python.is_file():
        # Fail now rather than after the long evaluation.
        parser.error(
            f"{args.kvpress_python} not found: run `make kvpress-env` (or pass --kvpress-python, or --no-kvpress)"
        )

    torch.manual_seed(0)
    engine = InfoKVEngine.from_pretrained(args.model)
    tasks = fact_tasks(args.split, args.docs, args.words)
    if not args.no_sample and args.split == "test":
        tasks.append(sample_task())
    configs: dict[str, CompressionConfig] = {}
    labels: dict[str, tuple[str, str]] = {}
    for keep in args.keeps:
        for method in args.methods:
            name = f"{method}@{keep}"
            configs[name] = CompressionConfig(method=method, keep=keep, chunk_size=8192)
            labels[name] = (method, str(keep))
        for recall in args.recalls:
            name = f"infokv+recall{recall}@{keep}"
            asked = CompressionConfig(keep=keep, recall=recall, cold_bits=args.cold_bits, chunk_size=8192)
            configs[name] = config = engine.resolve_config(asked)
            labels[name] = (f"infokv + recall {recall}, {config.cold_bits}-bit", str(keep))
        for bits in args.stored_bits:
            name = f"infokv[stored_bits={bits}]@{keep}"
            configs[name] = CompressionConfig(keep=keep, stored_bits=bits, chunk_size=8192)
            labels[name] = (f"infokv, {bits}-bit codes", str(keep))
        if args.ablate:
            for knob, change in ABLATIONS.items():
                name = f"infokv[{knob}]@{keep}"
                configs[name] = CompressionConfig(keep=keep, chunk_size=8192, **change)
                labels[name] = (f"infokv[{knob}]", str(keep))
    print(
        f"model={args.model} split={args.split} tasks={len(tasks)} "
        f"questions={sum(len(t.questions) for t in tasks)} variants={len(configs)}",
        file=sys.stderr,
    )
    results, full_answers = evaluate(engine, tasks, configs, args.max_new_tokens, log=progress)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"quality-{args.model}-{args.split}"
    if not args.no_kvpress:
        job = kvpress_job(engine, tasks, full_answers, args.kvpress_presses, args.keeps, args.max_new_tokens)
        peer = run_kvpress_peer(args.kvpress_python, job, args.out / stem)
        peer_results, peer_labels = kvpress_results(engine, tasks, full_answers, peer)
        results.update(peer_results)
        labels.update(peer_labels)
    markdown = table(results, labels)
    command = "python -m benchmarks.quality " + " ".join(sys.argv[1:])
    (args.out / f"{stem}.md").write_text(f"`{command}`\n\n{markdown}\n")
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, labels, args.out / f"{stem}.png")
    print(f"`{command}`\n\n{markdown}\n\nplot: {args.out / f'{stem}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
