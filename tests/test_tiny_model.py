"""Integration tests on the real tiny model (SmolLM2-135M from its PyPI package)."""

from __future__ import annotations

import pytest
import torch

from infokv_rag import CompressionConfig, InfoKVEngine
from infokv_rag.evaluation import make_fact_document
from infokv_rag.generation import GenerationOptions
from infokv_rag.prompt import question_turns

from .helpers import document_cache

pytestmark = pytest.mark.tiny

QUESTIONS = [
    "What is the notice period?",
    "Who is the supplier?",
    "Summarise the document in one sentence.",
    "What amount is due?",
]


@pytest.fixture(scope="module")
def fact_text() -> str:
    return make_fact_document(seed=11, target_words=500).text


def test_full_cache_answers_equal_model_generate(tiny_engine: InfoKVEngine, fact_text: str) -> None:
    doc = tiny_engine.ingest_text(fact_text, CompressionConfig(method="full"))
    prefix = tiny_engine.prompt.document_ids(fact_text)
    for question in QUESTIONS:
        generation = doc.generate(question_turns(question), GenerationOptions(max_new_tokens=24))
        text = generation.text()
        suffix = tiny_engine.prompt.question_ids(question)
        input_ids = torch.tensor([prefix + suffix])
        with torch.inference_mode():
            reference = tiny_engine.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=24, do_sample=False
            )[0, input_ids.shape[1] :].tolist()
        reference = [t for t in reference if t not in tiny_engine.stop_ids]
        assert generation.token_ids == reference, question
        assert text == tiny_engine.tokenizer.decode(reference, skip_special_tokens=True)


def test_ask_q1_q2_q1_is_stable_and_cache_untouched(tiny_engine: InfoKVEngine, fact_text: str) -> None:
    doc = tiny_engine.ingest_text(fact_text, CompressionConfig(method="infokv", keep=0.25))
    snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in document_cache(doc).layers]
    first = doc.ask(QUESTIONS[0], max_new_tokens=20)
    doc.ask(QUESTIONS[1], max_new_tokens=20)
    assert doc.ask(QUESTIONS[0], max_new_tokens=20) == first
    for (keys, values), layer in zip(snapshot, document_cache(doc).layers, strict=True):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


def test_tiny_keep_ratio_bytes(tiny_engine: InfoKVEngine, fact_text: str) -> None:
    doc = tiny_engine.ingest_text(fact_text, CompressionConfig(method="infokv", keep=0.25))
    n = doc.stats.document_tokens
    # 16 summaries per layer and KV head take the place of as many tokens; the bytes still follow keep.
    assert doc.cache.summaries is not None and {summary.length for summary in doc.cache.summaries} == {16}
    # Per-head budgets: each layer reports the mean over its KV heads, rounded.
    assert abs(doc.stats.kept_tokens - 30 * (round(0.25 * n) - 16)) <= 30
    assert abs(doc.stats.compression_ratio - 0.25) <= 0.02 * 0.25 + 1 / n
