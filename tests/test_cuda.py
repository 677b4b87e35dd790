"""The engine on a CUDA GPU (random 3-layer model from conftest): every method ingests, saves, loads and answers
there, keeps what the same model keeps on the CPU, a cache held in codes decodes there as on the CPU, and a cache
written on the GPU serves on the CPU.

Skipped without CUDA (CI has none); on a GPU: `python -m pytest tests/test_cuda.py tests/test_kernels.py`.
`INFOKV_TEST_GPU=cpu` runs this module on the CPU instead, to check the tests themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from infokv_rag import CompressedDocument, CompressionConfig, InfoKVEngine
from infokv_rag.coded_cache import CodedCache
from infokv_rag.quantisation import TENSOR_NAMES
from infokv_rag.scorers import method_names
from infokv_rag.summaries import absorb

from .conftest import CORPUS
from .helpers import document_cache

GPU = os.environ.get("INFOKV_TEST_GPU", "cuda")
pytestmark = pytest.mark.skipif(GPU.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA GPU")

TEXT = " ".join(CORPUS * 10)
QUESTION = "What is the notice period?"
COMPRESSING = [method for method in method_names() if method != "full"]


@pytest.fixture(scope="module")
def gpu_engines(random_model_dir: Path) -> dict[str, InfoKVEngine]:
    return {
        dtype: InfoKVEngine.from_pretrained(str(random_model_dir), device=GPU, dtype=dtype)
        for dtype in ("fp32", "bf16")
    }


def kept(document: CompressedDocument) -> list[set[int]]:
    """The document positions each (layer, KV head) keeps."""
    return [set(head.tolist()) for layer in document_cache(document).layers for head in layer.positions.cpu()]


def overlap(a: CompressedDocument, b: CompressedDocument) -> float:
    """Share of kept entries the two documents have in common, over every (layer, KV head)."""
    pairs = list(zip(kept(a), kept(b), strict=True))
    return sum(len(x & y) for x, y in pairs) / sum(max(len(x), len(y)) for x, y in pairs)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_method_ingests_saves_loads_and_answers_on_the_gpu(
    gpu_engines: dict[str, InfoKVEngine], dtype: str, tmp_path: Path
) -> None:
    engine = gpu_engines[dtype]
    for method in method_names():
        doc = engine.ingest_text(TEXT, CompressionConfig(method=method, keep=0.25, chunk_size=256))
        for layer in document_cache(doc).layers:
            assert layer.keys.device.type == torch.device(GPU).type and layer.keys.dtype == engine.runner.dtype
        answer = doc.ask(QUESTION, max_new_tokens=6)
        assert answer, method
        loaded = engine.load(doc.save(tmp_path / method))
        assert loaded.stats == doc.stats and loaded.ask(QUESTION, max_new_tokens=6) == answer, method


def test_the_gpu_keeps_what_the_cpu_keeps(random_engine: InfoKVEngine, gpu_engines: dict[str, InfoKVEngine]) -> None:
    full = {
        name: engine.ingest_text(TEXT, CompressionConfig(method="full")).ask(QUESTION, max_new_tokens=8)
        for name, engine in (("cpu", random_engine), ("gpu", gpu_engines["fp32"]))
    }
    assert full["gpu"] == full["cpu"]
    for method in COMPRESSING:
        config = CompressionConfig(method=method, keep=0.25, chunk_size=256)
        on_cpu = random_engine.ingest_text(TEXT, config)
        on_gpu = gpu_engines["fp32"].ingest_text(TEXT, config)
        # Reductions in another order move near-ties across the budget's edge, nothing more.
        assert overlap(on_cpu, on_gpu) >= 0.97, method
        in_bf16 = gpu_engines["bf16"].ingest_text(TEXT, config)
        assert overlap(on_cpu, in_bf16) >= 0.8, method


def test_recalling_everything_on_the_gpu_answers_as_the_full_cache(gpu_engines: dict[str, InfoKVEngine]) -> None:
    engine = gpu_engines["fp32"]
    full = engine.ingest_text(TEXT, CompressionConfig(method="full")).ask(QUESTION, max_new_tokens=8)
    doc = engine.ingest_text(TEXT, CompressionConfig(keep=0.25, recall=1.0, cold_bits=8, summaries=0))
    assert doc.cold_tier is not None
    assert doc.ask(QUESTION, max_new_tokens=8, recall=1.0) == full
    assert doc.ask(QUESTION, max_new_tokens=8, recall=0.1)


def test_a_cache_written_on_the_gpu_serves_on_the_cpu(
    random_engine: InfoKVEngine, gpu_engines: dict[str, InfoKVEngine], tmp_path: Path
) -> None:
    doc = gpu_engines["bf16"].ingest_text(TEXT, CompressionConfig(keep=0.25, recall=0.1))
    loaded = random_engine.load(doc.save(tmp_path / "doc"))
    assert loaded.stats == doc.stats
    for got, want in zip(document_cache(loaded).layers, document_cache(doc).layers, strict=True):
        assert got.keys.device.type == "cpu" and got.keys.dtype == torch.float32
        assert torch.equal(got.keys, want.keys.cpu().float()) and torch.equal(got.positions, want.positions.cpu())
    assert loaded.ask(QUESTION, max_new_tokens=6, recall=0.1)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_cache_held_in_codes_decodes_on_the_gpu_as_on_the_cpu(
    random_engine: InfoKVEngine, gpu_engines: dict[str, InfoKVEngine], dtype: str, tmp_path: Path
) -> None:
    engine = gpu_engines[dtype]
    doc = engine.ingest_text(TEXT, CompressionConfig(keep=0.8, stored_bits=4, chunk_size=256))
    assert isinstance(doc.cache, CodedCache)
    for layer in doc.cache.layers:
        assert all(getattr(layer.entries, name).device.type == torch.device(GPU).type for name in TENSOR_NAMES)
    saved = doc.save(tmp_path / "doc")
    on_cpu = random_engine.load(saved)
    decoded, decoded_on_cpu = doc.cache.working_cache(0), on_cpu.cache.working_cache(0)
    # The same codes by the same arithmetic, up to the device's rounding (a fused multiply-add may move a float32
    # result by an ulp, and so a bf16 one across a rounding edge); the CPU copy is float32.
    tolerance = 1e-6 if engine.runner.dtype == torch.float32 else 2**-7
    for got, want in zip(decoded.layers, decoded_on_cpu.layers, strict=True):
        assert got.base is not None and want.base is not None
        for got_tensor, want_tensor in zip(got.base.entries(), want.base.entries(), strict=True):
            assert got_tensor.dtype == engine.runner.dtype and got_tensor.device.type == torch.device(GPU).type
            torch.testing.assert_close(got_tensor.cpu(), want_tensor.to(engine.runner.dtype), rtol=tolerance, atol=1e-6)
    answer = doc.ask(QUESTION, max_new_tokens=6)
    assert answer and engine.load(saved).ask(QUESTION, max_new_tokens=6) == answer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="waits on the device are only seen on CUDA")
def test_summarising_evicted_entries_never_waits_on_the_gpu() -> None:
    # A wait per k-means++ centre made the summaries most of the host time of a GPU ingestion (README, "On a GPU").
    generator = torch.Generator(device="cuda").manual_seed(0)
    first = [torch.randn(4, 600, 32, device="cuda", generator=generator) for _ in range(2)]
    later = [torch.randn(4, 300, 32, device="cuda", generator=generator) for _ in range(2)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        summary = absorb(absorb(None, first[0], first[1], 16, 0), later[0], later[1], 16, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(summary.log_counts.exp().sum(dim=1).cpu(), torch.full((4,), 900.0))
