"""Recall: while a question is prefilled, each layer brings back the cold entries its queries need.

For every layer, the question attends to every entry the document had: the hot cache, the question's own
tokens (causally) and every cold entry, dequantised, so the question is read as over the full cache, up to the
cold codes' precision. Each cold entry's share of that attention, summed over its KV group's query heads and
the question's tokens, ranks it; the best entries, up to the recall budget per KV head, are put into the
answer's own working cache ahead of the question, and the answer decodes over hot + recalled entries (with
per-head budgets, each head's extras beside them). Attending over everything once costs what scoring alone did
plus one product with the values: the question's queries read every cold key and value of the layer, one layer
at a time, while the answer's tokens read only what was recalled. Page upper bounds of q.k (Quest) would read
less, but ranked the entries that answers need far worse on the real-document dev split (README, "Cold tier").
The document's cache is never modified: a recall lives and dies with one answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .cache import ExtrasLayout, KVCache, gather_tokens
from .cold_tier import ColdTier

NEGLIGIBLE = -80.0
"""A logit this far below a query's largest gets a share of its attention below 1e-34."""

RECALLED_SCORE = 1.0
"""Eviction priority of a recalled entry while answering: as high as the question's own tokens."""


def attend_over_cold(
    query: Tensor,
    cold_keys: Tensor,
    cold_values: Tensor,
    hot_keys: Tensor,
    hot_values: Tensor,
    scaling: float,
    cold_log_counts: Tensor | None = None,
    document: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The question's attention over every entry of a layer, hot and cold, and each cold entry's share of it.

    query: (heads, q, head_dim) of the question's q tokens; cold_keys, cold_values: (kv_heads, m, head_dim);
    hot_keys, hot_values: (kv_heads, length, head_dim) whose last q are the question's own; `document`, when
    given, the keys and values (kv_heads, d, head_dim) of the layer's entries read in place ahead of the hot
    ones (`LayerBuffer.base`), seen by every query.
    Returns the attention output (heads, q, head_dim) float32, what attention over the full cache gives up to
    the cold codes' precision, and the attention mass of each cold entry summed over its KV group's query heads
    and the question's tokens (kv_heads, m). `cold_log_counts` (kv_heads, m), when given, is added to the cold
    logits: a cold entry that stands for several (`infokv_rag.summaries`) weighs in as that many.
    """
    kv_heads, heads, q = cold_keys.shape[0], query.shape[0], query.shape[1]
    grouped = (query.float() * scaling).reshape(kv_heads, heads // kv_heads * q, -1)
    # Products against channel-major keys (what `ColdLayer.all_keys` lays out) are several times faster
    # than against transposed token-major ones.
    cold = torch.bmm(grouped, cold_keys.float().transpose(1, 2))
    if cold_log_counts is not None:
        cold.add_(cold_log_counts.unsqueeze(1))
    hot = torch.bmm(grouped, hot_keys.float().transpose(1, 2))
    # A question token sees the question only up to itself.
    future = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1).repeat(heads // kv_heads, 1)
    hot[:, :, hot.shape[2] - q :].masked_fill_(future, -torch.inf)
    seen = [(hot, hot_values)]
    if document is not None:
        document_keys, document_values = document
        seen.append((torch.bmm(grouped, document_keys.float().transpose(1, 2)), document_values))
    # One softmax over every key per query, in place on the (kv_heads, queries, keys) logits: this is most of
    # what recall adds to a question's time to first token. Logits more than -NEGLIGIBLE below the query's
    # largest are floored there: their share (< 1e-34 each) changes no ranking, and exp of them would be a
    # denormal, which CPUs compute tens of times slower. The hot logits hold each query's own, never -inf.
    top = torch.stack([logits.amax(dim=2) for logits, _ in seen] + ([cold.amax(dim=2)] if cold.shape[2] else []))
    top = top.amax(dim=0).unsqueeze(2)
    cold.sub_(top).clamp_min_(NEGLIGIBLE).exp_()
    total = cold.sum(dim=2, keepdim=True)
    output = torch.bmm(cold, cold_values.float())
    for logits, values in seen:
        logits.sub_(top).exp_()
        total.add_(logits.sum(dim=2, keepdim=True))
        output.add_(torch.bmm(logits, values.float()))
    inverse_total = total.reciprocal_()
    mass = torch.bmm(inverse_total.transpose(1, 2), cold).squeeze(1)
    return output.mul_(inverse_total).reshape(heads, q, -1), mass


@dataclass
class Recall:
    """One answer's recall: up to `tokens` cold entries per (layer, KV head) into `session`.

    The extras of `session` (per-head budgets: the entries some heads keep beyond the layer's length, which
    it attends beside each layer) are in the cold tier too (the question reads every entry once), so a head
    recalls them last, once its other cold entries are all in; one recalled leaves the side entries.
    """

    cold: ColdTier
    session: KVCache
    tokens: int
    recalled: list[int] = field(default_factory=list)
    """Entries recalled per KV head, one count per layer that has run."""

    def attend(self, layer_index: int, query: Tensor, scaling: float) -> Tensor | None:
        """Attention of one layer whose question tokens were just appended to `session`, and its recall.

        query: (1, heads, q, head_dim) of those q tokens. The question attends to every entry of the layer,
        hot and cold (dequantised), as it would over the full cache; the cold entries that received the
        most of that attention, up to the budget per KV head, go into `session` ahead of the question, for
        the answer to decode over. Returns the attention output (1, heads, q, head_dim), or None when the
        layer evicted nothing (plain attention over `session` is then the same).
        """
        cold = self.cold.layers[layer_index]
        layer = self.session.layers[layer_index]
        count = min(self.tokens, cold.length)
        self.recalled.append(count)
        if not cold.length:
            return None
        device = query.device
        cold_keys, cold_values = cold.all_keys(self.cold.bits), cold.all_values(self.cold.bits)
        output, mass = attend_over_cold(
            query[0],
            cold_keys.to(device),
            cold_values.to(device),
            layer.live("keys"),
            layer.live("values"),
            scaling,
            document=layer.base.entries() if layer.base is not None else None,
        )
        side = self.session.summaries[layer_index] if self.session.summaries is not None else None
        extras = side.extras if side is not None else None
        # The cold tier stays in host memory; the extras and the session are on the model's device.
        if extras is not None:
            mass.masked_fill_(extras.held(cold.positions.to(device)), -1.0)  # below any share of attention
        indices = mass.topk(count, dim=1).indices.sort(dim=1).values.cpu()
        positions = cold.positions.gather(1, indices).to(device)
        layer.insert(
            query.shape[2],
            gather_tokens(cold_keys, indices).to(device=device, dtype=layer.keys.dtype),
            gather_tokens(cold_values, indices).to(device=device, dtype=layer.values.dtype),
            positions,
            torch.full((count,), RECALLED_SCORE, device=device),
        )
        if extras is not None:
            self._set_aside(layer_index, extras, positions)
        return output.unsqueeze(0).to(query.dtype)

    def _set_aside(self, layer_index: int, extras: ExtrasLayout, recalled: Tensor) -> None:
        """Turns the side entries of the extras just recalled into the layer (positions `recalled` (kv_heads,
        count)) into padding slots, so that no entry is read twice."""
        assert self.session.summaries is not None
        log_counts = self.session.summaries[layer_index].log_counts  # the working cache's own: extras first
        for head in range(recalled.shape[0]):
            moved = torch.isin(extras.positions[extras.of_head(head)], recalled[head]).to(log_counts.device)
            log_counts[head, : len(moved)].masked_fill_(moved, -torch.inf)
