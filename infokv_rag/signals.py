"""What one prefill chunk yields for scoring, kept as small per-token scalars.

Per chunk: the attention of the observation window (the last `window` positions read so far) over every
resident key, the last query's attention, optionally attention accumulated over all queries, and each
layer's relative change of the residual stream. Entropy comes from the final hidden states (engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .kernels import accumulated_attention, window_attention


class SignalCapture:
    """Collects per-layer signals during one chunk's forward pass (fed by the model runner)."""

    def __init__(self, window: int, attention: bool, accumulated: bool) -> None:
        self.window = window
        self.attention = attention
        self.accumulated = accumulated
        self.window_attention: dict[int, Tensor] = {}
        self.last_query_attention: dict[int, Tensor] = {}
        self.accumulated_attention: dict[int, Tensor] = {}
        self.layer_change: dict[int, Tensor] = {}

    def record_attention(self, layer: int, queries: Tensor, keys: Tensor, scaling: float) -> None:
        """queries: (heads, q, head_dim) for this chunk; keys: (kv_heads, resident + q, head_dim)."""
        if self.attention:
            window = min(self.window, queries.shape[1])
            self.window_attention[layer] = window_attention(queries[:, -window:], keys, scaling)
            self.last_query_attention[layer] = window_attention(queries[:, -1:], keys, scaling)
        if self.accumulated:
            self.accumulated_attention[layer] = accumulated_attention(queries, keys, scaling)

    def record_layer_change(self, layer: int, before: Tensor, after: Tensor) -> None:
        """before, after: (q, hidden) residual stream around one decoder layer -> R^l (q,)."""
        delta = (after.float() - before.float()).norm(dim=-1)
        self.layer_change[layer] = delta / (before.float().norm(dim=-1) + 1e-6)


@dataclass
class LayerSignals:
    """Everything a scorer may use for one layer's resident tokens.

    positions: (kv_heads, length) original positions of the resident tokens; keys: (kv_heads, length,
    head_dim); window_attention, last_query_attention: (heads, length) mean attention of the observation
    window and of the last document query (None when the scorer needs no attention); accumulated_attention: (kv_heads, length) or None;
    information: (tokens_read,) outgoing information per position: the entropy of the distribution at t,
    or the surprisal of token t + 1 (CompressionConfig.information);
    evolution: (tokens_read,) this layer's R^l; mean_evolution: (tokens_read,) R averaged over layers;
    sentences: (tokens_read,) int64 index of the sentence each position belongs to.
    """

    layer: int
    tokens_read: int
    positions: Tensor
    keys: Tensor
    window_attention: Tensor | None
    last_query_attention: Tensor | None
    accumulated_attention: Tensor | None
    information: Tensor | None
    evolution: Tensor
    mean_evolution: Tensor
    sentences: Tensor
    seed: int = 0
    kv_heads: int = field(init=False)

    def __post_init__(self) -> None:
        self.kv_heads = int(self.positions.shape[0])

    def at_positions(self, per_position: Tensor) -> Tensor:
        """(tokens_read,) -> (kv_heads, length) values of the resident tokens."""
        return per_position[self.positions]

    def sentence_mean(self, per_position: Tensor) -> Tensor:
        """(tokens_read,) -> (tokens_read,): each position gets the mean over its sentence."""
        count = int(self.sentences[-1]) + 1
        sums = per_position.new_zeros(count).index_add_(0, self.sentences, per_position)
        sizes = torch.bincount(self.sentences, minlength=count).clamp_min(1)
        return (sums / sizes)[self.sentences]

    def incoming_information(self) -> Tensor:
        """(tokens_read,): the information of p(. | x_<t) credited to token t (for surprisal, -log p(x_t |
        x_<t)); 0 for the first token."""
        return torch.cat([self._information().new_zeros(1), self._information()[:-1]])

    def outgoing_information(self) -> Tensor:
        """(tokens_read,): the information of p(. | x_<=t) credited to token t."""
        return self._information()

    def _information(self) -> Tensor:
        if self.information is None:
            raise RuntimeError("the information signal was not computed for this compression")
        return self.information
