"""Recall: while a question is prefilled, each layer brings back the cold pages its queries need.

For every layer, the question's queries rank the layer's cold pages by the most attention each page can
draw (the upper bound of q.k from the page's per-channel key range, as Quest does, turned into a softmax
over pages per query head and question token and summed over the KV group's heads and the tokens); the
best pages' entries, up to the recall budget per KV head, are dequantised and put into the answer's own
working cache ahead of the question, so the question and the answer attend to them. The document's
cache is never modified: a recall lives and dies with one answer's working copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import KVCache
from .cold_tier import PAGE_TOKENS, ColdTier

RECALLED_SCORE = 1.0
"""Eviction priority of a recalled entry while answering: as high as the question's own tokens."""


def page_scores(query: Tensor, key_low: Tensor, key_high: Tensor, scaling: float) -> Tensor:
    """How much attention each cold page can draw: query (heads, q, head_dim), page ranges
    (kv_heads, pages, head_dim) -> (kv_heads, pages)."""
    kv_heads, heads = key_low.shape[0], query.shape[0]
    grouped = query.float().reshape(kv_heads, (heads // kv_heads) * query.shape[1], -1)
    # Per channel, q * k is largest at k's max where q > 0 and at its min where q < 0.
    bound = grouped.clamp_min(0) @ key_high.float().transpose(1, 2) + grouped.clamp_max(0) @ key_low.float().transpose(
        1, 2
    )
    return torch.softmax(bound * scaling, dim=-1).sum(dim=1)


def best_entries(scores: Tensor, entries: int, count: int) -> Tensor:
    """Indices (kv_heads, count), ascending, of the entries of the best-scored pages: scores (kv_heads, pages)
    over `entries` entries per head in pages of `PAGE_TOKENS` (the last page may be partial)."""
    order = scores.argsort(dim=1, descending=True, stable=True)
    indices = (order.unsqueeze(-1) * PAGE_TOKENS + torch.arange(PAGE_TOKENS, device=scores.device)).flatten(1)
    # The last page's missing entries go to the end, so each head takes `count` real entries.
    missing = (indices >= entries).to(torch.int8)
    indices = indices.gather(1, missing.argsort(dim=1, stable=True))[:, :count]
    return indices.sort(dim=1).values


@dataclass
class Recall:
    """One answer's recall: up to `tokens` cold entries per (layer, KV head) into `session`."""

    cold: ColdTier
    session: KVCache
    tokens: int
    recalled: list[int] = field(default_factory=list)
    """Entries recalled per KV head, one count per layer that has run."""

    def extend(self, layer_index: int, query: Tensor, scaling: float) -> tuple[Tensor, Tensor]:
        """Recalls for one layer whose question tokens were just appended to `session`.

        query: (1, heads, q, head_dim) of those q tokens. Returns the layer's keys and values
        (1, kv_heads, length, head_dim) with the recalled entries ahead of the question.
        """
        cold = self.cold.layers[layer_index]
        layer = self.session.layers[layer_index]
        count = min(self.tokens, cold.length)
        if count:
            device = query.device
            scores = page_scores(query[0], cold.key_low.to(device), cold.key_high.to(device), scaling)
            indices = best_entries(scores, cold.length, count).cpu()
            keys, values = cold.entries(indices, self.cold.bits)
            layer.insert(
                query.shape[2],
                keys.to(device=device, dtype=layer.keys.dtype),
                values.to(device=device, dtype=layer.values.dtype),
                cold.positions.gather(1, indices).to(device),
                torch.full((count,), RECALLED_SCORE, device=device),
            )
        self.recalled.append(count)
        return layer.live("keys").unsqueeze(0), layer.live("values").unsqueeze(0)
