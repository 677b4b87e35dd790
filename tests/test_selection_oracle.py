"""benchmarks/selection_oracle.py: the questions' attention it selects by."""

from __future__ import annotations

import torch

from benchmarks.selection_oracle import QuestionAttention, question_attention
from infokv_rag import CompressionConfig, InfoKVEngine


def test_the_capture_keeps_the_most_attention_any_query_pays_each_document_token() -> None:
    generator = torch.Generator().manual_seed(0)
    n, count, heads, kv_heads, dim = 6, 3, 4, 2, 8
    queries = torch.randn(heads, count, dim, generator=generator)
    keys = torch.randn(kv_heads, n + count, dim, generator=generator)
    capture = QuestionAttention(n)
    capture.record_attention(0, queries, keys, 0.5)
    expected = torch.zeros(kv_heads, n)
    for head in range(heads):
        group = head // (heads // kv_heads)
        for query in range(count):
            visible = n + query + 1  # the document, then the run's tokens up to this one
            probabilities = (queries[head, query] @ keys[group, :visible].T * 0.5).softmax(dim=-1)
            expected[group] = torch.maximum(expected[group], probabilities[:n])
    assert torch.allclose(capture.attention[0], expected, atol=1e-6)
    # A second run only raises what the first found.
    capture.record_attention(0, queries * 0, keys, 0.5)
    assert torch.allclose(capture.attention[0], torch.maximum(expected, torch.full_like(expected, 1 / (n + 1))))


def test_several_questions_give_the_most_attention_of_each(random_engine: InfoKVEngine) -> None:
    text = "The fee is 40 dollars. Notice is due in 30 days. " * 8
    doc = random_engine.ingest_text(text, CompressionConfig(method="full"))
    first = question_attention(random_engine, doc.cache, [("What is the fee?", ())])
    second = question_attention(random_engine, doc.cache, [("When is notice due?", [11, 12])])
    both = question_attention(random_engine, doc.cache, [("What is the fee?", ()), ("When is notice due?", [11, 12])])
    assert sorted(both) == list(range(random_engine.runner.num_layers))
    for layer, attention in both.items():
        assert attention.shape == (random_engine.runner.kv_heads, doc.cache.document_tokens)
        assert torch.allclose(attention, torch.maximum(first[layer], second[layer]))
        assert not torch.allclose(first[layer], second[layer])
