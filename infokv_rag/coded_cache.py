"""A compressed cache held in codes between answers (`CompressionConfig.stored_bits`).

The entries a document keeps (each layer's own, and each KV head's extras with per-head budgets) are held
in 8- or 4-bit codes, the cold tier's (`infokv_rag.quantisation`: keys per channel in pages of 32 entries,
values per token in groups of 32 channels, float16 ranges), in memory and on disk; positions, eviction
scores and the summaries of evicted entries stay as they are. An answer reads each layer's codes, and its heads'
extras, in place and decodes them to the model's dtype whenever it attends over that layer (`DecodedOnRead`,
`ExtrasOnRead`), so it holds one layer's decode at a time, only while that layer attends.

So a cache in codes costs about 9/32 (8-bit) or 5/32 (4-bit) of its entries' bytes at float32, 9/16 or 5/16
at 16 bits, and every forward pass of an answer (the question's, then one per generated token) pays one decode
of the kept entries, layer by layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import AnswerLayer, DocumentCache, EvictedSummary, ExtrasLayout, ResidentCache
from .quantisation import QuantisedEntries


@dataclass
class CodedLayer:
    """One layer's own entries in codes: entries (kv_heads, length, ...) in the layer's order, with its
    positions (kv_heads, length) int64 and scores (kv_heads, length) float32 as `LayerKV` has them."""

    entries: QuantisedEntries
    positions: Tensor
    scores: Tensor


@dataclass(frozen=True)
class DecodedOnRead:
    """A layer in codes as an answer reads it (`infokv_rag.cache.AnswerLayer`): each read decodes it to `dtype`,
    so an answer holds one layer's decode, for the time of one layer's attention, and none between reads."""

    layer: CodedLayer
    bits: int
    dtype: torch.dtype

    @property
    def positions(self) -> Tensor:
        return self.layer.positions

    @property
    def scores(self) -> Tensor:
        return self.layer.scores

    @property
    def length(self) -> int:
        return int(self.layer.positions.shape[1])

    def entries(self) -> tuple[Tensor, Tensor]:
        return self.layer.entries.decoded(self.bits, self.dtype)


@dataclass
class CodedExtras:
    """One layer's `HeadExtras` in codes: each head's entries coded apart, as a layer's heads are.

    heads: head h's entries (1, counts[h], ...) in `HeadExtras`' order; positions (entries,) and counts
    (kv_heads,) as `HeadExtras` has them.
    """

    heads: list[QuantisedEntries]
    positions: Tensor
    counts: Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, their ranges and the per-head counts (positions are not counted, as in `HeadExtras`)."""
        return sum(head.nbytes for head in self.heads) + self.counts.numel() * self.counts.element_size()

    def decoded(self, bits: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Keys and values (entries, head_dim) each, in `HeadExtras`' order."""
        keys, values = zip(*(head.decoded(bits, dtype) for head in self.heads), strict=True)
        return torch.cat(keys, dim=1)[0], torch.cat(values, dim=1)[0]


class ExtrasOnRead(ExtrasLayout):
    """A layer's extras in codes as an answer reads them: each read (`entries`) decodes them to `dtype`, for the
    time of one layer's attention."""

    def __init__(self, extras: CodedExtras, bits: int, dtype: torch.dtype) -> None:
        self.extras, self.bits, self.dtype = extras, bits, dtype
        self.positions, self.counts = extras.positions, extras.counts

    def entries(self) -> tuple[Tensor, Tensor]:
        return self.extras.decoded(self.bits, self.dtype)


@dataclass
class CodedCache(ResidentCache):
    """A document's compressed cache with its entries in codes of `bits`; `dtype` is the model's, which
    every answer decodes to. Never modified after it is made."""

    layers: list[CodedLayer]
    document_tokens: int
    sink_tokens: int
    bits: int
    dtype: torch.dtype
    summaries: list[EvictedSummary] | None = None
    extras: list[CodedExtras] | None = None

    @classmethod
    def encode(cls, cache: DocumentCache, bits: int) -> CodedCache:
        """`cache` in codes of `bits` (4 or 8)."""
        layers = [
            CodedLayer(QuantisedEntries.encode(layer.keys, layer.values, bits), layer.positions, layer.scores)
            for layer in cache.layers
        ]
        extras = None
        if cache.extras is not None:
            extras = [
                CodedExtras(
                    [
                        QuantisedEntries.encode(
                            extra.keys[extra.of_head(head)][None], extra.values[extra.of_head(head)][None], bits
                        )
                        for head in range(len(extra.counts))
                    ],
                    extra.positions,
                    extra.counts,
                )
                for extra in cache.extras
            ]
        dtype = cache.layers[0].keys.dtype
        return cls(layers, cache.document_tokens, cache.sink_tokens, bits, dtype, cache.summaries, extras)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and their ranges, the summaries and the extras' codes."""
        own = sum(layer.entries.nbytes for layer in self.layers)
        return own + sum(summary.nbytes for summary in self.summaries or []) + sum(e.nbytes for e in self.extras or [])

    def layer_positions(self) -> list[Tensor]:
        return [layer.positions for layer in self.layers]

    def extra_positions(self) -> list[tuple[Tensor, Tensor]] | None:
        return None if self.extras is None else [(extra.positions, extra.counts) for extra in self.extras]

    def answer_layers(self) -> Iterator[AnswerLayer]:
        """Each layer decoded whenever an answer reads it (`DecodedOnRead`): one layer's decode at a time."""
        return (DecodedOnRead(layer, self.bits, self.dtype) for layer in self.layers)

    def answer_extras(self) -> Sequence[ExtrasLayout] | None:
        """Each layer's extras decoded whenever an answer reads them (`ExtrasOnRead`)."""
        return None if self.extras is None else [ExtrasOnRead(extra, self.bits, self.dtype) for extra in self.extras]

    def working_layout(self) -> tuple[int, int, torch.dtype, torch.device]:
        codes = self.layers[0].entries.key_low
        return codes.shape[0], codes.shape[2], self.dtype, codes.device
