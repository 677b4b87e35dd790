"""Time each kernel: Triton against its PyTorch reference, as a markdown table.

With CUDA: 32K tokens by default, bf16 inputs, for the default model's shapes (Qwen2.5-0.5B:
H=14, Hkv=2, dh=64, d=896, V=151936) and Llama-3.1-8B's (H=32, Hkv=8, dh=128, d=4096,
V=128256), with the Triton/reference speedup. "dequantise" decodes one layer of a cache held in
4-bit codes (`stored_bits=4`: keys and values, `tokens` entries per KV head), which every forward
pass pays per layer. Without CUDA: the references only, at a smaller size (Triton's interpreter is
a correctness tool, not something to time), and the Triton columns say they need CUDA.

    python benchmarks/kernels.py                      # all kernels, both models
    python benchmarks/kernels.py --tokens 8192 --models default --kernels entropy window
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infokv_rag.kernels import (
    accumulated_attention,
    accumulated_attention_reference,
    kernel_backend,
    predictive_entropy,
    predictive_entropy_reference,
    window_attention,
    window_attention_reference,
)
from infokv_rag.quantisation import QuantisedEntries


@dataclass(frozen=True)
class ModelShape:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int


MODELS = {
    "default": ModelShape(heads=14, kv_heads=2, head_dim=64, hidden=896, vocab=151936),
    "llama-3.1-8b": ModelShape(heads=32, kv_heads=8, head_dim=128, hidden=4096, vocab=128256),
}
KERNELS = ("entropy", "entropy-full", "window", "accumulated", "dequantise")
CODE_BITS = 4


def time_ms(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in ms, after one untimed warm-up (Triton compiles there)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def kernel_calls(
    kernel: str, shape: ModelShape, tokens: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(reference call, dispatched call) on random inputs of the model's shapes."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    if kernel in ("entropy", "entropy-full"):
        top_k = args.top_k if kernel == "entropy" else 0
        hidden = randn(tokens, shape.hidden)
        weight = randn(shape.vocab, shape.hidden, scale=shape.hidden**-0.5)
        return (
            lambda: predictive_entropy_reference(hidden, weight, top_k),
            lambda: predictive_entropy(hidden, weight, top_k),
        )
    scaling = shape.head_dim**-0.5
    keys = randn(shape.kv_heads, tokens, shape.head_dim)
    if kernel == "dequantise":
        entries = QuantisedEntries.encode(keys, randn(shape.kv_heads, tokens, shape.head_dim), CODE_BITS)

        def decode() -> torch.Tensor:
            entries.all_keys(CODE_BITS)
            return entries.all_values(CODE_BITS)

        def decode_reference() -> torch.Tensor:
            with kernel_backend("torch"):
                return decode()

        return decode_reference, decode
    if kernel == "window":
        queries = randn(shape.heads, min(args.window, tokens), shape.head_dim)
        return (
            lambda: window_attention_reference(queries, keys, scaling),
            lambda: window_attention(queries, keys, scaling),
        )
    queries = randn(shape.heads, tokens, shape.head_dim)
    return (
        lambda: accumulated_attention_reference(queries, keys, scaling),
        lambda: accumulated_attention(queries, keys, scaling),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, help="document tokens (default: 32768 on CUDA, 256 on CPU)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS), help="model shapes")
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS), help="kernels to time")
    parser.add_argument(
        "--dtype", choices=("bfloat16", "float16", "float32"), help="default: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--top-k", type=int, default=20, help="top-k of the 'entropy' kernel (default 20)")
    parser.add_argument("--window", type=int, default=32, help="observation window (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per kernel, median reported (default 3)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda" if on_cuda else "cpu")
    tokens = args.tokens or (32768 if on_cuda else 256)
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    where = torch.cuda.get_device_name(device) if on_cuda else f"CPU ({torch.get_num_threads()} threads)"
    print(f"# Kernels: {tokens} tokens, {str(dtype)[6:]}, {where}\n")
    if not on_cuda:
        print("No CUDA: timing the PyTorch references only; the Triton columns need a GPU.\n")
    print("| model | kernel | torch ms | triton ms | speedup |")
    print("|---|---|---:|---:|---:|")
    for model in args.models:
        for kernel in args.kernels:
            reference, dispatched = kernel_calls(kernel, MODELS[model], tokens, args, device, dtype)
            torch_ms = time_ms(reference, args.repeats, device)
            if on_cuda:
                with kernel_backend("triton"):
                    triton_ms = time_ms(dispatched, args.repeats, device)
                triton_cell, speedup_cell = f"{triton_ms:.1f}", f"{torch_ms / triton_ms:.1f}x"
            else:
                triton_cell, speedup_cell = "needs CUDA", "-"
            print(f"| {model} | {kernel} | {torch_ms:.1f} | {triton_cell} | {speedup_cell} |", flush=True)
            del reference, dispatched
            if on_cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
