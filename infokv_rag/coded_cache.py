"""A compressed cache held in codes between answers (`CompressionConfig.stored_bits`).

The entries a document keeps (each layer's own, and each KV head's extras with per-head budgets) are held
in 8- or 4-bit codes, the cold tier's (`infokv_rag.quantisation`: keys per channel in pages of 32 entries,
values per token in groups of 32 channels, float16 ranges), in memory and on disk; positions, eviction
scores and the summaries of evicted entries stay as they are. Each answer decodes the codes into its own
working cache at the model's dtype, one layer at a time, and its extras once: where an answer over a cache at the
model's dtype reads the document's entries in place, one over codes holds their decode while it runs.

So a cache in codes costs about 9/32 (8-bit) or 5/32 (4-bit) of its entries' bytes at float32, 9/16 or 5/16
at 16 bits, and every answer pays one decode of the kept entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import DocumentCache, EvictedSummary, HeadExtras, LayerKV, ResidentCache
from .quantisation import QuantisedEntries


@dataclass
class CodedLayer:
    """One layer's own entries in codes: entries (kv_heads, length, ...) in the layer's order, with its
    positions (kv_heads, length) int64 and scores (kv_heads, length) float32 as `LayerKV` has them."""

    entries: QuantisedEntries
    positions: Tensor
    scores: Tensor

    def decoded(self, bits: int, dtype: torch.dtype) -> LayerKV:
        return LayerKV(*self.entries.decoded(bits, dtype), self.positions, self.scores)


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

    def decoded(self, bits: int, dtype: torch.dtype) -> HeadExtras:
        keys, values = zip(*(head.decoded(bits, dtype) for head in self.heads), strict=True)
        return HeadExtras(torch.cat(keys, dim=1)[0], torch.cat(values, dim=1)[0], self.positions, self.counts)


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

    @property
    def answers_read_in_place(self) -> bool:
        return False

    def answer_layers(self) -> Iterator[LayerKV]:
        return (layer.decoded(self.bits, self.dtype) for layer in self.layers)

    def answer_extras(self) -> list[HeadExtras] | None:
        """Decoded for each answer, which holds them while it runs."""
        return None if self.extras is None else [extra.decoded(self.bits, self.dtype) for extra in self.extras]

    def working_layout(self) -> tuple[int, int, torch.dtype, torch.device]:
        codes = self.layers[0].entries.key_low
        return codes.shape[0], codes.shape[2], self.dtype, codes.device
