"""Scoring kernels: every Triton kernel against its PyTorch reference against a dense formula.

With CUDA the Triton tests run the compiled kernels. Without it they run in Triton's interpreter,
which works only if TRITON_INTERPRET=1 was set before *anything* imported triton: Triton decides
at decoration time, and its own standard library (tl.zeros, tl.max, ...) is decorated when
triton.language is imported. So this module sets the variable if triton is not imported yet;
if something imported it earlier (transformers does, via conftest.py), the Triton tests are
skipped here and ``test_interpreted_kernels_in_child_process`` reruns them (every test that runs
a Triton kernel has "triton" in its name) in a fresh pytest with TRITON_INTERPRET=1 and no
conftest, requiring them all to pass.
``test_triton_kernels_are_interpreted_on_cpu`` checks that interpreter mode really is active.

The references are also run with tiny tiles, so that their online log-sum-exp and running top-k
merges cross many tile boundaries even on these small shapes.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from unittest.mock import Mock

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HAS_TRITON = importlib.util.find_spec("triton") is not None
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from infokv_rag.kernels import (  # noqa: E402
    TRITON_MAX_HEAD_DIM,
    TRITON_MAX_TOP_K,
    accumulated_attention,
    accumulated_attention_reference,
    dequantise_keys,
    dequantise_values,
    dispatch,
    get_kernel_backend,
    group_reduce,
    kernel_backend,
    predictive_entropy,
    predictive_entropy_reference,
    predictive_surprisal,
    set_kernel_backend,
    window_attention,
    window_attention_reference,
)
from infokv_rag.kernels.dispatch import use_triton  # noqa: E402


def _triton_runs_here() -> bool:
    """Whether Triton kernels can run in this process: compiled on CUDA, else interpreted."""
    if not HAS_TRITON:
        return False
    if DEVICE == "cuda":
        return True
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


TRITON_RUNS_HERE = _triton_runs_here()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
runs_triton = pytest.mark.skipif(
    not TRITON_RUNS_HERE,
    reason="no triton, or triton was imported before TRITON_INTERPRET=1 could be set; "
    "test_interpreted_kernels_in_child_process runs this test",
)

DTYPES = [torch.float32, torch.bfloat16]
MiB = 2**20


# --------------------------------------------------------------------------- dense formulas


def dense_entropy(hidden: torch.Tensor, weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """(n,) entropy -sum xlogy(p, p) from the full (n, V) logits matrix (p = 0 contributes 0)."""
    logits = hidden.float() @ weight.float().T
    if 0 < top_k < logits.shape[1]:
        logits = logits.topk(top_k, dim=1).values
    p = logits.softmax(dim=1)
    return -torch.special.xlogy(p, p).sum(dim=1)


def dense_column_attention(queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """(H, n) column sums of the full (H, q, n) bottom-right-causal attention probabilities; a masked key's
    probability is exactly 0, even in the row of a NaN query."""
    heads, q_len, _ = queries.shape
    kv_heads, n, _ = keys.shape
    expanded = keys.float().repeat_interleave(heads // kv_heads, dim=0)
    logits = queries.float() @ expanded.transpose(1, 2) * scaling
    positions = torch.arange(n - q_len, n, device=keys.device)
    future = torch.arange(n, device=keys.device)[None, :] > positions[:, None]
    return logits.masked_fill(future, float("-inf")).softmax(dim=-1).masked_fill(future, 0.0).sum(dim=1)


# --------------------------------------------------------------------------- helpers


def make_lm_head(
    n: int, vocab: int, dim: int, dtype: torch.dtype, logit_std: float = 3.0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random hidden states (n, d) and LM head (V, d) whose logits have std ~logit_std."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * (logit_std / dim**0.5)
    return hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype)


def make_qk(
    heads: int, kv_heads: int, q_len: int, n: int, head_dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random queries (H, q, dh) and keys (Hkv, n, dh); logits std ~2 so attention is peaked."""
    gen = torch.Generator().manual_seed(seed)
    queries = torch.randn(heads, q_len, head_dim, generator=gen) * 2.0**0.5
    keys = torch.randn(kv_heads, n, head_dim, generator=gen) * 2.0**0.5
    return queries.to(DEVICE, dtype), keys.to(DEVICE, dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == torch.float32, what
    assert actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- dispatch


@runs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="with CUDA the kernels run compiled")
def test_triton_kernels_are_interpreted_on_cpu() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from infokv_rag.kernels import _triton_attention, _triton_dequantise, _triton_entropy

    kernels = (
        _triton_entropy._entropy_kernel,
        _triton_attention._lse_kernel,
        _triton_attention._column_sum_kernel,
        _triton_dequantise._dequantise_kernel,
    )
    assert all(isinstance(kernel, InterpretedFunction) for kernel in kernels)


@pytest.mark.skipif(DEVICE == "cuda" or not HAS_TRITON, reason="needs triton and no CUDA")
def test_interpreted_kernels_in_child_process() -> None:
    """Where this process cannot interpret Triton, a fresh pytest with TRITON_INTERPRET=1 must."""
    if TRITON_RUNS_HERE:
        pytest.skip("the Triton tests run in this process")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # Every test that runs a Triton kernel has "triton" in its name; the import test needs no rerun.
    selection = "triton and not import"
    command = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-q",
        "-k",
        selection,
        "--noconftest",
        "-p",
        "no:cacheprovider",
    ]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[1]
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, summary


def test_backend_switch_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("INFOKV_KERNELS", raising=False)
    assert get_kernel_backend() == "auto"
    monkeypatch.setenv("INFOKV_KERNELS", "Torch")
    assert get_kernel_backend() == "torch"
    try:
        set_kernel_backend("triton")
        assert get_kernel_backend() == "triton"
        with kernel_backend("auto"):
            assert get_kernel_backend() == "auto"
            with kernel_backend("torch"):
                assert get_kernel_backend() == "torch"
            assert get_kernel_backend() == "auto"
        assert get_kernel_backend() == "triton"
    finally:
        set_kernel_backend(None)
    assert get_kernel_backend() == "torch"


def test_backend_switch_rejects_unknown_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown kernel backend"):
        set_kernel_backend("cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with kernel_backend("fast"):
            pass
    monkeypatch.setenv("INFOKV_KERNELS", "gpu")
    with pytest.raises(ValueError, match="INFOKV_KERNELS"):
        get_kernel_backend()


def test_auto_and_torch_choose_the_reference_for_cpu_tensors() -> None:
    x = torch.zeros(2, 2)
    with kernel_backend("auto"):
        assert not use_triton(x)
    with kernel_backend("torch"):
        assert not use_triton(x)


def test_auto_runs_the_reference_on_cuda_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tensors never ask whether triton is installed, so only tensors that look like CUDA test that
    "auto" falls back to the reference without it (use_triton reads nothing else of a tensor)."""
    on_cuda = Mock(spec=torch.Tensor, is_cuda=True)
    with kernel_backend("auto"):
        monkeypatch.setattr(dispatch, "triton_available", lambda: True)
        assert use_triton(on_cuda)
        monkeypatch.setattr(dispatch, "triton_available", lambda: False)
        assert not use_triton(on_cuda)


@needs_triton
def test_forced_triton_on_cpu_needs_the_interpreter_set_before_import() -> None:
    """Triton reads TRITON_INTERPRET once, when first imported (transformers imports it early): set later, or
    not at all, the variable must give the dispatcher's error, not one from deep inside Triton."""
    script = (
        "import os, torch, triton\n"
        "from infokv_rag.kernels import kernel_backend, predictive_entropy\n"
        "for interpret in ('1', '0'):\n"
        "    os.environ['TRITON_INTERPRET'] = interpret\n"
        "    try:\n"
        "        with kernel_backend('triton'):\n"
        "            predictive_entropy(torch.randn(3, 8), torch.randn(20, 8), 4)\n"
        "    except ValueError as error:\n"
        "        assert 'before triton is first imported' in str(error), error\n"
        "    else:\n"
        "        raise AssertionError(f'TRITON_INTERPRET={interpret} set after import: no error')\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]


def test_package_imports_without_triton_and_runs_when_it_is_missing() -> None:
    """In a fresh interpreter: importing the package leaves triton unimported, and with
    ``import triton`` failing, the kernels still run (on the references) under "auto"."""
    script = (
        "import sys, torch, infokv_rag.kernels as k\n"
        "assert 'triton' not in sys.modules, 'triton imported eagerly'\n"
        "sys.modules['triton'] = None\n"
        "h, w = torch.randn(5, 8), torch.randn(30, 8)\n"
        "assert k.predictive_entropy(h, w, 4).shape == (5,)\n"
        "q, kv = torch.randn(4, 3, 8), torch.randn(2, 9, 8)\n"
        "assert k.window_attention(q, kv, 0.35).shape == (4, 9)\n"
        "assert k.accumulated_attention(q, kv, 0.35).shape == (4, 9)\n"
    )
    env = {**os.environ, "INFOKV_KERNELS": "auto"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- entropy

ENTROPY_CASES = [
    pytest.param(n, vocab, dim, dtype, top_k, id=f"n{n}-V{vocab}-d{dim}-{str(dtype)[6:]}-k{top_k}")
    for n, vocab, dim in [(37, 300, 48), (129, 1000, 32)]
    for dtype in DTYPES
    for top_k in [0, 1, 5, 20]
]


@pytest.mark.parametrize("n,vocab,dim,dtype,top_k", ENTROPY_CASES)
def test_entropy_reference_matches_dense(n: int, vocab: int, dim: int, dtype: torch.dtype, top_k: int) -> None:
    hidden, weight = make_lm_head(n, vocab, dim, dtype)
    expected = dense_entropy(hidden, weight, top_k)
    assert_close(predictive_entropy_reference(hidden, weight, top_k), expected, "reference")
    tiled = predictive_entropy_reference(hidden, weight, top_k, token_block=16, vocab_block=64)
    assert_close(tiled, expected, "reference, tiny tiles")


@runs_triton
@pytest.mark.parametrize("n,vocab,dim,dtype,top_k", ENTROPY_CASES)
def test_entropy_triton_matches_reference_and_dense(
    n: int, vocab: int, dim: int, dtype: torch.dtype, top_k: int
) -> None:
    hidden, weight = make_lm_head(n, vocab, dim, dtype)
    with kernel_backend("triton"):
        actual = predictive_entropy(hidden, weight, top_k)
    assert_close(actual, predictive_entropy_reference(hidden, weight, top_k), "triton vs reference")
    assert_close(actual, dense_entropy(hidden, weight, top_k), "triton vs dense")


def tied_large_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Every logit appears 4 times (ties at the top-k boundary) and reaches ~+-300."""
    hidden, unique = make_lm_head(70, 50, 32, torch.float32, logit_std=100.0, seed=1)
    return hidden, unique.repeat(4, 1)


@pytest.mark.parametrize("top_k", [0, 4, 7])
def test_entropy_reference_with_tied_and_large_logits(top_k: int) -> None:
    hidden, weight = tied_large_logits()
    expected = dense_entropy(hidden, weight, top_k)
    assert torch.isfinite(expected).all()
    tiled = predictive_entropy_reference(hidden, weight, top_k, token_block=32, vocab_block=16)
    assert_close(tiled, expected, "reference, tiny tiles")


@runs_triton
@pytest.mark.parametrize("top_k", [0, 4, 7])
def test_entropy_triton_with_tied_and_large_logits(top_k: int) -> None:
    hidden, weight = tied_large_logits()
    with kernel_backend("triton"):
        assert_close(predictive_entropy(hidden, weight, top_k), dense_entropy(hidden, weight, top_k), "triton")


@runs_triton
@pytest.mark.parametrize("top_k", [0, 5])
def test_entropy_triton_gives_nan_for_an_all_nan_row(top_k: int) -> None:
    """A NaN hidden state (an fp16 overflow upstream) spoils its own row only, as in the reference."""
    hidden, weight = make_lm_head(4, 300, 8, torch.float32)
    hidden[1] = float("nan")
    expected = predictive_entropy_reference(hidden, weight, top_k)
    assert expected.isnan().tolist() == [False, True, False, False]
    with kernel_backend("triton"):
        actual = predictive_entropy(hidden, weight, top_k)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-5, equal_nan=True)


@runs_triton
@pytest.mark.parametrize("top_k", [0, 5])
def test_entropy_triton_gives_nan_where_one_logit_is_nan(top_k: int) -> None:
    """A NaN row of the LM head (corrupt weights) spoils every token's entropy, in both paths: a kernel that skipped
    the NaN logit would rank tokens by a distribution the model does not have."""
    hidden, weight = make_lm_head(4, 300, 8, torch.float32)
    weight[123] = float("nan")
    expected = predictive_entropy_reference(hidden, weight, top_k)
    assert bool(expected.isnan().all())
    with kernel_backend("triton"):
        actual = predictive_entropy(hidden, weight, top_k)
    torch.testing.assert_close(actual, expected, equal_nan=True)


def lm_head_with_infinite_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """hidden (3, 4) and weight (130, 4) whose logits overflow float32 to -inf in places: none in row 0, every
    third in row 1, and in row 2 the first 128 (a whole Triton tile, many reference tiles) beside two of 1e35."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.zeros(130, 4)
    weight[:128, 0] = -3e38
    weight[::3, 1] = -3e38
    weight[:, 2] = torch.randn(130, generator=gen) * 3.0
    weight[128:, 3] = 1.0
    hidden = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 10.0, 1.0, 0.0], [10.0, 0.0, 1.0, 1e35]])
    return hidden.to(DEVICE), weight.to(DEVICE)


@pytest.mark.parametrize("top_k", [0, 5])
def test_entropy_reference_counts_minus_inf_logits_as_zero_probability(top_k: int) -> None:
    """The spec's H = -sum xlogy(p, p) is finite where some logits are -inf (p = 0 adds 0 log 0 = 0), also once
    the top-k takes in -inf logits (row 2 has two finite ones) and where whole tiles hold nothing else."""
    hidden, weight = lm_head_with_infinite_logits()
    logits = hidden @ weight.T
    assert logits.isneginf().sum(dim=1).tolist() == [0, 44, 128]
    expected = dense_entropy(hidden, weight, top_k)
    assert torch.isfinite(expected).all() and abs(expected[2].item() - math.log(2)) < 1e-6
    assert_close(predictive_entropy_reference(hidden, weight, top_k), expected, "reference")
    tiled = predictive_entropy_reference(hidden, weight, top_k, token_block=2, vocab_block=16)
    assert_close(tiled, expected, "reference, tiny tiles")


@runs_triton
# The interpreter's numpy arithmetic warns on the overflow to -inf and on the masked-out 0 * -inf.
@pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")
@pytest.mark.parametrize("top_k", [0, 5])
def test_entropy_triton_counts_minus_inf_logits_as_zero_probability(top_k: int) -> None:
    hidden, weight = lm_head_with_infinite_logits()
    with kernel_backend("triton"):
        actual = predictive_entropy(hidden, weight, top_k)
    assert_close(actual, dense_entropy(hidden, weight, top_k), "triton vs dense")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("logit_std", [3.0, 100.0])
def test_surprisal_matches_dense(dtype: torch.dtype, logit_std: float) -> None:
    hidden, weight = make_lm_head(53, 300, 32, dtype, logit_std=logit_std, seed=2)
    targets = torch.randint(0, 300, (53,), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    log_p = (hidden.float() @ weight.float().T).log_softmax(dim=1)
    expected = -log_p.gather(1, targets[:, None]).squeeze(1)
    assert_close(predictive_surprisal(hidden, weight, targets), expected, "surprisal")
    tiled = predictive_surprisal(hidden, weight, targets, token_block=16, vocab_block=64)
    assert_close(tiled, expected, "surprisal, tiny tiles")
    with pytest.raises(ValueError, match="targets"):
        predictive_surprisal(hidden, weight, targets[:-1])


# Targets that indexing would misread, each with the reason it must be refused for (V = 10).
BAD_TARGETS: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "negative": (lambda: torch.tensor([-1, 0, 2], device=DEVICE), r"in \[0, 10\).*-1 \.\. 2"),
    "past-the-vocabulary": (lambda: torch.tensor([10, 0, 2], device=DEVICE), r"in \[0, 10\).*0 \.\. 10"),
    "float": (lambda: torch.tensor([0.0, 1.0, 2.0], device=DEVICE), "int64 or int32"),
    "bool": (lambda: torch.tensor([True, False, True], device=DEVICE), "int64 or int32"),
    "uint8": (lambda: torch.tensor([0, 1, 2], dtype=torch.uint8, device=DEVICE), "int64 or int32"),
    "another-device": (lambda: torch.tensor([0, 1, 2], device="meta"), "device|are on"),
}


@pytest.mark.parametrize("case", BAD_TARGETS)
def test_surprisal_rejects_bad_targets(case: str) -> None:
    hidden, weight = make_lm_head(3, 10, 8, torch.float32)
    targets, reason = BAD_TARGETS[case]
    with pytest.raises(ValueError, match=reason):
        predictive_surprisal(hidden, weight, targets())


def test_surprisal_takes_int32_targets() -> None:
    hidden, weight = make_lm_head(3, 10, 8, torch.float32)
    targets = torch.tensor([9, 0, 2], device=DEVICE)
    torch.testing.assert_close(
        predictive_surprisal(hidden, weight, targets.int()), predictive_surprisal(hidden, weight, targets)
    )


def test_entropy_edge_cases() -> None:
    hidden, weight = make_lm_head(9, 40, 16, torch.float32)
    full = predictive_entropy_reference(hidden, weight, 0)
    assert torch.equal(predictive_entropy_reference(hidden, weight, 40), full)
    assert torch.equal(predictive_entropy_reference(hidden, weight, 500), full)
    assert torch.equal(predictive_entropy_reference(hidden, weight, 1), torch.zeros(9, device=DEVICE))
    assert (full <= torch.log(torch.tensor(40.0)) + 1e-5).all()
    assert predictive_entropy(hidden[:0], weight).shape == (0,)


def test_entropy_rejects_bad_inputs() -> None:
    hidden, weight = make_lm_head(4, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        predictive_entropy(hidden, weight[:, :4])
    with pytest.raises(ValueError, match="top_k"):
        predictive_entropy(hidden, weight, -1)
    with pytest.raises(ValueError, match=r"\(n, d\)"):
        predictive_entropy(hidden[0], weight)


@runs_triton
def test_forced_triton_entropy_refuses_large_top_k() -> None:
    hidden, weight = make_lm_head(4, 500, 16, torch.float32)
    with kernel_backend("triton"), pytest.raises(ValueError, match=f"top_k <= {TRITON_MAX_TOP_K}"):
        predictive_entropy(hidden, weight, TRITON_MAX_TOP_K + 1)


# --------------------------------------------------------------------------- attention

# (kv_heads, GQA ratio, n, head_dim): GQA ratios 1, 2 and 7; odd lengths; head dims that need padding.
ATTENTION_SHAPES = [(2, 1, 37, 16), (2, 2, 129, 24), (1, 7, 129, 32)]

WINDOW_CASES = [
    pytest.param(kv, ratio, n, dh, w, dtype, id=f"Hkv{kv}-G{ratio}-n{n}-dh{dh}-w{w}-{str(dtype)[6:]}")
    for kv, ratio, n, dh in ATTENTION_SHAPES
    for w in [1, 8, 32]
    for dtype in DTYPES
]
ACCUMULATED_CASES = [
    pytest.param(kv, ratio, n, dh, q, dtype, id=f"Hkv{kv}-G{ratio}-n{n}-dh{dh}-q{q}-{str(dtype)[6:]}")
    for kv, ratio, n, dh in ATTENTION_SHAPES
    for q in [n // 2, n]
    for dtype in DTYPES
]


@pytest.mark.parametrize("kv_heads,ratio,n,head_dim,window,dtype", WINDOW_CASES)
def test_window_attention_reference_matches_dense(
    kv_heads: int, ratio: int, n: int, head_dim: int, window: int, dtype: torch.dtype
) -> None:
    queries, keys = make_qk(kv_heads * ratio, kv_heads, window, n, head_dim, dtype)
    scaling = head_dim**-0.5
    expected = dense_column_attention(queries, keys, scaling) / window
    torch.testing.assert_close(expected.sum(dim=1), torch.ones(kv_heads * ratio, device=DEVICE))
    assert_close(window_attention_reference(queries, keys, scaling), expected, "reference")
    tiled = window_attention_reference(queries, keys, scaling, query_block=3, key_block=16)
    assert_close(tiled, expected, "reference, tiny tiles")


@runs_triton
@pytest.mark.parametrize("kv_heads,ratio,n,head_dim,window,dtype", WINDOW_CASES)
def test_window_attention_triton_matches_reference_and_dense(
    kv_heads: int, ratio: int, n: int, head_dim: int, window: int, dtype: torch.dtype
) -> None:
    queries, keys = make_qk(kv_heads * ratio, kv_heads, window, n, head_dim, dtype)
    scaling = head_dim**-0.5
    with kernel_backend("triton"):
        actual = window_attention(queries, keys, scaling)
    assert_close(actual, window_attention_reference(queries, keys, scaling), "triton vs reference")
    assert_close(actual, dense_column_attention(queries, keys, scaling) / window, "triton vs dense")


@pytest.mark.parametrize("kv_heads,ratio,n,head_dim,q_len,dtype", ACCUMULATED_CASES)
def test_accumulated_attention_reference_matches_dense(
    kv_heads: int, ratio: int, n: int, head_dim: int, q_len: int, dtype: torch.dtype
) -> None:
    queries, keys = make_qk(kv_heads * ratio, kv_heads, q_len, n, head_dim, dtype)
    scaling = head_dim**-0.5
    expected = dense_column_attention(queries, keys, scaling)
    torch.testing.assert_close(expected.sum(dim=1), torch.full((kv_heads * ratio,), float(q_len), device=DEVICE))
    assert_close(accumulated_attention_reference(queries, keys, scaling), expected, "reference")
    tiled = accumulated_attention_reference(queries, keys, scaling, query_block=5, key_block=16)
    assert_close(tiled, expected, "reference, tiny tiles")


@runs_triton
@pytest.mark.parametrize("kv_heads,ratio,n,head_dim,q_len,dtype", ACCUMULATED_CASES)
def test_accumulated_attention_triton_matches_reference_and_dense(
    kv_heads: int, ratio: int, n: int, head_dim: int, q_len: int, dtype: torch.dtype
) -> None:
    queries, keys = make_qk(kv_heads * ratio, kv_heads, q_len, n, head_dim, dtype)
    scaling = head_dim**-0.5
    with kernel_backend("triton"):
        actual = accumulated_attention(queries, keys, scaling)
    assert_close(actual, accumulated_attention_reference(queries, keys, scaling), "triton vs reference")
    assert_close(actual, dense_column_attention(queries, keys, scaling), "triton vs dense")


def attention_with_a_nan_query() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries (2, 3, 8) whose head 1 query 0 (position 6 of 9, an fp16 overflow upstream) is NaN, keys (1, 9, 8),
    and the dense column sums: NaN in head 1's keys 0..6, which that query sees, and nowhere else."""
    queries, keys = make_qk(2, 1, 3, 9, 8, torch.float32)
    queries[1, 0] = float("nan")
    expected = dense_column_attention(queries, keys, 0.35)
    assert expected.isnan().tolist() == [[False] * 9, [True] * 7 + [False] * 2]
    return queries, keys, expected


@pytest.mark.parametrize("tiles", [{}, {"query_block": 2, "key_block": 4}], ids=["default-tiles", "tiny-tiles"])
def test_attention_reference_keeps_a_nan_query_to_the_keys_it_sees(tiles: dict[str, int]) -> None:
    queries, keys, expected = attention_with_a_nan_query()
    torch.testing.assert_close(accumulated_attention_reference(queries, keys, 0.35, **tiles), expected, equal_nan=True)
    torch.testing.assert_close(window_attention_reference(queries, keys, 0.35, **tiles), expected / 3, equal_nan=True)


@runs_triton
def test_attention_triton_keeps_a_nan_query_to_the_keys_it_sees() -> None:
    queries, keys, expected = attention_with_a_nan_query()
    with kernel_backend("triton"):
        actual = accumulated_attention(queries, keys, 0.35)
        window = window_attention(queries, keys, 0.35)
    torch.testing.assert_close(actual, expected, equal_nan=True)
    torch.testing.assert_close(actual, accumulated_attention_reference(queries, keys, 0.35), equal_nan=True)
    torch.testing.assert_close(window, expected / 3, equal_nan=True)


def attention_after_overflowed_keys() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One query (1, 1, 2) over 70 keys whose first 64 (a whole tile) give it logits that overflow float32 to -inf,
    and the dense column sums: 0 for those keys, a finite softmax over the other 6."""
    keys = torch.zeros(1, 70, 2)
    keys[0, :64, 0] = -3e38
    keys[0, 64:, 1] = torch.linspace(-1, 1, 6)
    queries = torch.tensor([[[10.0, 1.0]]])
    expected = dense_column_attention(queries.to(DEVICE), keys.to(DEVICE), 1.0)
    assert expected.isfinite().all() and expected[0, :64].eq(0).all()
    return queries.to(DEVICE), keys.to(DEVICE), expected


@pytest.mark.parametrize("tiles", [{}, {"key_block": 16}], ids=["default-tiles", "tiny-tiles"])
def test_attention_reference_gives_keys_whose_logits_overflowed_zero(tiles: dict[str, int]) -> None:
    """A tile whose logits all overflowed to -inf made the running max -inf and every later probability NaN."""
    queries, keys, expected = attention_after_overflowed_keys()
    torch.testing.assert_close(accumulated_attention_reference(queries, keys, 1.0, **tiles), expected)


@runs_triton
def test_attention_triton_gives_keys_whose_logits_overflowed_zero() -> None:
    queries, keys, expected = attention_after_overflowed_keys()
    with kernel_backend("triton"):
        torch.testing.assert_close(accumulated_attention(queries, keys, 1.0), expected)


def test_attention_rejects_bad_inputs() -> None:
    queries, keys = make_qk(6, 4, 3, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        window_attention(queries, keys, 1.0)
    queries, keys = make_qk(4, 2, 11, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="queries"):
        accumulated_attention(queries, keys, 1.0)
    with pytest.raises(ValueError, match="head dim mismatch"):
        window_attention(queries[:, :3], keys[..., :4], 1.0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=runs_triton)])
def test_attention_rejects_zero_query_heads(backend: str) -> None:
    """H = 0 passes "a multiple of Hkv" with a GQA group of 0: refused in both paths, not scored by one only."""
    queries, keys = make_qk(0, 1, 3, 5, 8, torch.float32)
    for score in (accumulated_attention, window_attention, accumulated_attention_reference, window_attention_reference):
        with kernel_backend(backend), pytest.raises(ValueError, match="at least one query head"):
            score(queries, keys, 0.35)


def test_attention_head_dim_over_the_triton_limit_falls_back_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where "auto" picks Triton (CUDA tensors, simulated), a head dim the kernels cannot hold runs the reference;
    only a forced Triton refuses it."""
    monkeypatch.setattr(
        importlib.import_module("infokv_rag.kernels.accumulated_attention"), "use_triton", lambda *_: True
    )
    queries, keys = make_qk(4, 2, 3, 20, TRITON_MAX_HEAD_DIM + 32, torch.float32)
    scaling = queries.shape[2] ** -0.5
    with kernel_backend("auto"):
        assert_close(
            window_attention(queries, keys, scaling), window_attention_reference(queries, keys, scaling), "auto"
        )
    with kernel_backend("triton"), pytest.raises(ValueError, match=f"head dim <= {TRITON_MAX_HEAD_DIM}"):
        accumulated_attention(queries, keys, scaling)


def test_group_reduce() -> None:
    scores = torch.arange(24, dtype=torch.float32).reshape(6, 4)  # 6 query heads, 2 KV heads
    torch.testing.assert_close(group_reduce(scores, 2, "mean"), torch.stack([scores[:3].mean(0), scores[3:].mean(0)]))
    torch.testing.assert_close(group_reduce(scores, 2, "max"), torch.stack([scores[2], scores[5]]))
    torch.testing.assert_close(group_reduce(scores, 6, "max"), scores)
    with pytest.raises(ValueError, match="kv_heads"):
        group_reduce(scores, 4)
    with pytest.raises(ValueError, match="mode"):
        group_reduce(scores, 2, "median")  # type: ignore[arg-type]


def test_group_reduce_rejects_zero_heads_and_non_int_kv_heads() -> None:
    """Zero heads would reduce to a (kv_heads, n) row of NaN means; a float or bool kv_heads is not a head count."""
    with pytest.raises(ValueError, match="no query heads"):
        group_reduce(torch.empty(0, 5), 1)
    for kv_heads in (2.0, True):
        with pytest.raises(ValueError, match="kv_heads"):
            group_reduce(torch.zeros(6, 4), kv_heads)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- memory


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_extra_rss(fn: Callable[[], object]) -> int:
    """Bytes of resident memory above the starting point at the peak of ``fn()`` (Linux, glibc).

    The kernel's own high-water mark (VmHWM), reset through /proc/self/clear_refs, sees every
    resident page (tensors, BLAS packing buffers, allocator slack) with no sampling gaps. Freed
    heap pages are handed back first (malloc_trim), so the baseline holds only live memory and
    reused pages cannot hide an allocation: the figure is an upper bound on extra live memory.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - baseline


def _memory_tracker_usable() -> bool:
    try:
        if not hasattr(ctypes.CDLL("libc.so.6"), "malloc_trim"):
            return False
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmHWM") > 0
    except (OSError, KeyError):
        return False


needs_tracker = pytest.mark.skipif(not _memory_tracker_usable(), reason="needs Linux /proc/self/clear_refs and glibc")


@needs_tracker
def test_memory_tracker_catches_dense_logits() -> None:
    """The tracker must see a naive (1024 x 16384) float32 logits matrix: 64 MiB, plus its softmax."""
    hidden, weight = torch.randn(1024, 64), torch.randn(16384, 64)
    assert peak_extra_rss(lambda: dense_entropy(hidden, weight, 0)) > 64 * MiB


@needs_tracker
@pytest.mark.parametrize(
    "n,vocab,dtype,top_k",
    [
        (8192, 4096, torch.float32, 20),
        (8192, 4096, torch.float32, 0),
        (8192, 4096, torch.bfloat16, 20),
        (512, 151936, torch.float32, 20),
    ],
    ids=str,
)
def test_entropy_reference_peak_memory_under_64_mib(n: int, vocab: int, dtype: torch.dtype, top_k: int) -> None:
    """Peak extra memory of CPU entropy scoring stays under 64 MiB (d = 896, default model).

    The reference loops over (512 tokens x 2048 vocabulary) tiles; everything it holds at one step
    (logits tile, its exp, the BLAS packing of the weight tile, a float32 copy of a bf16 tile, a
    running top-k) depends on the tile sizes, d, k and the dtype, not on n or V. More tokens add
    only the (n,) float32 output (32 KiB at 8K); a larger vocabulary adds only iterations. So
    8192 tokens against two vocabulary tiles (with a merge between them) runs the token loop at its
    full 8K, and one full token tile against the whole 151,936-token vocabulary runs the vocabulary
    loop at its full length; the 8K x 151,936 product itself is ~2.2 TFLOP, 25+ s of matmul on
    2 cores, and holds nothing either run does not. float32 is what the CPU model runs; bf16
    inputs cost most (a float32 copy of each weight tile), measured with the default top-20.
    """
    # Warm-up outside the measurement: thread pools, lazily initialised BLAS state.
    predictive_entropy_reference(torch.randn(8, 896).to(dtype), torch.randn(64, 896).to(dtype), top_k)
    hidden = torch.randn(n, 896).to(dtype)
    weight = torch.randn(vocab, 896).mul_(896**-0.5).to(dtype)
    peak = peak_extra_rss(lambda: predictive_entropy_reference(hidden, weight, top_k))
    print(f"peak extra memory: {peak / MiB:.1f} MiB")
    assert peak < 64 * MiB


# --------------------------------------------------------------------------- decoding codes

PAGE = 32
# (heads, entries, head dim, value ranges per entry): a partial last page, a head dim the value groups of 32
# do not divide (one range per entry then), a head dim over the kernel's power of two.
CODE_SHAPES = [(2, 70, 64, 2), (1, 5, 48, 1), (3, 33, 80, 1)]
CODE_CASES = [
    pytest.param(heads, m, dim, width, bits, id=f"H{heads}-m{m}-dh{dim}-w{width}-{bits}bit")
    for heads, m, dim, width in CODE_SHAPES
    for bits in (4, 8)
]


def make_codes(
    heads: int, m: int, dim: int, width: int, bits: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes (H, m, dh * bits // 8) uint8 and float16 ranges (H, rows, width), high >= low."""
    gen = torch.Generator().manual_seed(heads * 1000 + m + dim + bits)
    codes = torch.randint(0, 256, (heads, m, dim * bits // 8), generator=gen, dtype=torch.uint8)
    low = torch.randn(heads, rows, width, generator=gen).half()
    high = (low.float() + torch.rand(heads, rows, width, generator=gen) * 3).half()
    high[..., 0] = low[..., 0]  # an empty range: its step is the floor, 1e-8
    return codes.to(DEVICE), low.to(DEVICE), high.to(DEVICE)


def dense_dequantise(
    codes: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int, rows_per_range: int
) -> torch.Tensor:
    """(H, m, dh) float32: every element's range gathered, low + code * step."""
    unpacked = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2) if bits == 4 else codes
    heads, m, dim = unpacked.shape
    rows = torch.arange(m, device=codes.device) // rows_per_range
    channels = torch.arange(dim, device=codes.device) // (dim // low.shape[2])
    low_of, high_of = (r.float()[:, rows][:, :, channels] for r in (low, high))
    return low_of + unpacked.float() * ((high_of - low_of).clamp_min(1e-8) / (2**bits - 1))


def decode_both(heads: int, m: int, dim: int, width: int, bits: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values decoded by the backend in force, beside the dense formula's."""
    codes, low, high = make_codes(heads, m, dim, dim, bits, -(-m // PAGE))
    keys = dequantise_keys(codes, low, high, bits, PAGE)
    value_codes, value_low, value_high = make_codes(heads, m, dim, width, bits, m)
    values = dequantise_values(value_codes, value_low, value_high, bits)
    return {
        "keys": (keys, dense_dequantise(codes, low, high, bits, PAGE)),
        "values": (values, dense_dequantise(value_codes, value_low, value_high, bits, 1)),
    }


@pytest.mark.parametrize("heads,m,dim,width,bits", CODE_CASES)
def test_dequantise_reference_matches_dense(heads: int, m: int, dim: int, width: int, bits: int) -> None:
    with kernel_backend("torch"):
        decoded = decode_both(heads, m, dim, width, bits)
    keys = decoded["keys"][0]
    assert keys.shape == (heads, m, dim) and keys.stride(1) == 1, "keys come channel-major"
    for what, (actual, expected) in decoded.items():
        assert_close(actual, expected, what)


@runs_triton
@pytest.mark.parametrize("heads,m,dim,width,bits", CODE_CASES)
def test_dequantise_triton_matches_reference_and_dense(heads: int, m: int, dim: int, width: int, bits: int) -> None:
    with kernel_backend("torch"):
        reference = decode_both(heads, m, dim, width, bits)
    with kernel_backend("triton"):
        decoded = decode_both(heads, m, dim, width, bits)
    assert decoded["keys"][0].stride(1) == 1, "keys come channel-major"
    for what, (actual, expected) in decoded.items():
        assert_close(actual, reference[what][0], f"{what}: triton vs reference")
        assert_close(actual, expected, f"{what}: triton vs dense")


@runs_triton
def test_dequantise_triton_writes_into_a_wider_buffer() -> None:
    codes, low, high = make_codes(2, 40, 64, 64, 4, 2)
    out = torch.full((2, 64, 100), -7.0, device=DEVICE)
    with kernel_backend("triton"):
        keys = dequantise_keys(codes, low, high, 4, PAGE, out)
    assert keys.data_ptr() == out.data_ptr()
    assert_close(keys, dense_dequantise(codes, low, high, 4, PAGE), "keys in the buffer")
    assert bool((out[:, :, 40:] == -7.0).all()), "nothing past the entries is written"


@runs_triton
def test_dequantise_triton_propagates_a_nan_range_as_the_reference_does() -> None:
    codes, low, high = make_codes(1, 40, 64, 64, 8, 2)
    high[0, 1, 3] = float("nan")
    decoded = {}
    for backend in ("torch", "triton"):
        with kernel_backend(backend):
            decoded[backend] = dequantise_keys(codes, low, high, 8, PAGE)
    for backend, keys in decoded.items():
        nan = keys.isnan()
        assert bool(nan[0, PAGE:, 3].all()) and int(nan.sum()) == 40 - PAGE, backend  # that page-channel only


def test_dequantise_rejects_bad_inputs() -> None:
    codes, low, high = make_codes(1, 4, 8, 8, 8, 1)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        dequantise_values(codes, low, high, 6)
    with pytest.raises(ValueError, match="uint8 codes"):
        dequantise_values(codes.float(), low, high, 8)


# Decodes whose shapes or devices disagree, each with the reason it must be refused for: the kernel indexes with
# these sizes, so it would read or write past a tensor (a crash, or silently wrong numbers).
INCONSISTENT_DECODES: dict[str, tuple[Callable[[], torch.Tensor], str]] = {
    "keys-past-their-pages": (lambda: dequantise_keys(*make_codes(1, 40, 16, 16, 8, 1), 8, PAGE), "pages"),
    "keys-of-another-head-dim": (
        lambda: dequantise_keys(make_codes(1, 10, 16, 16, 8, 1)[0], *make_codes(1, 10, 32, 32, 8, 1)[1:], 8, PAGE),
        "channels",
    ),
    "keys-of-another-head-dim-at-4-bits": (
        lambda: dequantise_keys(make_codes(1, 10, 16, 16, 4, 1)[0], *make_codes(1, 10, 8, 8, 4, 1)[1:], 4, PAGE),
        "channels",
    ),
    "keys-with-ranges-of-fewer-heads": (
        lambda: dequantise_keys(make_codes(2, 10, 16, 16, 8, 1)[0], *make_codes(1, 10, 16, 16, 8, 1)[1:], 8, PAGE),
        "heads",
    ),
    "keys-into-a-short-out": (
        lambda: dequantise_keys(*make_codes(1, 40, 16, 16, 8, 2), 8, PAGE, torch.empty(1, 16, 40, device=DEVICE)),
        "out must be",
    ),
    "values-with-ranges-of-other-entries": (lambda: dequantise_values(*make_codes(1, 4, 48, 4, 8, 3), 8), "range row"),
    "values-in-groups-not-dividing-dh": (lambda: dequantise_values(*make_codes(1, 4, 48, 5, 8, 4), 8), "groups"),
    "values-into-an-out-of-another-shape": (
        lambda: dequantise_values(*make_codes(1, 4, 48, 4, 8, 4), 8, torch.empty(1, 4, 32, device=DEVICE)),
        "out must be",
    ),
    "values-into-an-out-on-another-device": (
        lambda: dequantise_values(*make_codes(1, 4, 8, 1, 8, 4), 8, torch.empty(1, 4, 8, device="meta")),
        "device",
    ),
}


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=runs_triton)])
@pytest.mark.parametrize("case", INCONSISTENT_DECODES)
def test_dequantise_rejects_inconsistent_shapes(case: str, backend: str) -> None:
    decode, reason = INCONSISTENT_DECODES[case]
    with kernel_backend(backend), pytest.raises(ValueError, match=reason):
        decode()


# --------------------------------------------------------------------------- autograd


def test_kernels_build_no_autograd_graph() -> None:
    """Scores and decoded caches are never differentiated. An input that requires grad (an nn.Linear LM head's
    weight does) must not make the references keep every tile for backward: extra memory O(n x V), not O(tile)."""
    hidden, weight = make_lm_head(5, 30, 8, torch.float32)
    targets = torch.arange(5, device=DEVICE)
    queries, keys = make_qk(4, 2, 3, 9, 8, torch.float32)
    codes, low, high = make_codes(1, 4, 8, 8, 8, 1)
    value_codes, value_low, value_high = make_codes(1, 4, 8, 2, 8, 4)
    for tensor in (weight, queries, keys, low, value_low):
        tensor.requires_grad_()
    with kernel_backend("torch"):
        outputs = {
            "predictive_entropy": predictive_entropy(hidden, weight, 4),
            "predictive_entropy_reference": predictive_entropy_reference(hidden, weight, 0),
            "predictive_surprisal": predictive_surprisal(hidden, weight, targets),
            "accumulated_attention": accumulated_attention(queries, keys, 0.35),
            "accumulated_attention_reference": accumulated_attention_reference(queries, keys, 0.35),
            "window_attention": window_attention(queries, keys, 0.35),
            "window_attention_reference": window_attention_reference(queries, keys, 0.35),
            "dequantise_keys": dequantise_keys(codes, low, high, 8, PAGE),
            "dequantise_values": dequantise_values(value_codes, value_low, value_high, 8),
        }
    assert [name for name, out in outputs.items() if out.requires_grad] == []
