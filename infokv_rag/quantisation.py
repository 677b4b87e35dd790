"""Cache entries in codes of 8 or 4 bits: what the cold tier keeps of the evicted entries
(`infokv_rag.cold_tier`) and what a cache held in codes keeps of the resident ones (`infokv_rag.coded_cache`).

Keys are quantised per channel within pages of `PAGE_TOKENS` consecutive entries (key outliers live in
channels, KIVI), between the page's per-channel min and max, which also bound q.k over the page from above
(Quest); values are quantised per token in groups of `VALUE_GROUP` channels. Codes are `bits` = 8 or 4 wide
(two 4-bit codes per byte).

Shapes of m entries per KV head, p = ceil(m / PAGE_TOKENS) pages:
  key_codes, value_codes  (kv_heads, m, head_dim * bits // 8) uint8
  key_low, key_high       (kv_heads, p, head_dim) float16: the page's per-channel range
  value_low, value_high   (kv_heads, m, head_dim // group) float16: each group's range (`value_group`)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import CacheStoreError
from .kernels import code_step, dequantise_keys, dequantise_values

PAGE_TOKENS = 32
VALUE_GROUP = 32
TENSOR_NAMES = ("key_codes", "key_low", "key_high", "value_codes", "value_low", "value_high")


def quantize(values: Tensor, low: Tensor, high: Tensor, bits: int) -> Tensor:
    """values (..., d) within [low, high] (same shape) -> codes (..., d * bits // 8) uint8."""
    codes = ((values.float() - low.float()) / code_step(low, high, bits)).round_().clamp_(0, 2**bits - 1)
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4) if bits == 4 else codes


def half_bounds(low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
    """float16 bounds that hold [low, high] (float32, the same shape): rounded outward, since a bound rounded
    inward clamps the values past it by up to half a float16 spacing, far more than a code step on a channel with
    a large offset and a small spread; and saturated at float16's largest finite value, since an infinite bound
    decodes its whole page or group to NaN (values beyond it saturate too)."""
    limit = torch.finfo(torch.float16).max
    low, high = low.clamp(-limit, limit), high.clamp(-limit, limit)
    low16, high16 = low.half(), high.half()
    down, up = torch.full_like(low16, -torch.inf), torch.full_like(high16, torch.inf)
    low16 = torch.where(low16.float() > low, torch.nextafter(low16, down), low16)
    high16 = torch.where(high16.float() < high, torch.nextafter(high16, up), high16)
    return low16, high16


def value_group(head_dim: int) -> int:
    """Channels that share one value range: `VALUE_GROUP`, or the whole head when it does not divide it."""
    return VALUE_GROUP if head_dim % VALUE_GROUP == 0 else head_dim


def _per_channel(low: Tensor, high: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """Group ranges (..., head_dim // group) -> per-channel ranges (..., head_dim)."""
    group = head_dim // low.shape[-1]
    return low.repeat_interleave(group, dim=-1), high.repeat_interleave(group, dim=-1)


@dataclass
class QuantisedEntries:
    """Keys and values of m entries per KV head in codes, in the order they were given; shapes in the module
    docstring."""

    key_codes: Tensor
    key_low: Tensor
    key_high: Tensor
    value_codes: Tensor
    value_low: Tensor
    value_high: Tensor

    @classmethod
    def from_saved(
        cls, tensors: Mapping[str, Tensor], saved_as: str, shape: tuple[int, int, int], bits: int, what: str
    ) -> QuantisedEntries:
        """The entries of shape (kv_heads, m, head_dim) from saved `tensors`, each saved under the name
        `saved_as.format(name=...)` (e.g. "cold.{name}.3"); refuses any that is missing or does not match, naming
        `what` they belong to."""
        heads, entries, head_dim = shape
        pages = -(-entries // PAGE_TOKENS)
        codes = ((heads, entries, head_dim * bits // 8), torch.uint8)
        ranges = ((heads, pages, head_dim), torch.float16)
        groups = ((heads, entries, head_dim // value_group(head_dim)), torch.float16)
        expected = dict(zip(TENSOR_NAMES, (codes, ranges, ranges, codes, groups, groups), strict=True))
        found = {}
        for name, (wanted_shape, wanted_dtype) in expected.items():
            tensor = tensors.get(saved_as.format(name=name))
            if tensor is None or tuple(tensor.shape) != wanted_shape or tensor.dtype != wanted_dtype:
                raise CacheStoreError(
                    f"{what}: {name} does not match (expected {wanted_shape} {wanted_dtype}); ingest the document again"
                )
            found[name] = tensor
        return cls(**found)

    @classmethod
    def encode(cls, keys: Tensor, values: Tensor, bits: int) -> QuantisedEntries:
        """Quantises keys, values (kv_heads, m, head_dim), pages cut in the order given."""
        heads, m, dim = keys.shape
        pages = -(-m // PAGE_TOKENS)
        padded = keys.new_zeros(heads, pages * PAGE_TOKENS, dim)
        padded[:, :m] = keys
        # The padding of the last page repeats its first entry, so that it widens no range.
        if m % PAGE_TOKENS:
            padded[:, m:] = keys[:, (pages - 1) * PAGE_TOKENS].unsqueeze(1)
        paged = padded.reshape(heads, pages, PAGE_TOKENS, dim)
        key_low, key_high = half_bounds(paged.amin(dim=2).float(), paged.amax(dim=2).float())
        page_of_entry = torch.arange(m, device=keys.device) // PAGE_TOKENS
        group = value_group(dim)
        groups = values.float().reshape(heads, m, dim // group, group)
        value_low, value_high = half_bounds(groups.amin(dim=3), groups.amax(dim=3))
        return cls(
            key_codes=quantize(keys, key_low[:, page_of_entry], key_high[:, page_of_entry], bits),
            key_low=key_low,
            key_high=key_high,
            value_codes=quantize(values, *_per_channel(value_low, value_high, dim), bits),
            value_low=value_low,
            value_high=value_high,
        )

    def to(self, device: torch.device) -> QuantisedEntries:
        return QuantisedEntries(*(getattr(self, name).to(device) for name in TENSOR_NAMES))

    @property
    def length(self) -> int:
        """m: entries per KV head."""
        return int(self.key_codes.shape[1])

    @property
    def padded_length(self) -> int:
        """m rounded up to whole pages: what `all_keys` writes per channel."""
        return int(self.key_low.shape[1]) * PAGE_TOKENS

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, name).numel() * getattr(self, name).element_size() for name in TENSOR_NAMES)

    def all_keys(self, bits: int, out: Tensor | None = None) -> Tensor:
        """Every dequantised key (kv_heads, m, head_dim) float32, in the stored order.

        Laid out channel-major (a transposed view), so that recall's q.k over them is one contiguous
        product. `out`, when given, is where they are decoded: (kv_heads, head_dim, at least `padded_length`)
        float32 (`infokv_rag.kernels.dequantise_keys`).
        """
        return dequantise_keys(self.key_codes, self.key_low, self.key_high, bits, PAGE_TOKENS, out)

    def decoded(self, bits: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Every key and value (kv_heads, m, head_dim) at `dtype`, in the stored order (keys channel-major)."""
        return self.all_keys(bits).to(dtype), self.all_values(bits).to(dtype)

    def all_values(self, bits: int, out: Tensor | None = None) -> Tensor:
        """Every dequantised value (kv_heads, m, head_dim) float32, in the stored order; decoded into `out` of that
        shape when given."""
        return dequantise_values(self.value_codes, self.value_low, self.value_high, bits, out)
