"""Recall: while a question is prefilled, each layer brings back the cold entries its queries need.

For every layer, the question's queries score each cold entry by the attention it would receive: its
share of each query's softmax over the layer's hot keys (the question's own causally) and all cold keys,
summed over the KV group's query heads and the question's tokens. The best entries, up to the recall
budget per KV head, are dequantised and put into the answer's own working cache ahead of the question,
so the question and the answer attend to them. Scoring reads every cold key of the layer (half of the
cold tier's bytes; values are read only for the recalled entries): page upper bounds of q.k (Quest)
would read less, but ranked the entries that answers need far worse on the real-document dev split
(README, "Cold tier"). The document's cache is never modified: a recall lives and dies with one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import KVCache, gather_tokens
from .cold_tier import ColdTier

NEGLIGIBLE = -80.0
"""A logit this far below a query's largest gets a share of its attention below 1e-34."""

RECALLED_SCORE = 1.0
"""Eviction priority of a recalled entry while answering: as high as the question's own tokens."""


def attention_mass(query: Tensor, cold_keys: Tensor, hot_keys: Tensor, scaling: float) -> Tensor:
    """The attention each cold entry would receive from the question.

    query: (heads, q, head_dim) of the question's q tokens; cold_keys: (kv_heads, m, head_dim); hot_keys:
    (kv_heads, length, head_dim) whose last q are the question's own. Returns (kv_heads, m).
    """
    kv_heads, heads, q = cold_keys.shape[0], query.shape[0], query.shape[1]
    grouped = (query.float() * scaling).reshape(kv_heads, heads // kv_heads * q, -1)
    # Products against channel-major keys are several times faster than against transposed token-major ones.
    cold = torch.bmm(grouped, cold_keys.float().transpose(1, 2).contiguous())
    hot = torch.bmm(grouped, hot_keys.float().transpose(1, 2).contiguous())
    # A question token sees the question only up to itself.
    future = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1).repeat(heads // kv_heads, 1)
    hot[:, :, hot.shape[2] - q :].masked_fill_(future, -torch.inf)
    # One softmax over hot + cold keys per query, in place on the (kv_heads, queries, m) logits: this is
    # most of what recall adds to a question's time to first token. Logits more than -NEGLIGIBLE below the
    # query's largest are floored there: their share (< 1e-34 each) changes no ranking, and exp of them
    # would be a denormal, which CPUs compute tens of times slower.
    top = torch.maximum(cold.amax(dim=2, keepdim=True), hot.amax(dim=2, keepdim=True))
    cold.sub_(top).clamp_min_(NEGLIGIBLE).exp_()
    total = cold.sum(dim=2, keepdim=True) + hot.sub_(top).exp_().sum(dim=2, keepdim=True)
    return torch.bmm(total.reciprocal().transpose(1, 2), cold).squeeze(1)


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
            cold_keys = cold.all_keys(self.cold.bits)
            mass = attention_mass(query[0], cold_keys.to(device), layer.live("keys"), scaling)
            indices = mass.topk(count, dim=1).indices.sort(dim=1).values.cpu()
            layer.insert(
                query.shape[2],
                gather_tokens(cold_keys, indices).to(device=device, dtype=layer.keys.dtype),
                cold.values(indices, self.cold.bits).to(device=device, dtype=layer.values.dtype),
                cold.positions.gather(1, indices).to(device),
                torch.full((count,), RECALLED_SCORE, device=device),
            )
        self.recalled.append(count)
        return layer.live("keys").unsqueeze(0), layer.live("values").unsqueeze(0)
