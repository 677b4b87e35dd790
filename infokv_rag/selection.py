"""Budgets and top-k selection, shared by every method and by decode-time eviction."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def protected_mask(positions: Tensor, tokens_read: int, sink_tokens: int, window: int) -> Tensor:
    """(kv_heads, length) True for attention sinks and the observation window (the last `window` read)."""
    return (positions < sink_tokens) | (positions >= tokens_read - window)


def select_tokens(scores: Tensor, protected: Tensor, budget: int) -> Tensor:
    """Indices (kv_heads, budget), ascending per head: every protected token, then the best scores.

    scores, protected: (kv_heads, length). A budget below the protected count keeps the protected
    tokens with the highest positions (the most recent window) first.
    """
    length = scores.shape[1]
    if budget >= length:
        return torch.arange(length, device=scores.device).expand(scores.shape[0], -1)
    # Scores become ranks in [0, 1) (order kept, any scale); protected tokens rank above all of them, and
    # among themselves later positions win, so a budget tighter than the protected set keeps the window.
    order = torch.nan_to_num(scores.float(), nan=-torch.inf).argsort(dim=1, stable=True).argsort(dim=1)
    index = torch.arange(length, device=scores.device)
    ranked = torch.where(protected, 2.0 + index / length, order.float() / length)
    return ranked.topk(budget, dim=1).indices.sort(dim=1).values


def adaptive_budgets(scores: list[Tensor], total: int, minimum: int) -> list[int]:
    """Splits `total` tokens over layers: more where the score distribution is flat (many similar tokens).

    scores: per layer (kv_heads, length_l), values >= 0. The flatness of a layer is the normalised
    entropy of its scores seen as a distribution, averaged over heads. Each layer gets at least
    `minimum` and at most its length; the sum is exactly `min(total, sum of lengths)`.
    """
    lengths = [layer.shape[1] for layer in scores]
    total = min(total, sum(lengths))
    floors = [min(minimum, length) for length in lengths]
    flatness = []
    for layer in scores:
        weights = layer.float().clamp_min(0) + 1e-8
        probs = weights / weights.sum(dim=1, keepdim=True)
        entropy = -(probs * probs.log()).sum(dim=1) / math.log(max(layer.shape[1], 2))
        flatness.append(float(entropy.mean()))
    budgets = list(floors)
    remaining = total - sum(budgets)
    active = [i for i in range(len(scores)) if budgets[i] < lengths[i]]
    while remaining > 0 and active:
        weight_sum = sum(flatness[i] for i in active) or float(len(active))
        shares = {i: remaining * (flatness[i] or 1.0) / weight_sum for i in active}
        granted = 0
        for i in active:
            extra = min(int(shares[i]), lengths[i] - budgets[i])
            budgets[i] += extra
            granted += extra
        if granted == 0:
            # Hand out the last few tokens one by one to the flattest layers with room left.
            for i in sorted(active, key=lambda i: -flatness[i])[:remaining]:
                budgets[i] += 1
                granted += 1
        remaining -= granted
        active = [i for i in active if budgets[i] < lengths[i]]
    return budgets
