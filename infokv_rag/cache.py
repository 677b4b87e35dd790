"""KV caches with per-layer lengths and original positions.

Keys are stored after RoPE, so an evicted token needs no re-rotation: the kept tokens keep their
original positions and later tokens continue at position n, the uncompressed document length.
Within one layer every KV head keeps the same number of tokens, but each head may keep different ones; with
per-head budgets the tokens some heads keep beyond that are held beside the layer (`HeadExtras`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


class AnswerLayer(Protocol):
    """One layer of a document's cache as an answer reads it in place (`LayerBuffer.base`).

    positions, scores: (kv_heads, length) as `LayerKV` has them; `entries()`: its keys and values at the model's
    dtype, (kv_heads, length, head_dim) each: the held tensors themselves, or a decode made for that one read.
    """

    @property
    def positions(self) -> Tensor: ...

    @property
    def scores(self) -> Tensor: ...

    @property
    def length(self) -> int: ...

    def entries(self) -> tuple[Tensor, Tensor]: ...


@dataclass
class LayerKV:
    """One layer of a frozen document cache.

    keys, values: (kv_heads, length, head_dim); positions: (kv_heads, length) int64, ascending per head;
    scores: (kv_heads, length) float32 in [0, 1], the eviction priority (higher is kept longer).
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    scores: Tensor

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    def entries(self) -> tuple[Tensor, Tensor]:
        """The keys and values themselves (`AnswerLayer`): an answer reads them in place."""
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass
class EvictedSummary:
    """Entries attended beside one layer's own, each standing for one or more of the document's entries.

    Stand-ins for the entries the layer evicted (`infokv_rag.summaries`: each cluster's mean key and mean
    value) and, while one layer attends, the tokens some heads hold beyond the layer's length
    (`SideEntries.materialised`). keys, values: (kv_heads, m, head_dim); log_counts: (kv_heads, m) float32, the
    log of how many entries each stands for (-inf: none, a padding slot), added to its attention logit.
    """

    keys: Tensor
    values: Tensor
    log_counts: Tensor

    @classmethod
    def empty(cls, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> EvictedSummary:
        keys = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        return cls(keys, keys.clone(), torch.empty(kv_heads, 0, device=device))

    @property
    def length(self) -> int:
        return int(self.keys.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.log_counts))


class ExtrasLayout(ABC):
    """The tokens some KV heads of one layer keep beyond the layer's common length (`layer_budgets="per_head"`:
    a layer's heads may keep different numbers of tokens, and the layer holds as many per head as its least
    needy head keeps), as an answer reads them: held at the model's dtype (`HeadExtras`) or in codes
    (`infokv_rag.coded_cache.ExtrasOnRead`).

    positions: (entries,) int64, each entry's document position, head 0's entries first, then head 1's, ...;
    counts: (kv_heads,) int64, how many each head holds (summing to entries).
    """

    positions: Tensor
    counts: Tensor

    @abstractmethod
    def entries(self) -> tuple[Tensor, Tensor]:
        """Keys and values (entries, head_dim) each, at the model's dtype, in `positions`' order."""

    def of_head(self, head: int) -> slice:
        """The rows of head `head`'s entries."""
        start = int(self.counts[:head].sum())
        return slice(start, start + int(self.counts[head]))

    @property
    def most(self) -> int:
        """The most entries any head holds."""
        return int(self.counts.max()) if self.counts.numel() else 0

    def slot_log_counts(self) -> Tensor:
        """(kv_heads, most) float32, the log counts of the padded slots (`padded`): 0 for an entry, -inf for
        the slots of a head that holds fewer."""
        slot = torch.arange(self.most).expand(self.counts.shape[0], -1)
        empty = (slot >= self.counts.unsqueeze(1)).to(self.positions.device)
        return torch.zeros(empty.shape, device=self.positions.device).masked_fill_(empty, -torch.inf)

    def padded(self) -> EvictedSummary:
        """The entries as a question attends to them: (kv_heads, most, head_dim), each exact (log count 0),
        the slots of a head that holds fewer at log count -inf."""
        flat_keys, flat_values = self.entries()
        log_counts = self.slot_log_counts()
        filled = log_counts == 0
        keys = flat_keys.new_zeros(filled.shape[0], self.most, flat_keys.shape[1])
        values = torch.zeros_like(keys)
        keys[filled], values[filled] = flat_keys, flat_values
        return EvictedSummary(keys, values, log_counts)


@dataclass
class HeadExtras(ExtrasLayout):
    """A layer's extras at the model's dtype (`ExtrasLayout`), stored flat, so they cost their own bytes and no
    padding. keys, values: (entries, head_dim), in `positions`' order."""

    keys: Tensor
    values: Tensor
    positions: Tensor
    counts: Tensor

    @classmethod
    def gathered(cls, keys: Tensor, values: Tensor, positions: Tensor, indices: list[Tensor]) -> HeadExtras:
        """Head h's entries `indices[h]` of keys, values (kv_heads, length, head_dim) at positions (kv_heads,
        length)."""
        return cls(
            torch.cat([keys[head, chosen] for head, chosen in enumerate(indices)]),
            torch.cat([values[head, chosen] for head, chosen in enumerate(indices)]),
            torch.cat([positions[head, chosen] for head, chosen in enumerate(indices)]),
            torch.tensor([len(chosen) for chosen in indices], dtype=torch.long),
        )

    def entries(self) -> tuple[Tensor, Tensor]:
        """The keys and values themselves: an answer reads them in place."""
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values and the per-head counts (positions, like a layer's, are not counted)."""
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.counts))


@dataclass
class SideEntries:
    """What a question attends beside one layer's own entries: the heads' extras (per-head budgets), then the
    layer's summaries. The extras are the document's, read in place and never copied: they are padded to the
    neediest head's count (`HeadExtras.padded`) only while this layer attends (`materialised`), so an answer
    holds one layer's padding at a time, not every layer's.

    log_counts: (kv_heads, most + m) float32, this answer's own: the extras' slots (0, or -inf for a padding
    slot and for an extra that recall has brought into the layer) then the summaries' log counts.
    """

    extras: ExtrasLayout | None
    summary: EvictedSummary | None
    log_counts: Tensor

    @classmethod
    def of(cls, extras: ExtrasLayout | None, summary: EvictedSummary | None) -> SideEntries:
        own = [] if extras is None else [extras.slot_log_counts()]
        return cls(extras, summary, torch.cat(own + ([] if summary is None else [summary.log_counts.float()]), dim=1))

    @property
    def length(self) -> int:
        return int(self.log_counts.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes the answer holds beside the layer: its log counts. The extras and the summaries are the
        document's, read in place (extras in codes are decoded only while the layer attends)."""
        return self.log_counts.numel() * self.log_counts.element_size()

    def materialised(self) -> EvictedSummary:
        """The entries as one layer attends to them, (kv_heads, length, head_dim), with this answer's log counts.
        Runs for every layer of every forward pass, so a lone part is used as it is rather than copied again."""
        parts = [self.extras.padded()] if self.extras is not None else []
        parts += [self.summary] if self.summary is not None else []
        if len(parts) == 1:
            return EvictedSummary(parts[0].keys, parts[0].values, self.log_counts)
        keys = torch.cat([part.keys for part in parts], dim=1)
        return EvictedSummary(keys, torch.cat([part.values for part in parts], dim=1), self.log_counts)


class ResidentCache(ABC):
    """A document's compressed cache as it is held between answers (`DocumentCache` at the model's dtype, or
    `infokv_rag.coded_cache.CodedCache` in codes), and what every answer makes of it: a working cache."""

    document_tokens: int
    """n: the uncompressed length, and the position the first question token takes."""
    sink_tokens: int
    """Leading positions that are never evicted (attention sinks, and the prompt head when protected)."""
    summaries: list[EvictedSummary] | None
    """Per layer, the stand-ins for its evicted entries, when the config keeps them."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of what is held: keys and values (or their codes), summaries and extras."""

    @abstractmethod
    def layer_positions(self) -> list[Tensor]:
        """Per layer, the positions (kv_heads, length) of its own entries, ascending per head."""

    @abstractmethod
    def extra_positions(self) -> list[tuple[Tensor, Tensor]] | None:
        """Per layer, with per-head budgets, the extras' positions (entries,), head 0's first, and how many each KV
        head holds (kv_heads,) (`HeadExtras`)."""

    @abstractmethod
    def answer_layers(self) -> Iterator[AnswerLayer]:
        """Each layer as an answer reads it in place, its entries at the model's dtype."""

    @abstractmethod
    def answer_extras(self) -> Sequence[ExtrasLayout] | None:
        """Per layer, the extras as an answer reads them in place, their entries at the model's dtype."""

    @abstractmethod
    def working_layout(self) -> tuple[int, int, torch.dtype, torch.device]:
        """kv_heads, head_dim, dtype and device of an answer's working cache."""

    @property
    def lengths(self) -> list[int]:
        return [int(positions.shape[1]) for positions in self.layer_positions()]

    @property
    def kept_per_layer(self) -> list[int]:
        """Tokens each layer keeps per KV head: its length, plus the mean of its heads' extras."""
        extras = self.extra_positions()
        if extras is None:
            return self.lengths
        counts = [count for _, count in extras]
        return [
            length + round(int(count.sum()) / len(count)) for length, count in zip(self.lengths, counts, strict=True)
        ]

    @property
    def mean_kept_tokens(self) -> float:
        """Tokens kept over all layers per KV head, unrounded: the layers' lengths plus the mean over KV heads of
        all their extras (`kept_per_layer` rounds each layer, so its sum may be off by a token per two layers)."""
        extras = self.extra_positions()
        if extras is None:
            return float(sum(self.lengths))
        return sum(self.lengths) + sum(int(count.sum()) for _, count in extras) / len(extras[0][1])

    def beside_tokens(self, summaries: bool = True) -> int:
        """The most entries a question attends beside any layer's own (per KV head): the extras, and the
        summaries if `summaries`."""
        layout = self.extra_positions()
        nothing = [0] * len(self.lengths)
        extras = [int(count.max()) if count.numel() else 0 for _, count in layout] if layout else nothing
        stand_ins = [summary.length for summary in self.summaries] if self.summaries and summaries else nothing
        return max(map(sum, zip(extras, stand_ins, strict=True)), default=0)

    def kept_positions(self, layer: int) -> list[Tensor]:
        """Per KV head, the document positions layer `layer` keeps for it (its own, then its extras)."""
        own = self.layer_positions()[layer]
        extras = self.extra_positions()
        if extras is None:
            return list(own)
        positions, counts = extras[layer]
        return [torch.cat(pair) for pair in zip(own, positions.split(counts.tolist()), strict=True)]

    def working_cache(self, extra_tokens: int, summaries: bool = True) -> KVCache:
        """A working cache for answering a question: each layer reads the document's entries (`answer_layers`)
        in place, holding none of them, and has room for `extra_tokens` of its own; beside each layer, what it
        attends (`SideEntries`: the extras, then the summaries if `summaries`; an answer that recalls from the
        cold tier reads what they stand for itself). What is held stays untouched: `LayerBuffer.materialise`
        copies a layer's document entries in before anything would change them."""
        cache = KVCache(len(self.lengths), *self.working_layout())
        for buffer, layer in zip(cache.layers, self.answer_layers(), strict=True):
            buffer.read_in_place(layer, capacity=extra_tokens)
        extras, stand_ins = self.answer_extras(), self.summaries if summaries else None
        if extras is not None or stand_ins is not None:
            nothing: list[None] = [None] * len(cache.layers)
            cache.summaries = [
                SideEntries.of(extra, summary)
                for extra, summary in zip(extras or nothing, stand_ins or nothing, strict=True)
            ]
        return cache


@dataclass
class DocumentCache(ResidentCache):
    """The compressed cache of one document at the model's dtype; never modified after ingestion."""

    layers: list[LayerKV]
    document_tokens: int
    sink_tokens: int = 4
    summaries: list[EvictedSummary] | None = None
    extras: list[HeadExtras] | None = None
    """Per layer, the tokens some KV heads keep beyond the layer's length, with per-head budgets."""

    @property
    def nbytes(self) -> int:
        """Bytes of stored keys and values, summaries and extras included."""
        side: list[EvictedSummary | HeadExtras] = [*(self.summaries or []), *(self.extras or [])]
        return sum(layer.nbytes for layer in self.layers) + sum(entries.nbytes for entries in side)

    def layer_positions(self) -> list[Tensor]:
        return [layer.positions for layer in self.layers]

    def extra_positions(self) -> list[tuple[Tensor, Tensor]] | None:
        return None if self.extras is None else [(extra.positions, extra.counts) for extra in self.extras]

    def answer_layers(self) -> Iterator[AnswerLayer]:
        return iter(self.layers)

    def answer_extras(self) -> Sequence[ExtrasLayout] | None:
        """The document's own extras: an answer reads them in place (`SideEntries`)."""
        return self.extras

    def working_layout(self) -> tuple[int, int, torch.dtype, torch.device]:
        keys = self.layers[0].keys
        return keys.shape[0], keys.shape[2], keys.dtype, keys.device


def gather_tokens(tensor: Tensor, indices: Tensor) -> Tensor:
    """Picks tokens per head: tensor (kv_heads, length, ...) and indices (kv_heads, k) -> (kv_heads, k, ...)."""
    index = indices.reshape(*indices.shape, *([1] * (tensor.dim() - 2))).expand(-1, -1, *tensor.shape[2:])
    return torch.gather(tensor, 1, index)


class LayerBuffer:
    """Preallocated storage of one layer that grows by doubling; the first `length` slots are live.

    An answer's layer reads the document's entries in place (`base`, ahead of its own) and stores only its own:
    recalled entries, the question and the answer so far. `materialise` copies the base in, for whatever must
    change or see the whole layer at once (decode-time eviction, a signal capture).
    """

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.positions = torch.empty(kv_heads, 0, dtype=torch.long, device=device)
        self.scores = torch.empty(kv_heads, 0, dtype=torch.float32, device=device)
        self.length = 0
        self.base: AnswerLayer | None = None
        """Entries read in place ahead of the live ones, never modified; None once materialised (or never set)."""

    @property
    def base_length(self) -> int:
        return self.base.length if self.base is not None else 0

    @property
    def total_length(self) -> int:
        """Entries the layer attends: the base, then the live ones."""
        return self.base_length + self.length

    def _reserve(self, capacity: int) -> None:
        if capacity <= self.keys.shape[1]:
            return
        capacity = max(capacity, 2 * self.keys.shape[1])
        for name in ("keys", "values", "positions", "scores"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[0], capacity, *old.shape[2:])
            new[:, : self.length] = old[:, : self.length]
            setattr(self, name, new)

    def read_in_place(self, layer: AnswerLayer, capacity: int) -> None:
        """Reads `layer` in place as the base, with nothing live yet and room for `capacity` entries."""
        self._reserve(capacity)
        self.base, self.length = layer, 0

    def materialise(self) -> None:
        """Copies the base in ahead of the live entries, so that the live entries are the whole layer."""
        if self.base is None:
            return
        base, added = self.base, self.base.length
        self._reserve(self.length + added)
        keys, values = base.entries()
        for name, held in (("keys", keys), ("values", values), ("positions", base.positions), ("scores", base.scores)):
            buffer = getattr(self, name)
            buffer[:, added : added + self.length] = buffer[:, : self.length].clone()
            buffer[:, :added] = held
        self.length += added
        self.base = None

    def append(self, keys: Tensor, values: Tensor, positions: Tensor, scores: Tensor) -> None:
        """keys, values: (kv_heads, q, head_dim); positions: (q,); scores: (q,)."""
        added = keys.shape[1]
        self._reserve(self.length + added)
        end = self.length + added
        self.keys[:, self.length : end] = keys
        self.values[:, self.length : end] = values
        self.positions[:, self.length : end] = positions
        self.scores[:, self.length : end] = scores
        self.length = end

    def insert(self, before_last: int, keys: Tensor, values: Tensor, positions: Tensor, scores: Tensor) -> None:
        """Inserts entries ahead of the last `before_last` ones (which stay last, for the causal mask).

        keys, values: (kv_heads, k, head_dim); positions: (kv_heads, k); scores: (k,).
        """
        added = keys.shape[1]
        self._reserve(self.length + added)
        start, end = self.length - before_last, self.length + added
        for name, new in (("keys", keys), ("values", values), ("positions", positions), ("scores", scores)):
            buffer = getattr(self, name)
            buffer[:, start + added : end] = buffer[:, start : self.length].clone()
            buffer[:, start : start + added] = new
        self.length = end

    def live(self, name: str) -> Tensor:
        return getattr(self, name)[:, : self.length]

    def retain(self, indices: Tensor) -> None:
        """Keeps tokens `indices` (kv_heads, k), ascending per head, and drops the rest."""
        kept = {name: gather_tokens(self.live(name), indices) for name in ("keys", "values", "positions", "scores")}
        self.length = indices.shape[1]
        for name, tensor in kept.items():
            getattr(self, name)[:, : self.length] = tensor

    def evict(self, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Keeps tokens `indices` like `retain`; returns what it drops: keys, values (kv_heads, dropped,
        head_dim) and positions (kv_heads, dropped), in buffer order (every head drops as many)."""
        heads = indices.shape[0]
        kept = torch.zeros(heads, self.length, dtype=torch.bool, device=indices.device).scatter_(1, indices, True)
        dropped_indices = (~kept).nonzero()[:, 1].reshape(heads, -1)
        keys, values, positions = (
            gather_tokens(self.live(name), dropped_indices) for name in ("keys", "values", "positions")
        )
        self.retain(indices)
        return keys, values, positions

    def freeze(self) -> LayerKV:
        self.materialise()
        return LayerKV(*(self.live(name).clone() for name in ("keys", "values", "positions", "scores")))


class KVCache:
    """A mutable per-layer cache that transformers' attention layers append to.

    The model runner sets `pending_positions` (q,) and `pending_scores` (q,) before each forward; every
    layer's `update` appends its new keys and values with them and returns the layer's live tensors
    (1, kv_heads, length, head_dim), which is what the attention layers expect; a layer that reads a base in
    place (`LayerBuffer`) is attended over it too (`infokv_rag.model_runner`). `summaries`, when set, are
    attended to beside every layer's entries (never modified, never evicted).
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.layers = [LayerBuffer(kv_heads, head_dim, dtype, device) for _ in range(num_layers)]
        self.summaries: list[SideEntries] | None = None
        self.pending_positions = torch.empty(0, dtype=torch.long, device=device)
        self.pending_scores = torch.empty(0, dtype=torch.float32, device=device)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        layer = self.layers[layer_idx]
        layer.append(key_states[0], value_states[0], self.pending_positions, self.pending_scores)
        return layer.live("keys").unsqueeze(0), layer.live("values").unsqueeze(0)

    @property
    def lengths(self) -> list[int]:
        """Entries each layer attends (per KV head): its base and its live ones."""
        return [layer.total_length for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values this cache holds over all layers: the live ones (not the bases it reads in
        place) and what it holds beside each layer (`SideEntries.nbytes`)."""
        entries = sum(2 * layer.live("keys").numel() * layer.keys.element_size() for layer in self.layers)
        return entries + sum(summary.nbytes for summary in self.summaries or [])

    def materialise(self) -> None:
        """Copies every layer's base in (`LayerBuffer.materialise`)."""
        for layer in self.layers:
            layer.materialise()

    @property
    def attended(self) -> list[int]:
        """Entries each layer attends (per KV head): its own (`lengths`) and those beside it (`summaries`)."""
        beside = [summary.length for summary in self.summaries] if self.summaries else [0] * len(self.layers)
        return [length + side for length, side in zip(self.lengths, beside, strict=True)]

    @property
    def resident_tokens(self) -> int:
        """Tokens held over all layers (per KV head)."""
        return sum(self.lengths)

    def rollback(self, lengths: list[int]) -> None:
        """Drops every entry appended after the cache had these per-layer `lengths`."""
        for layer, length in zip(self.layers, lengths, strict=True):
            if not layer.base_length <= length <= layer.total_length:
                raise ValueError(
                    f"cannot roll a layer of {layer.total_length} entries ({layer.base_length} read in place) "
                    f"back to {length}"
                )
            layer.length = length - layer.base_length

    def freeze(
        self,
        document_tokens: int,
        sink_tokens: int,
        summaries: list[EvictedSummary] | None = None,
        extras: list[HeadExtras] | None = None,
    ) -> DocumentCache:
        layers = [layer.freeze() for layer in self.layers]
        return DocumentCache(layers, document_tokens, sink_tokens, summaries, extras)
