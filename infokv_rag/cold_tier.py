"""The cold tier: every cache entry that compression evicted, kept compactly to be recalled per question.

Per layer, each KV head's evicted entries are kept in position order, cut into pages of `PAGE_TOKENS`
entries. Keys are quantised per channel within a page (key outliers live in channels, KIVI), between
the page's per-channel min and max, which also bound q.k over the page from above (Quest); values are
quantised per token in groups of `VALUE_GROUP` channels. Codes are `bits` = 8 or 4 wide (two 4-bit
codes per byte).

Shapes of one layer with m evicted entries per KV head and p = ceil(m / PAGE_TOKENS) pages:
  key_codes, value_codes  (kv_heads, m, head_dim * bits // 8) uint8
  key_low, key_high       (kv_heads, p, head_dim) float16: the page's per-channel range
  value_low, value_high   (kv_heads, m, head_dim // group) float16: each group's range (`value_group`)
  positions               (kv_heads, m) int64, ascending per head
Positions are not stored: per head they are the document positions the layer's hot cache does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cache import DocumentCache, gather_tokens
from .config import COLD_BITS
from .errors import CacheStoreError

PAGE_TOKENS = 32
VALUE_GROUP = 32
TENSOR_NAMES = ("key_codes", "key_low", "key_high", "value_codes", "value_low", "value_high")


def code_step(low: Tensor, high: Tensor, bits: int) -> Tensor:
    """What one code step is worth within [low, high] (float32, the shape of `low`)."""
    return (high.float() - low.float()).clamp_min(1e-8) / (2**bits - 1)


def quantize(values: Tensor, low: Tensor, high: Tensor, bits: int) -> Tensor:
    """values (..., d) within [low, high] (same shape) -> codes (..., d * bits // 8) uint8."""
    codes = ((values.float() - low.float()) / code_step(low, high, bits)).round_().clamp_(0, 2**bits - 1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4) if bits == 4 else codes


def unpack_into(out: Tensor, codes: Tensor, bits: int) -> None:
    """Writes the code of each channel, codes (..., d * bits // 8) uint8, into `out` (..., d) float32 (a view
    of any layout: the decoders lay keys out channel-major)."""
    if bits == 4:
        out[..., 0::2] = codes & 15
        out[..., 1::2] = codes >> 4
    else:
        out.copy_(codes)


@dataclass
class ColdLayer:
    """One layer's evicted entries, quantised; shapes in the module docstring."""

    key_codes: Tensor
    key_low: Tensor
    key_high: Tensor
    value_codes: Tensor
    value_low: Tensor
    value_high: Tensor
    positions: Tensor

    @property
    def length(self) -> int:
        """m: evicted entries per KV head."""
        return int(self.positions.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in TENSOR_NAMES)

    @classmethod
    def build(cls, keys: Tensor, values: Tensor, positions: Tensor, bits: int) -> ColdLayer:
        """Quantises evicted entries: keys, values (kv_heads, m, head_dim), positions (kv_heads, m) in any order."""
        order = positions.argsort(dim=1)
        keys, values, positions = (gather_tokens(t, order) for t in (keys, values, positions))
        heads, m, dim = keys.shape
        pages = -(-m // PAGE_TOKENS)
        padded = keys.new_zeros(heads, pages * PAGE_TOKENS, dim)
        padded[:, :m] = keys
        # The padding of the last page repeats its first entry, so that it widens no range.
        if m % PAGE_TOKENS:
            padded[:, m:] = keys[:, (pages - 1) * PAGE_TOKENS].unsqueeze(1)
        paged = padded.reshape(heads, pages, PAGE_TOKENS, dim)
        key_low, key_high = paged.amin(dim=2).half(), paged.amax(dim=2).half()
        page_of_entry = torch.arange(m, device=keys.device) // PAGE_TOKENS
        group = value_group(dim)
        groups = values.float().reshape(heads, m, dim // group, group)
        value_low, value_high = groups.amin(dim=3).half(), groups.amax(dim=3).half()
        return cls(
            key_codes=quantize(keys, key_low[:, page_of_entry], key_high[:, page_of_entry], bits),
            key_low=key_low,
            key_high=key_high,
            value_codes=quantize(values, *_per_channel(value_low, value_high, dim), bits),
            value_low=value_low,
            value_high=value_high,
            positions=positions,
        )

    def all_keys(self, bits: int) -> Tensor:
        """Every dequantised key (kv_heads, m, head_dim) float32, in position order.

        Laid out channel-major (a transposed view), so that recall's q.k over them is one contiguous
        product; decoded page by page against the page's range, broadcast: recall decodes every key per question.
        """
        heads, pages, dim = self.key_low.shape
        keys = torch.empty(heads, dim, pages * PAGE_TOKENS, device=self.key_codes.device)
        unpack_into(keys.transpose(1, 2)[:, : self.length], self.key_codes, bits)
        low, high = (ranges.float().transpose(1, 2).unsqueeze(3) for ranges in (self.key_low, self.key_high))
        keys.view(heads, dim, pages, PAGE_TOKENS).mul_(code_step(low, high, bits)).add_(low)
        return keys[:, :, : self.length].transpose(1, 2)

    def all_values(self, bits: int) -> Tensor:
        """Every dequantised value (kv_heads, m, head_dim) float32, in position order."""
        heads, m, groups = self.value_low.shape
        values = torch.empty(heads, m, self.value_codes.shape[2] * 8 // bits, device=self.value_codes.device)
        unpack_into(values, self.value_codes, bits)
        low, high = self.value_low.unsqueeze(3), self.value_high.unsqueeze(3)
        grouped = values.view(heads, m, groups, -1)
        grouped.mul_(code_step(low, high, bits)).add_(low.float())
        return values


def value_group(head_dim: int) -> int:
    """Channels that share one value range: `VALUE_GROUP`, or the whole head when it does not divide it."""
    return VALUE_GROUP if head_dim % VALUE_GROUP == 0 else head_dim


def _per_channel(low: Tensor, high: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """Group ranges (..., head_dim // group) -> per-channel ranges (..., head_dim)."""
    group = head_dim // low.shape[-1]
    return low.repeat_interleave(group, dim=-1), high.repeat_interleave(group, dim=-1)


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
    def from_tensors(cls, tensors: dict[str, Tensor], hot: DocumentCache, bits: int, where: str) -> ColdTier:
        """The cold tier of the hot cache `hot` from saved `tensors`; refuses any that do not fit it exactly."""
        if bits not in COLD_BITS:
            raise CacheStoreError(f"{where} holds a cold tier of {bits} bits; expected one of {COLD_BITS}")
        n = hot.document_tokens
        layers = []
        for index, layer in enumerate(hot.layers):
            heads, kept, dim = layer.keys.shape
            evicted = n - kept
            pages = -(-evicted // PAGE_TOKENS)
            expected = {
                "key_codes": (heads, evicted, dim * bits // 8),
                "key_low": (heads, pages, dim),
                "key_high": (heads, pages, dim),
                "value_codes": (heads, evicted, dim * bits // 8),
                "value_low": (heads, evicted, dim // value_group(dim)),
                "value_high": (heads, evicted, dim // value_group(dim)),
            }
            found = {}
            for name, shape in expected.items():
                tensor = tensors.get(f"cold.{name}.{index}")
                wanted_dtype = torch.uint8 if name.endswith("codes") else torch.float16
                if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != wanted_dtype:
                    raise CacheStoreError(
                        f"{where}: the cold tier's {name} of layer {index} does not match the hot cache "
                        f"(expected {shape} {wanted_dtype}); ingest the document again"
                    )
                found[name] = tensor
            held = torch.zeros(heads, n, dtype=torch.bool)
            held.scatter_(1, layer.positions.cpu(), True)
            if int(held.sum()) != heads * kept:
                raise CacheStoreError(f"{where}: layer {index} holds a position twice; ingest the document again")
            positions = (~held).nonzero()[:, 1].reshape(heads, evicted)
            layers.append(ColdLayer(**found, positions=positions))
        return cls(layers, bits)
