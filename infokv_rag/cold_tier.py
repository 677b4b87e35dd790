"""The cold tier: every cache entry that compression evicted, kept compactly to be recalled per question.

Per layer, each KV head's evicted entries are kept in position order, quantised as `infokv_rag.quantisation`
describes (pages of `PAGE_TOKENS` entries; its module docstring has the shapes), with
  positions               (kv_heads, m) int64, ascending per head.
Positions are not stored: per head they are the document positions the layer's hot cache does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import ResidentCache, gather_tokens
from .config import COLD_BITS
from .errors import CacheStoreError
from .quantisation import TENSOR_NAMES, QuantisedEntries


@dataclass
class ColdLayer(QuantisedEntries):
    """One layer's evicted entries, quantised in position order; shapes in the module docstring."""

    positions: Tensor

    @classmethod
    def build(cls, keys: Tensor, values: Tensor, positions: Tensor, bits: int) -> ColdLayer:
        """Quantises evicted entries: keys, values (kv_heads, m, head_dim), positions (kv_heads, m) in any order."""
        order = positions.argsort(dim=1)
        keys, values, positions = (gather_tokens(t, order) for t in (keys, values, positions))
        return cls.placed(QuantisedEntries.encode(keys, values, bits), positions)

    @classmethod
    def placed(cls, entries: QuantisedEntries, positions: Tensor) -> ColdLayer:
        """`entries`, in position order, at `positions` (kv_heads, m)."""
        return cls(**{name: getattr(entries, name) for name in TENSOR_NAMES}, positions=positions)


@dataclass
class ColdTier:
    """A document's evicted entries, one `ColdLayer` per layer, quantised to `bits`, on the CPU.

    Loaded from a saved cache, the tensors are views of a memory-mapped file: recalling a page reads it.
    """

    layers: list[ColdLayer]
    bits: int

    @property
    def nbytes(self) -> int:
        """Bytes of codes, ranges and page summaries, as stored."""
        return sum(layer.nbytes for layer in self.layers)

    @classmethod
    def build(cls, evicted: Sequence[Sequence[tuple[Tensor, Tensor, Tensor]]], bits: int) -> ColdTier:
        """evicted: per layer, the (keys, values, positions) dropped at each compression, shapes as in
        `ColdLayer.build`, heads first."""
        layers = []
        for pieces in evicted:
            keys, values, positions = (torch.cat([piece[i] for piece in pieces], dim=1) for i in range(3))
            layers.append(ColdLayer.build(keys.cpu(), values.cpu(), positions.cpu(), bits))
        return cls(layers, bits)

    def tensors(self) -> dict[str, Tensor]:
        """The tensors to save, by name (`cold.<tensor>.<layer>`), on the CPU."""
        return {
            f"cold.{name}.{index}": getattr(layer, name).detach().cpu().contiguous()
            for index, layer in enumerate(self.layers)
            for name in TENSOR_NAMES
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], hot: ResidentCache, bits: int, where: str) -> ColdTier:
        """The cold tier of the hot cache `hot` from saved `tensors`; refuses any that do not fit it exactly."""
        if bits not in COLD_BITS:
            raise CacheStoreError(f"{where} holds a cold tier of {bits} bits; expected one of {COLD_BITS}")
        n = hot.document_tokens
        layers = []
        dim = hot.working_layout()[1]
        for index, kept_positions in enumerate(hot.layer_positions()):
            heads, kept = kept_positions.shape
            evicted = n - kept
            found = QuantisedEntries.from_saved(
                tensors,
                f"cold.{{name}}.{index}",
                (heads, evicted, dim),
                bits,
                f"{where}: the cold tier of layer {index}, beside the hot cache",
            )
            held = torch.zeros(heads, n, dtype=torch.bool)
            held.scatter_(1, kept_positions.cpu(), True)
            if int(held.sum()) != heads * kept:
                raise CacheStoreError(f"{where}: layer {index} holds a position twice; ingest the document again")
            positions = (~held).nonzero()[:, 1].reshape(heads, evicted)
            layers.append(ColdLayer.placed(found, positions))
        return cls(layers, bits)
