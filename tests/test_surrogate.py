"""The reconstruction surrogate on the random model: the fit, where fits come from, and its use in ingestion."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag import surrogate as surrogate_module
from infokv_rag.cache import KVCache
from infokv_rag.errors import CacheStoreError
from infokv_rag.evaluation import make_fact_document
from infokv_rag.reconstruction import reconstruction_attention
from infokv_rag.selection import protected_mask, select_tokens
from infokv_rag.surrogate import ReconstructionSurrogate, cached_path, fit_surrogate, surrogate_for

from .helpers import document_cache

TEXTS = [
    "The supplier shall deliver the goods within thirty days of the order date. Payment of 12,500 EUR is due. " * 8,
    "Either party may terminate this agreement with ninety days written notice. The pump P-301 has valves. " * 8,
]


class _LayerInputs:
    def __init__(self) -> None:
        self.inputs: dict[int, torch.Tensor] = {}

    def record_attention(self, layer: int, queries: torch.Tensor, keys: torch.Tensor, scaling: float) -> None:
        pass

    def record_layer_change(self, layer: int, before: torch.Tensor, after: torch.Tensor) -> None:
        self.inputs[layer] = before.clone()


def _prefill(engine: InfoKVEngine, text: str) -> tuple[torch.Tensor, KVCache, _LayerInputs]:
    ids = torch.tensor(engine.prompt.document_ids(text))
    cache, capture = engine.runner.new_cache(), _LayerInputs()
    engine.runner.forward(ids, torch.arange(len(ids)), cache, capture)
    return ids, cache, capture


@pytest.fixture(scope="module")
def fitted(random_engine: InfoKVEngine) -> ReconstructionSurrogate:
    return fit_surrogate(random_engine, TEXTS)


@pytest.mark.tiny
def test_a_fit_predicts_the_ranking_of_a_document_it_never_saw(tiny_engine: InfoKVEngine) -> None:
    runner, head = tiny_engine.runner, tiny_engine.prompt.head_tokens
    calibration = [make_fact_document(seed=seed, target_words=300).text for seed in (5000, 5001)]
    fitted = fit_surrogate(tiny_engine, calibration)
    assert fitted.weights.shape == (runner.num_layers, runner.model.config.hidden_size + 1, runner.kv_heads)
    ids, cache, capture = _prefill(tiny_engine, make_fact_document(seed=7, target_words=300).text)
    scores = reconstruction_attention(runner, tiny_engine.prompt, cache, ids, 0, len(ids), head)
    correlations = []
    for layer in range(runner.num_layers):
        predicted = fitted.predict(layer, capture.inputs[layer][head:])
        for measured, guess in zip(scores[layer][:, head:], predicted, strict=True):
            ranks = torch.stack([measured.argsort().argsort(), guess.argsort().argsort()]).float()
            correlations.append(float(torch.corrcoef(ranks)[0, 1]))
    assert sum(correlations) / len(correlations) > 0.4


def test_a_fit_is_made_once_then_read_back_and_a_foreign_one_is_refitted(
    random_engine: InfoKVEngine, fitted: ReconstructionSurrogate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFOKV_CACHE_DIR", str(tmp_path))
    fits: list[int] = []

    def counted_fit(
        engine: InfoKVEngine, texts: list[str] | None = None, progress: object = None
    ) -> ReconstructionSurrogate:
        fits.append(1)
        return fitted

    monkeypatch.setattr(surrogate_module, "fit_surrogate", counted_fit)
    assert torch.equal(surrogate_for(random_engine).weights, fitted.weights)
    path = cached_path(random_engine.fingerprint)
    assert path.is_file() and len(fits) == 1
    assert torch.equal(surrogate_for(random_engine).weights, fitted.weights) and len(fits) == 1

    foreign = ReconstructionSurrogate(fitted.weights * 2, fingerprint="another model")
    path.write_bytes(foreign.to_bytes())
    assert torch.equal(surrogate_for(random_engine).weights, fitted.weights) and len(fits) == 2
    path.write_bytes(path.read_bytes()[:100])
    assert torch.equal(surrogate_for(random_engine).weights, fitted.weights) and len(fits) == 3
    # A weight's bits rotted (the last byte: the sign of the last weight), its size and header intact.
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    assert torch.equal(surrogate_for(random_engine).weights, fitted.weights) and len(fits) == 4
    layers, width, kv_heads = fitted.weights.shape
    not_finite = ReconstructionSurrogate(fitted.weights.clone().fill_(float("nan")), random_engine.fingerprint)
    with pytest.raises(CacheStoreError, match="damaged"):  # saved so, with its own digest
        ReconstructionSurrogate.from_bytes(
            not_finite.to_bytes(), random_engine.fingerprint, layers, width - 1, kv_heads
        )


def test_the_shipped_fits_verify() -> None:
    """Each packaged fit reads back whole (a fit that does not verify is refitted: minutes on a CPU)."""
    for path in resources.files("infokv_rag.data").joinpath("surrogates").iterdir():
        if path.name.endswith(".safetensors"):
            data = path.read_bytes()
            weights = load(data)["weights"]
            fingerprint = path.name.removesuffix(".safetensors")
            layers, width, kv_heads = weights.shape
            assert ReconstructionSurrogate.from_bytes(data, fingerprint, layers, width - 1, kv_heads).fingerprint


def test_predicted_attention_keeps_the_tokens_the_surrogate_ranks_highest(
    random_engine: InfoKVEngine, fitted: ReconstructionSurrogate, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(random_engine, "reconstruction_surrogate", fitted)
    settings = {"lam": 1.0, "normalization": "minmax", "units": "token", "layer_budgets": "uniform"}
    config = CompressionConfig(method="infokv", keep=0.3, settings=settings)
    document = random_engine.ingest_text(TEXTS[1], config)
    ids, _, capture = _prefill(random_engine, TEXTS[1])
    n, sinks = len(ids), document.cache.sink_tokens
    budget = config.budget_for(n, sinks)
    for layer, kept in enumerate(document_cache(document).layers):
        positions = torch.arange(n).expand(random_engine.runner.kv_heads, n)
        predicted = fitted.predict(layer, capture.inputs[layer])
        keep = select_tokens(predicted, protected_mask(positions, n, sinks, config.window), budget)
        assert torch.equal(kept.positions, positions.gather(1, keep))
