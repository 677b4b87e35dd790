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
from .cold_tier import ColdLayer, ColdTier

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
    # Products against channel-major keys (what `recall_candidates` lays out) are several times faster
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
    # A part with no keys (no cold entry, or a layer that kept none of the document's) has no largest logit.
    parts = [logits for logits, _ in seen if logits.shape[2]] + ([cold] if cold.shape[2] else [])
    top = torch.stack([logits.amax(dim=2) for logits in parts])
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


def recall_candidates(
    cold: ColdLayer, bits: int, extras: ExtrasLayout | None, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Every entry of one layer that the hot layer does not hold, per KV head: the head's cold entries
    (dequantised), then its extras (the entries it keeps beyond the layer, when heads' budgets differ).

    Returns keys (kv_heads, c, head_dim) float32, laid out channel-major (see `attend_over_cold`), values
    (kv_heads, c, head_dim) float32, positions (kv_heads, c) and `beside` (kv_heads, c) bool, True for an extra;
    c is the same for every head: the document's tokens less the layer's length.
    """
    counts = [m + int(extras.counts[head]) if extras is not None else m for head, m in enumerate(cold.lengths)]
    if len(set(counts)) > 1:
        raise ValueError(f"the heads' cold entries and extras do not add up to one count: {counts}")
    heads, count, dim = len(counts), counts[0], cold.heads[0].key_low.shape[2]
    # Decoded in place: a head's last page writes up to a page past its entries, before its extras go there.
    width = max([count, *(entries.padded_length for entries in cold.heads)])
    on_host = device.type == "cpu"
    keys = torch.empty(heads, dim, width, device=device)
    values = torch.empty(heads, count, dim, device=device)
    positions = torch.empty(heads, count, dtype=torch.long, device=device)
    beside = torch.zeros(heads, count, dtype=torch.bool, device=device)
    for head, entries in enumerate(cold.heads):
        m = entries.length
        if on_host:
            entries.all_keys(bits, out=keys[head : head + 1])
            entries.all_values(bits, out=values[head : head + 1, :m])
        else:  # the codes stay in host memory: decoded there, then copied over
            keys[head, :, :m] = entries.all_keys(bits)[0].T
            values[head, :m] = entries.all_values(bits)[0]
        positions[head, :m] = cold.positions[head]
    if extras is not None:
        flat_keys, flat_values = extras.entries()
        for head, m in enumerate(cold.lengths):
            rows = extras.of_head(head)
            keys[head, :, m:count] = flat_keys[rows].T
            values[head, m:] = flat_values[rows]
            positions[head, m:] = extras.positions[rows]
            beside[head, m:] = True
    return keys[:, :, :count].transpose(1, 2), values, positions, beside


@dataclass
class Recall:
    """One answer's recall: up to `tokens` cold entries per (layer, KV head) into `session`.

    The question reads every entry of each layer once: the hot ones, the cold ones and the extras of `session`
    (per-head budgets: the entries some heads keep beyond the layer's length, which the answer attends beside
    each layer). A head recalls its extras last, once its cold entries are all in; one recalled leaves the side
    entries.
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
        layer = self.session.layers[layer_index]
        side = self.session.summaries[layer_index] if self.session.summaries is not None else None
        extras = side.extras if side is not None else None
        # The cold tier stays in host memory; the extras and the session are on the model's device.
        keys, values, positions, beside = recall_candidates(
            self.cold.layers[layer_index], self.cold.bits, extras, query.device
        )
        count = min(self.tokens, positions.shape[1])
        self.recalled.append(count)
        if not positions.shape[1]:
            return None
        output, mass = attend_over_cold(
            query[0],
            keys,
            values,
            layer.live("keys"),
            layer.live("values"),
            scaling,
            document=layer.base.entries() if layer.base is not None else None,
        )
        mass.masked_fill_(beside, -1.0)  # below any share of attention
        indices = mass.topk(count, dim=1).indices.sort(dim=1).values
        recalled = positions.gather(1, indices)
        layer.insert(
            query.shape[2],
            gather_tokens(keys, indices).to(layer.keys.dtype),
            gather_tokens(values, indices).to(layer.values.dtype),
            recalled,
            torch.full((count,), RECALLED_SCORE, device=query.device),
        )
        if extras is not None:
            self._set_aside(layer_index, extras, recalled)
        return output.unsqueeze(0).to(query.dtype)

    def _set_aside(self, layer_index: int, extras: ExtrasLayout, recalled: Tensor) -> None:
        """Turns the side entries of the extras just recalled into the layer (positions `recalled` (kv_heads,
        count)) into padding slots, so that no entry is read twice."""
        assert self.session.summaries is not None
        log_counts = self.session.summaries[layer_index].log_counts  # the working cache's own: extras first
        for head in range(recalled.shape[0]):
            moved = torch.isin(extras.positions[extras.of_head(head)], recalled[head]).to(log_counts.device)
            log_counts[head, : len(moved)].masked_fill_(moved, -torch.inf)
