"""A fast proxy for tuning on the dev split: how many planted-fact tokens each method keeps.

No generation: one prefill per document, every config compresses it, and we count, per (layer, KV
head), the fraction of the fact sentences' tokens that survive (and of the answer tokens alone).
Use it to explore; confirm with benchmarks/quality.py, which asks the questions.

    python -m benchmarks.fact_recall --docs 6 --keep 0.25
"""

from __future__ import annotations

import argparse
import sys

import torch

from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag.documents import document_from_text
from infokv_rag.evaluation import make_fact_document
from infokv_rag.prompt import DOCUMENT_INTRO
from infokv_rag.scorers import method_names

from .quality import ABLATIONS, SPLIT_SEEDS
from .variants import compress_variants


def token_spans(engine: InfoKVEngine, text: str, needles: list[str]) -> list[torch.Tensor]:
    """Token positions (in the document prefix) covered by each needle's characters."""
    prefix = f"{engine.prompt._head}{DOCUMENT_INTRO}{text.strip()}\n\n"
    encoded = engine.tokenizer(prefix, add_special_tokens=False, return_offsets_mapping=True)
    offsets = torch.tensor(encoded["offset_mapping"])
    spans = []
    for needle in needles:
        start = prefix.index(needle)
        end = start + len(needle)
        spans.append(torch.nonzero((offsets[:, 1] > start) & (offsets[:, 0] < end)).flatten())
    return spans


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--words", type=int, default=900)
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--split", default="dev", choices=["dev", "test"])
    args = parser.parse_args()
    engine = InfoKVEngine.from_pretrained(args.model)
    configs = {m: CompressionConfig(method=m, keep=args.keep, chunk_size=8192) for m in method_names() if m != "full"}
    configs |= {f"infokv[{k}]": CompressionConfig(keep=args.keep, chunk_size=8192, **v) for k, v in ABLATIONS.items()}
    totals = {name: [0.0, 0.0] for name in configs}
    seeds = list(SPLIT_SEEDS[args.split])[: args.docs]
    for seed in seeds:
        generated = make_fact_document(seed=seed, target_words=args.words)
        sentences = token_spans(engine, generated.text, [f.sentence for f in generated.facts])
        answers = token_spans(engine, generated.text, [f.answer for f in generated.facts])
        docs = compress_variants(engine, document_from_text(generated.text), list(configs.values()))
        for name, doc in zip(configs, docs, strict=True):
            kept_sentence, kept_answer = [], []
            for layer in range(len(doc.cache.lengths)):
                for head_positions in doc.cache.kept_positions(layer):
                    kept = set(head_positions.tolist())
                    kept_sentence += [sum(int(p) in kept for p in s) / len(s) for s in sentences]
                    kept_answer += [sum(int(p) in kept for p in s) / len(s) for s in answers]
            totals[name][0] += sum(kept_sentence) / len(kept_sentence)
            totals[name][1] += sum(kept_answer) / len(kept_answer)
        print(f"seed {seed} done", file=sys.stderr)
    print(f"| config (keep {args.keep}) | fact-sentence tokens kept | answer tokens kept |\n|---|---|---|")
    for name, (sentence, answer) in sorted(totals.items(), key=lambda item: -item[1][0]):
        print(f"| {name} | {sentence / len(seeds):.3f} | {answer / len(seeds):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
