"""benchmarks/answer_coverage.py: answers found in the document's tokens, and the share of them a cache keeps."""

from __future__ import annotations

import torch

from benchmarks.answer_coverage import answer_spans, coverage, kept_entries
from infokv_rag import CompressionConfig, InfoKVEngine

from .helpers import document_cache


def test_answers_are_found_in_the_document_tokens_wherever_they_occur(random_engine: InfoKVEngine) -> None:
    text = "The notice period is 30 days. After the term, notice within 30 days ends it; see Section 4."
    ids = random_engine.prompt.document_ids(text)
    spans = answer_spans(random_engine, ids, ["30 DAYS", "Section 9"])
    assert len(spans) == 2, "both occurrences, case-insensitively; an answer that is not there has none"
    for span in spans:

        def piece(start: int, stop: int) -> str:
            return random_engine.tokenizer.decode(ids[start:stop]).lower()

        # The span holds the answer, and no token less does.
        assert "30 days" in piece(span.start, span.stop)
        assert "30 days" not in piece(span.start + 1, span.stop) and "30 days" not in piece(span.start, span.stop - 1)


def test_an_answer_inside_another_number_or_word_is_not_found(random_engine: InfoKVEngine) -> None:
    ids = random_engine.prompt.document_ids("USD 1,420 per month, 420 in all, 4.42 each; 42 reporting feeds.")
    spans = answer_spans(random_engine, ids, ["42"])
    assert len(spans) == 1
    assert random_engine.tokenizer.decode(ids[spans[0].start : spans[0].stop]).strip() == "42"


def test_coverage_is_the_best_occurrences_share_of_kept_entries(random_engine: InfoKVEngine) -> None:
    kept = torch.zeros(2, 2, 10, dtype=torch.bool)
    kept[:, :, 2:4] = True
    kept[0, 0, 6] = True
    assert coverage(kept, [range(2, 4), range(6, 8)]) == 1.0
    assert coverage(kept, [range(6, 8)]) == 0.125
    assert coverage(kept, []) is None
    doc = random_engine.ingest_text(" ".join(["word"] * 300), CompressionConfig(keep=0.25))
    entries = kept_entries(doc)
    assert entries.shape == (3, 2, doc.cache.document_tokens)
    # Per head: the layer's own entries and that head's extras (per-head budgets).
    expected = [[len(positions) for positions in doc.cache.kept_positions(layer)] for layer in range(3)]
    assert entries.sum(dim=2).tolist() == expected
    assert document_cache(doc).extras is not None and expected != [[length] * 2 for length in doc.cache.lengths]
