"""A local model directory with a real model's tokenizer and architecture (or a named larger shape) and random
weights, for timing where the real weights cannot go.

Time depends on shapes alone: ingestion, scoring and answering cost the same with random weights, so a GPU
machine that cannot fetch the packaged weights can still time the default model's architecture, or a larger
one. Such a directory measures speed and memory, never answers.

    python -m benchmarks.random_weights --like ~/.cache/infokv-rag/models/default-<hash> --out /tmp/random-default
    python -m benchmarks.random_weights --like DIR --shape llama-3.1-8b --out /tmp/random-8b
    python benchmarks/overhead.py --model /tmp/random-default

`--like` needs only the model's config.json and tokenizer files. With `--shape`, the tokenizer (and so the
vocabulary size) is still `--like`'s: a Llama-3.1-8B shape with the default's 151,936-token vocabulary has
2.4% more weights than Llama-3.1-8B itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

from infokv_rag.placement import DTYPES

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}
"""Architectures larger than the registry's, by name: config fields over the tokenizer's vocabulary."""


def write_random_model(like: Path, out: Path, shape: str | None, dtype: torch.dtype) -> Path:
    """Write `like`'s tokenizer and a model of its architecture (or `shape`) with random `dtype` weights to `out`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(like)
    config = AutoConfig.from_pretrained(like)
    if shape is not None:
        fields = dict(SHAPES[shape])
        config = AutoConfig.for_model(
            fields.pop("model_type"),
            vocab_size=config.vocab_size,
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            **fields,
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--like", type=Path, required=True, help="a model directory: config.json and tokenizer")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a larger architecture instead of --like's")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the engine's dtype names")
    args = parser.parse_args()
    started = time.perf_counter()
    out = write_random_model(args.like, args.out, args.shape, getattr(torch, DTYPES[args.dtype]))
    size = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    print(f"{out}: {size / 2**30:.1f} GiB of random weights in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
