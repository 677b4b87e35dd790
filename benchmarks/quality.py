"""Quality of compressed caches on planted-fact documents and real-document questions.

One prefill per document; every method and keep ratio compresses that same prefill (query-agnostic),
then answers all of the document's questions. Reported per (method, keep): accuracy (the expected
answer appears in the answer), agreement with the full-cache answer, and the mean KL divergence
KL(full || compressed) of next-token distributions teacher-forced on the full-cache answer.

    python benchmarks/quality.py --split test                      # the reported run
    python benchmarks/quality.py --split dev --ablate              # choose InfoKV defaults here
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag.config import METHODS
from infokv_rag.documents import Document, document_from_text, load_document
from infokv_rag.engine import CompressedDocument, compress_variants
from infokv_rag.evaluation import answer_matches, make_fact_document
from infokv_rag.generation import GenerationOptions
from infokv_rag.prompt import question_turns

ROOT = Path(__file__).resolve().parent.parent
SPLIT_SEEDS = {"dev": range(0, 1000), "test": range(1000, 2000)}
ABLATIONS: dict[str, dict[str, object]] = {
    "attribution=outgoing": {"attribution": "outgoing"},
    "top_k=0": {"entropy_top_k": 0},
    "top_k=5": {"entropy_top_k": 5},
    "vocabulary=all": {"entropy_vocabulary": 0},
    "tau=0.5": {"tau": 0.5},
    "tau=1": {"tau": 1.0},
    "lam=0": {"lam": 0.0},
    "lam=0.5": {"lam": 0.5},
    "normalization=rank": {"normalization": "rank"},
    "head_reduction=max": {"head_reduction": "max"},
    "evolution=mean": {"evolution": "mean"},
    "aggregation=token": {"aggregation": "token"},
    "adaptive_budget": {"adaptive_budget": True},
    "accumulated_attention": {"accumulated_attention": True},
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


def correct(answer: str, expected: tuple[str, ...]) -> bool:
    return any(answer_matches(answer, alternative) for alternative in expected)


def evaluate(
    engine: InfoKVEngine, tasks: list[Task], configs: dict[str, CompressionConfig], max_new_tokens: int, log=print
) -> dict[str, dict[str, float]]:
    options = GenerationOptions(max_new_tokens=max_new_tokens)
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    names = list(configs)
    for task_index, task in enumerate(tasks):
        started = time.perf_counter()
        variants = dict(zip(["__full__", *names], compress_variants(engine, task.document, [CompressionConfig(method="full", chunk_size=8192), *configs.values()])))
        full: CompressedDocument = variants.pop("__full__")
        for question, expected in task.questions:
            turns = question_turns(question)
            generation = full.generate(turns, options)
            full_answer = generation.text()
            full_ids = list(generation.token_ids)
            full_logits = full.teacher_forced_logits(turns, full_ids)
            totals["full"]["questions"] += 1
            totals["full"]["correct"] += correct(full_answer, expected)
            totals["full"]["agree"] += 1
            for name, doc in variants.items():
                answer = doc.generate(turns, options).text()
                row = totals[name]
                row["questions"] += 1
                row["correct"] += correct(answer, expected)
                row["agree"] += answer.strip() == full_answer.strip()
                row["full_correct_kept"] += correct(full_answer, expected) and correct(answer, expected)
                row["kl"] += mean_kl(full_logits, doc.teacher_forced_logits(turns, full_ids))
        log(f"[{task_index + 1}/{len(tasks)}] {task.name}: {len(task.questions)} questions, "
            f"{full.stats.document_tokens} tokens, {time.perf_counter() - started:.0f}s")
    return {name: dict(row) for name, row in totals.items()}


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
        if name != "full":
            series[method].append((float(keep), row["correct"] / row["questions"]))
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for method, points in sorted(series.items()):
        points.sort()
        axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=method)
    full = results["full"]
    axis.axhline(full["correct"] / full["questions"], color="black", linestyle="--", label="full cache")
    axis.set_xlabel("keep ratio")
    axis.set_ylabel("accuracy")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--split", choices=["dev", "test"], default="test")
    parser.add_argument("--docs", type=int, default=8, help="planted-fact documents (4 questions each)")
    parser.add_argument("--words", type=int, default=900)
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    parser.add_argument("--methods", nargs="+", default=[m for m in METHODS if m != "full"] + ["infokv_entropy", "infokv_evolution"])
    parser.add_argument("--ablate", action="store_true", help="also sweep each InfoKV knob (dev split)")
    parser.add_argument("--no-sample", action="store_true", help="skip the Apache-2.0 PDF questions")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    args = parser.parse_args()

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
        if args.ablate:
            for knob, change in ABLATIONS.items():
                name = f"infokv[{knob}]@{keep}"
                configs[name] = dataclasses.replace(CompressionConfig(keep=keep, chunk_size=8192), **change)
                labels[name] = (f"infokv[{knob}]", str(keep))
    print(f"model={args.model} split={args.split} tasks={len(tasks)} "
          f"questions={sum(len(t.questions) for t in tasks)} variants={len(configs)}", file=sys.stderr)
    results = evaluate(engine, tasks, configs, args.max_new_tokens, log=lambda m: print(m, file=sys.stderr))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"quality-{args.model}-{args.split}"
    markdown = table(results, labels)
    command = "python benchmarks/quality.py " + " ".join(sys.argv[1:])
    (args.out / f"{stem}.md").write_text(f"`{command}`\n\n{markdown}\n")
    (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    plot(results, labels, args.out / f"{stem}.png")
    print(f"`{command}`\n\n{markdown}\n\nplot: {args.out / f'{stem}.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
