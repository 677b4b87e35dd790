"""What scoring costs on top of prefill: each mode's ingestion against a plain prefill, side by side in one run.

For each document length, the same document is ingested with `full` (prefill only: no signal is
captured and nothing is compressed) and with each variant, interleaved and repeated; the fastest of
the repeats is kept. Overhead = (method time - full time) / full time, all at one chunk size. Each variant
is described in `VARIANTS`, and the table's footnote repeats the descriptions of those measured.

    python benchmarks/overhead.py --tokens 1024 4096 16384
    python benchmarks/overhead.py --tokens 2048 4096 --variants infokv infokv_quality kvzip
    python benchmarks/overhead.py --tokens 16384 --repeats 1 --variants snapkv infokv --profile
    python benchmarks/overhead.py --tokens 1024 4096 --variants infokv --dtypes fp32 bf16
    python benchmarks/overhead.py --tokens 4096 --keep 0.8 --variants infokv infokv_4bit

`--dtypes` runs the whole measurement once per dtype, one engine at a time, and also gives each plain prefill
as a ratio to the first dtype's (the same document, tokenised once).

`--profile` then ingests the longest document once more per mode under torch.profiler (CPU, and CUDA where the
model runs there) and cProfile, and prints the operators that take the most time and the project's functions
that take the most (cumulative: on a GPU, waits for the device land where the host reads a result).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag.evaluation import make_fact_document
from infokv_rag.kernels import get_kernel_backend
from infokv_rag.placement import DTYPES


@dataclass(frozen=True)
class Variant:
    """A mode measured against `full`: its `CompressionConfig` fields, and what it is (the table's footnote)."""

    fields: dict[str, Any]
    description: str


VARIANTS: dict[str, Variant] = {
    "snapkv": Variant({"method": "snapkv"}, "the observation window's attention, pooled; no forward pass added"),
    "infokv": Variant(
        {"method": "infokv"},
        "the defaults (the surrogate's predicted reconstruction attention; surprisal over the 16,384 most frequent "
        "token ids plus the document's tokens; 16 summaries per layer and KV head, from a k-means of what it "
        "evicts; per-head budgets)",
    ),
    "infokv_no_summaries": Variant({"method": "infokv", "summaries": 0}, "the same without summaries (no k-means)"),
    "infokv_4bit": Variant(
        {"method": "infokv", "stored_bits": 4},
        "the same, its kept entries in 4-bit codes (the encoding added)",
    ),
    "infokv_global": Variant(
        {"method": "infokv", "settings": {"layer_budgets": "global"}},
        "one length per layer, no per-head selection or extras (a previous default)",
    ),
    "infokv_window": Variant(
        {
            "method": "infokv",
            "settings": {
                "attention": "window",
                "layer_budgets": "uniform",
                "lam": 0.25,
                "normalization": "minmax",
                "aggregation": "sentence",
                "units": "token",
            },
        },
        "the observation window's attention (an earlier default)",
    ),
    "infokv_entropy": Variant(
        {"method": "infokv", "settings": {"information": "entropy"}}, "top-k entropy instead of surprisal"
    ),
    "infokv_full_vocab": Variant(
        {"method": "infokv", "settings": {"entropy_vocabulary": 0}}, "surprisal over the whole vocabulary"
    ),
    "infokv_quality": Variant({"method": "infokv_quality"}, "the quality mode: a reconstruction pass per chunk"),
    "kvzip": Variant({"method": "kvzip"}, "our KVzip: a reconstruction pass per chunk"),
}


def document_of(engine: InfoKVEngine, tokens: int) -> str:
    """Planted-fact text trimmed to about `tokens` document-prefix tokens."""
    text = make_fact_document(seed=7, target_words=int(tokens * 0.9)).text
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    overhead = len(engine.prompt.document_ids("")) + 2
    return engine.tokenizer.decode(ids[: max(tokens - overhead, 16)])


def timed_ingest(engine: InfoKVEngine, text: str, config: CompressionConfig) -> float:
    """Wall seconds of one whole ingestion (prefill, signals, scoring, compression)."""
    started = time.perf_counter()
    engine.ingest_text(text, config)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize(engine.runner.device)
    return time.perf_counter() - started


def print_profiles(engine: InfoKVEngine, text: str, configs: dict[str, CompressionConfig]) -> None:
    """One profiled ingestion of `text` per mode: operators by device (else host) time, then our functions."""
    from torch.profiler import ProfilerActivity, profile

    on_cuda = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    sort = "cuda_time_total" if on_cuda else "cpu_time_total"
    for name, config in configs.items():
        with profile(activities=activities) as operators:
            timed_ingest(engine, text, config)
        functions = cProfile.Profile()
        functions.runcall(timed_ingest, engine, text, config)
        print(f"\n#### {name}: operators by {sort}\n")
        print(operators.key_averages().table(sort_by=sort, row_limit=20))
        print(f"#### {name}: the project's functions by cumulative time\n")
        pstats.Stats(functions, stream=sys.stdout).sort_stats("cumulative").print_stats("infokv_rag|kernels", 25)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=2048)
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    parser.add_argument("--profile", action="store_true", help="profile one more ingestion per mode (see above)")
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(DTYPES), default=[None], help="default: the engine's own for the device"
    )
    args = parser.parse_args()

    variants = {"full": {"method": "full"}, **{name: VARIANTS[name].fields for name in args.variants}}
    configs = {
        name: CompressionConfig(keep=args.keep, chunk_size=args.chunk_size, **fields)
        for name, fields in variants.items()
    }
    rows: list[tuple[str, int, dict[str, float]]] = []
    texts: dict[int, str] = {}
    for dtype in args.dtypes:
        engine = InfoKVEngine.from_pretrained(args.model, dtype=dtype)
        device = engine.runner.device
        print(
            f"model={args.model} device={device} dtype={engine.runner.dtype} threads={torch.get_num_threads()} "
            f"kernels={get_kernel_backend()} chunk={args.chunk_size} keep={args.keep}",
            file=sys.stderr,
        )
        for tokens in args.tokens:
            text = texts.setdefault(tokens, document_of(engine, tokens))
            best: dict[str, float] = {name: float("inf") for name in variants}
            for _ in range(args.repeats):
                for name, config in configs.items():
                    best[name] = min(best[name], timed_ingest(engine, text, config))
            n = len(engine.prompt.document_ids(text))
            rows.append((str(engine.runner.dtype).removeprefix("torch."), n, best))
            print(f"{n} tokens done: {best}", file=sys.stderr)
        if args.profile:
            print_profiles(engine, texts[args.tokens[-1]], configs)
        del engine

    print(f"\n`python benchmarks/overhead.py {' '.join(sys.argv[1:])}`\n")
    scored = [name for name in variants if name != "full"]
    print(
        "| dtype | tokens | prefill only (s) | prefill × the first dtype's | "
        + " | ".join(f"{name} (s) | {name} overhead" for name in scored)
        + " |"
    )
    print("|---" * (4 + 2 * len(scored)) + "|")
    first_prefill = {n: best["full"] for _, n, best in rows[: len(args.tokens)]}
    for dtype_name, n, best in rows:
        base = best["full"]
        cells = " | ".join(f"{best[name]:.2f} | {(best[name] - base) / base:+.1%}" for name in scored)
        print(f"| {dtype_name} | {n} | {base:.2f} | {base / first_prefill[n]:.2f} | {cells} |")
    print("\n" + "; ".join(f"{name}: {VARIANTS[name].description}" for name in scored) + ".")
    return 0


if __name__ == "__main__":
    sys.exit(main())
