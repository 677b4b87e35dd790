"""A cheap stand-in for context reconstruction: per (layer, KV head), a linear map from the residual
stream entering the layer to the log of the reconstruction importance of the token's KV pair (after
KVzap, arXiv 2601.07891, which fits such surrogates to KVzip's scores).

Reconstruction (`infokv_rag.reconstruction`) costs more than the prefill itself. Its scores are largely
predictable from what the prefill already computes: the input of layer l at token t decides that layer's
key and value for t. A ridge regression from the unit direction of h^l_t to log(score) is fitted per
model on calibration documents (planted-fact documents built from the bundled licence corpus, never a
benchmark's documents) and applied during the prefill for one (hidden x kv_heads) product per layer.

Where a fit comes from, in order: the package's `data/surrogates/<fingerprint>.safetensors` (shipped for
the registry's models), the cache directory's `surrogates/`, or a fit made on first use (a prefill and a
reconstruction pass over the calibration documents: about three minutes for `default` on a 2-core CPU;
`infokv-rag calibrate` does it ahead of time). A fit on first use is logged at INFO and otherwise quiet, unless the
caller asks for its progress (`fit_progress`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy
import torch
from safetensors.torch import load
from torch import Tensor

from .errors import CacheStoreError
from .evaluation import make_fact_document
from .files import safetensors_bytes, safetensors_header, write_atomic
from .models import cache_root
from .reconstruction import reconstruction_attention

if TYPE_CHECKING:
    from .engine import InfoKVEngine

log = logging.getLogger(__name__)

FORMAT = 2
"""Of a saved fit; 2: its weights' sha256 in the metadata, checked on load (a fit of format 1 is refitted)."""
CALIBRATION_SEEDS = (5000, 5001, 5002)
"""Planted-fact documents outside the quality benchmark's dev (0-999) and test (1000-1999) seeds."""
CALIBRATION_WORDS = 1500
RIDGE = 1.0
FLOOR = 1e-6
"""Added to reconstruction scores before the log: attention probabilities underflow to 0."""

CalibrationProgress = Callable[[int, int], None]
"""Called with (documents done, documents) while a surrogate is fitted."""


_fit_progress: ContextVar[CalibrationProgress | None] = ContextVar("surrogate_fit_progress", default=None)


@contextlib.contextmanager
def fit_progress(progress: CalibrationProgress) -> Iterator[None]:
    """Within this block, a surrogate fitted on first use (`surrogate_for`: a model's first ingestion by a method
    that predicts reconstruction, which takes minutes) reports to `progress` as `fit_and_cache(engine, progress)`
    does; the fit happens deep in an ingestion, so the callback comes from the caller's context, not an argument."""
    token = _fit_progress.set(progress)
    try:
        yield
    finally:
        _fit_progress.reset(token)


def features(residual: Tensor) -> Tensor:
    """(q, hidden) residual stream -> (q, hidden + 1) float32: its unit direction and a bias column."""
    residual = residual.float()
    direction = residual / residual.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    return torch.cat([direction, direction.new_ones(len(direction), 1)], dim=1)


@dataclass(frozen=True)
class ReconstructionSurrogate:
    """Per (layer, KV head) linear predictor of log reconstruction importance.

    weights: (layers, hidden + 1, kv_heads) float32.
    """

    weights: Tensor
    fingerprint: str
    """The model it was fitted for."""

    def predict(self, layer: int, residual: Tensor) -> Tensor:
        """residual: (q, hidden) input of `layer` -> (kv_heads, q) predicted importance, > 0."""
        weights = self.weights[layer].to(residual.device)
        return (features(residual) @ weights).T.exp()

    def on(self, device: torch.device) -> ReconstructionSurrogate:
        """The same fit with its weights on `device`, so that `predict` moves nothing per chunk."""
        return ReconstructionSurrogate(self.weights.to(device), self.fingerprint)

    def to_bytes(self) -> bytes:
        weights = self.weights.float().contiguous().cpu()
        metadata = {"format": str(FORMAT), "fingerprint": self.fingerprint, "sha256": _digest(weights)}
        return safetensors_bytes({"weights": weights}, metadata)

    @classmethod
    def from_bytes(
        cls, data: bytes, fingerprint: str, layers: int, hidden: int, kv_heads: int
    ) -> ReconstructionSurrogate:
        """Refuses (`CacheStoreError`) a fit made for another model or of another shape, and one whose weights are
        not those it was saved with (a damaged file ranks every document's tokens wrong, silently)."""
        try:
            tensors = load(data)
            metadata = safetensors_header(data)[0].get("__metadata__", {})
        except Exception as error:  # safetensors raises several types for damaged files
            raise CacheStoreError(f"unreadable reconstruction surrogate: {error}") from error
        if metadata.get("format") != str(FORMAT) or metadata.get("fingerprint") != fingerprint:
            raise CacheStoreError("reconstruction surrogate was fitted for another model or format")
        weights = tensors.get("weights")
        if weights is None or weights.dtype != torch.float32 or tuple(weights.shape) != (layers, hidden + 1, kv_heads):
            raise CacheStoreError("reconstruction surrogate has the wrong shape or type for this model")
        if metadata.get("sha256") != _digest(weights) or not bool(torch.isfinite(weights).all()):
            raise CacheStoreError("reconstruction surrogate is damaged: its weights are not those it was saved with")
        return cls(weights, fingerprint)


def _digest(weights: Tensor) -> str:
    return hashlib.sha256(weights.contiguous().numpy().tobytes()).hexdigest()


class _LayerInputs:
    """Keeps the features of the residual stream entering each layer during one forward pass."""

    def __init__(self) -> None:
        self.inputs: dict[int, Tensor] = {}

    def record_attention(self, layer: int, queries: Tensor, keys: Tensor, scaling: float) -> None:
        """Attention is not needed."""

    def record_layer_change(self, layer: int, before: Tensor, after: Tensor) -> None:
        self.inputs[layer] = features(before)


@torch.inference_mode()
def fit_surrogate(
    engine: InfoKVEngine, texts: list[str] | None = None, progress: CalibrationProgress | None = None
) -> ReconstructionSurrogate:
    """Fits the surrogate of `engine`'s model on `texts` (default: the calibration documents).

    Each text is prefilled in one pass (cut to half the context, so that its repetition fits too) and
    scored by reconstruction; the protected prompt head is left out of the fit.
    """
    runner, prompt = engine.runner, engine.prompt
    if texts is None:
        texts = [make_fact_document(seed=seed, target_words=CALIBRATION_WORDS).text for seed in CALIBRATION_SEEDS]
    width = int(runner.model.config.hidden_size) + 1
    gram = torch.zeros(runner.num_layers, width, width, dtype=torch.float64)
    moment = torch.zeros(runner.num_layers, width, runner.kv_heads, dtype=torch.float64)
    head = prompt.head_tokens
    if progress is not None:  # before the first document, which takes a minute or more on a CPU
        progress(0, len(texts))
    for done, text in enumerate(texts):
        ids = torch.tensor(prompt.document_ids(text)[: engine.context_window // 2], device=runner.device)
        capture = _LayerInputs()
        cache = runner.new_cache()
        with engine.lock:
            runner.forward(ids, torch.arange(len(ids), device=runner.device), cache, capture)
            scores = reconstruction_attention(runner, prompt, cache, ids, 0, len(ids), head)
        for layer in range(runner.num_layers):
            inputs = capture.inputs[layer][head:].double().cpu()
            target = (scores[layer][:, head:].T.double().cpu() + FLOOR).log()
            gram[layer] += inputs.T @ inputs
            moment[layer] += inputs.T @ target
        if progress is not None:
            progress(done + 1, len(texts))
    system = (gram + RIDGE * torch.eye(width, dtype=torch.float64)).numpy()
    # numpy's solver, not torch.linalg.solve: torch's MKL LU livelocked with 2 OpenMP threads in a process
    # that had run the service's threads (seen in CI); these systems are small (hidden + 1 per layer).
    weights = torch.from_numpy(numpy.linalg.solve(system, moment.numpy())).float()
    return ReconstructionSurrogate(weights, engine.fingerprint)


def _shipped(fingerprint: str) -> bytes | None:
    resource = resources.files("infokv_rag.data").joinpath("surrogates", f"{fingerprint}.safetensors")
    return resource.read_bytes() if resource.is_file() else None


def cached_path(fingerprint: str) -> Path:
    return cache_root() / "surrogates" / f"{fingerprint}.safetensors"


def surrogate_for(engine: InfoKVEngine) -> ReconstructionSurrogate:
    """The model's surrogate: shipped, cached, or fitted now and cached (logged: it takes minutes on a CPU; its
    progress goes to the callback of an enclosing `fit_progress`).

    A shipped or cached fit that does not verify is refitted, never used.
    """
    runner = engine.runner
    shape = (runner.num_layers, int(runner.model.config.hidden_size), runner.kv_heads)
    fingerprint = engine.fingerprint
    path = cached_path(fingerprint)
    for source, data in (
        ("package", _shipped(fingerprint)),
        (str(path), path.read_bytes() if path.is_file() else None),
    ):
        if data is None:
            continue
        try:
            return ReconstructionSurrogate.from_bytes(data, fingerprint, *shape)
        except CacheStoreError as error:
            log.warning("ignoring the reconstruction surrogate in %s: %s", source, error)
    log.info("fitting the reconstruction surrogate of %s (once per model; `infokv-rag calibrate`)", engine.name)
    return fit_and_cache(engine, _fit_progress.get())


def fit_and_cache(engine: InfoKVEngine, progress: CalibrationProgress | None = None) -> ReconstructionSurrogate:
    """Fits the model's surrogate on the calibration documents and stores it in the cache directory."""
    started = time.perf_counter()
    surrogate = fit_surrogate(engine, progress=progress)
    path = cached_path(surrogate.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, surrogate.to_bytes())
    log.info("fitted in %.0f s: %s", time.perf_counter() - started, path)
    return surrogate
