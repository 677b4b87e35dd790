"""The cold tier: every cache entry that compression evicted, kept compactly to be recalled per question.

Per layer, each KV head's evicted entries are kept apart, in position order, quantised as `infokv_rag.quantisation`
describes (one `QuantisedEntries` of shape (1, m_h, ...) per head: with per-head budgets the heads of a layer evict
different numbers), with
  positions               (m_h,) int64 per head, ascending.
Positions are not stored: per head they are the document positions that the hot cache holds neither in the layer
nor among that head's extras (`infokv_rag.cache.ExtrasLayout`). Since any cold tier of as many entries per head
would fit those shapes, a saved one carries its binding to the hot cache it complements (the sha256 of the hot
tensors' file: `infokv_rag.store`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import ResidentCache
from .config import COLD_BITS
from .errors import CacheStoreError
from .files import FileStamp
from .quantisation import TENSOR_NAMES, QuantisedEntries

HeadEvictions = tuple[Tensor, Tensor, Tensor]
"""One KV head's evicted keys, values (m, head_dim) and positions (m,)."""


@dataclass
class ColdLayer:
    """One layer's evicted entries, each KV head's quantised apart in position order; shapes in the module
    docstring."""

    heads: list[QuantisedEntries]
    positions: list[Tensor]

    @classmethod
    def build(cls, heads: Sequence[HeadEvictions], bits: int) -> ColdLayer:
        """Quantises each head's evicted entries, given in any order."""
        entries, positions = [], []
        for keys, values, head_positions in heads:
            order = head_positions.argsort()
            entries.append(QuantisedEntries.encode(keys[order][None], values[order][None], bits))
            positions.append(head_positions[order])
        return cls(entries, positions)

    @property
    def lengths(self) -> list[int]:
        """m_h: the entries each KV head holds."""
        return [head.length for head in self.heads]

    @property
    def nbytes(self) -> int:
        """Bytes of codes and ranges, as stored."""
        return sum(head.nbytes for head in self.heads)


@dataclass
class ColdTier:
    """A document's evicted entries, one `ColdLayer` per layer, quantised to `bits`, on the CPU.

    Loaded from a saved cache, the tensors are views of a memory-mapped file: recalling a page reads it.
    """

    layers: list[ColdLayer]
    bits: int
    source: FileStamp | None = field(default=None, compare=False, repr=False)
    """The file its tensors map, when loaded (a saved cache's file, or a private copy of a store's: `check_source`)."""

    def check_source(self) -> None:
        """Refuses (`CacheStoreError`) to read a mapped cold tier whose file was changed in place since it was
        verified: the map would read the new bytes (or die on a truncation)."""
        if self.source is not None and self.source.changed_in_place():
            raise CacheStoreError(
                f"{self.source.path} was written over or truncated in place after the cache was verified; "
                "load the cache again (a damaged one is refused then)"
            )

    @property
    def nbytes(self) -> int:
        """Bytes of codes and ranges, as stored."""
        return sum(layer.nbytes for layer in self.layers)

    @classmethod
    def build(cls, evicted: Sequence[Sequence[Sequence[HeadEvictions]]], bits: int) -> ColdTier:
        """evicted: per layer, per KV head, what each compression dropped from that head (at least one piece,
        empty when the head dropped nothing)."""
        layers = []
        for heads in evicted:
            joined: list[HeadEvictions] = []
            for pieces in heads:
                keys, values, positions = zip(*pieces, strict=True)
                joined.append((torch.cat(keys).cpu(), torch.cat(values).cpu(), torch.cat(positions).cpu()))
            layers.append(ColdLayer.build(joined, bits))
        return cls(layers, bits)

    def tensors(self) -> dict[str, Tensor]:
        """The tensors to save, by name (`cold.<tensor>.<layer>.<head>`), on the CPU."""
        return {
            f"cold.{name}.{index}.{head}": getattr(entries, name).detach().cpu().contiguous()
            for index, layer in enumerate(self.layers)
            for head, entries in enumerate(layer.heads)
            for name in TENSOR_NAMES
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], hot: ResidentCache, bits: int, where: str) -> ColdTier:
        """The cold tier of the hot cache `hot` (its positions each held once per head, as loading checks) from
        saved `tensors`; refuses any that do not fit it exactly."""
        if bits not in COLD_BITS:
            raise CacheStoreError(f"{where} holds a cold tier of {bits} bits; expected one of {COLD_BITS}")
        n = hot.document_tokens
        dim = hot.working_layout()[1]
        layers = []
        for index in range(len(hot.lengths)):
            kept = hot.kept_positions(index)
            # Per head, what the hot cache lacks: in the layer and among the head's extras.
            cold = torch.ones(len(kept), n, dtype=torch.bool)
            for head, positions in enumerate(kept):
                cold[head, positions.cpu()] = False
            entries = [
                QuantisedEntries.from_saved(
                    tensors,
                    f"cold.{{name}}.{index}.{head}",
                    (1, int(cold[head].sum()), dim),
                    bits,
                    f"{where}: the cold tier of layer {index}, beside the hot cache, head {head}",
                )
                for head in range(len(kept))
            ]
            layers.append(ColdLayer(entries, [cold[head].nonzero()[:, 0] for head in range(len(kept))]))
        return cls(layers, bits)
