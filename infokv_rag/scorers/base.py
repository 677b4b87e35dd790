"""The scorer interface and the small tensor helpers scorers share."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..signals import LayerSignals


class Scorer:
    """One compression method: `score()` ranks one layer's resident tokens; higher is kept.

    Scorers see only `LayerSignals`; protected tokens (sinks, observation window), budgets and cache
    surgery are handled once, in `selection` and the engine.
    """

    needs_window_attention: ClassVar[bool] = True
    needs_information: ClassVar[bool] = False
    needs_accumulated_attention: ClassVar[bool] = False

    def score(self, signals: LayerSignals) -> Tensor:
        """Returns (kv_heads, length) scores for the resident tokens of one layer."""
        raise NotImplementedError


def normalize(scores: Tensor, mode: Literal["minmax", "rank"] = "minmax") -> Tensor:
    """Normalises (kv_heads, length) scores to [0, 1] within each head."""
    scores = scores.float()
    if mode == "rank":
        ranks = scores.argsort(dim=-1).argsort(dim=-1).float()
        return ranks / max(scores.shape[-1] - 1, 1)
    low = scores.amin(dim=-1, keepdim=True)
    span = scores.amax(dim=-1, keepdim=True) - low
    return (scores - low) / span.clamp_min(1e-12)


def pool(scores: Tensor, kernel: int) -> Tensor:
    """1-D average pooling along the sequence: (rows, length) -> (rows, length)."""
    if kernel <= 1:
        return scores
    return F.avg_pool1d(scores.unsqueeze(1), kernel, stride=1, padding=kernel // 2, count_include_pad=False).squeeze(1)


def reduce_groups(per_head: Tensor, kv_heads: int, mode: Literal["mean", "max", "sum"] = "mean") -> Tensor:
    """(heads, length) query-head scores -> (kv_heads, length), over the query heads of each KV group."""
    grouped = per_head.reshape(kv_heads, per_head.shape[0] // kv_heads, per_head.shape[-1])
    if mode == "max":
        return grouped.amax(dim=1)
    return grouped.sum(dim=1) if mode == "sum" else grouped.mean(dim=1)


def recency(signals: LayerSignals) -> Tensor:
    """(kv_heads, length) original positions as floats: later is higher."""
    return signals.positions.float()


def seeded_uniform(signals: LayerSignals) -> Tensor:
    generator = torch.Generator().manual_seed(signals.seed * 1_000_003 + signals.layer * 7919 + signals.tokens_read)
    return torch.rand(signals.positions.shape, generator=generator).to(signals.positions.device)
