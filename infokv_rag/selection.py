"""Budgets and top-k selection, shared by every method and by decode-time eviction."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor


def protected_mask(positions: Tensor, tokens_read: int, sink_tokens: int, window: int) -> Tensor:
    """(kv_heads, length) True for attention sinks and the observation window (the last `window` read)."""
    return (positions < sink_tokens) | (positions >= tokens_read - window)


def select_tokens(scores: Tensor, protected: Tensor, budget: int, units: Tensor | None = None) -> Tensor:
    """Indices (kv_heads, budget), ascending per head: every protected token, then the best scores.

    scores, protected: (kv_heads, length). A budget below the protected count keeps the protected
    tokens with the highest positions (the most recent window) first. units: None, or (kv_heads, length) the
    unit (word) of each token where the scores rank units whole: see `_best`.
    """
    length = scores.shape[1]
    if budget >= length:
        return torch.arange(length, device=scores.device).expand(scores.shape[0], -1)
    best = _best(scores, protected, [budget] * scores.shape[0], units)
    return torch.stack(best).sort(dim=1).values


def select_per_head(
    scores: Tensor, protected: Tensor, budgets: list[int], units: Tensor | None = None
) -> tuple[Tensor, list[Tensor]]:
    """Each KV head's best `budgets[h]` tokens, chosen as `select_tokens` chooses them, split in two: the indices
    (kv_heads, min(budgets)) every head keeps as many of (its best, ascending), and per head (budgets[h] -
    min(budgets),) the indices of the rest it keeps (ascending). scores, protected, units: (kv_heads, length)."""
    common = min(budgets)
    best = _best(scores, protected, budgets, units)
    rest = [head[common:].sort().values for head in best]
    return torch.stack([head[:common] for head in best]).sort(dim=1).values, rest


def _best(scores: Tensor, protected: Tensor, budgets: list[int], units: Tensor | None) -> list[Tensor]:
    """Per KV head h, the indices (budgets[h],) of the tokens it keeps, best first (as `_ranked` ranks them).

    With `units` (a word per token, the scores tied within each word), a word is kept whole or not at all: a
    budget that would end inside a scored word leaves that word out and takes in its place the best later words
    that fill its places exactly (`_cut_between_units`). The protected tokens are kept whatever the units: a word
    that the window's edge (or the sinks') runs through keeps its protected part, and its rest ranks by its score
    as a unit of its own.
    """
    ranked = _ranked(scores, protected)
    order = ranked.argsort(dim=1, descending=True)
    if units is None:
        return [order[head, :budget] for head, budget in enumerate(budgets)]
    ranked_units = units.gather(1, order)
    scored = ranked.gather(1, order) < 1.0
    return [
        _cut_between_units(order[head], ranked_units[head], scored[head], budget) for head, budget in enumerate(budgets)
    ]


def _cut_between_units(order: Tensor, units: Tensor, scored: Tensor, budget: int) -> Tensor:
    """The first `budget` of `order` (length,) (token indices, best first), unless the cut falls inside a scored
    unit: then that unit's entries before the cut give way to the best later units that fill their places exactly.
    Where no later units do (a budget near the whole length), the cut stays inside the unit: completing it instead
    would give way the units ranked before it, which may rank first for a reason the scores alone do not tell (the
    numbers a method counts first in every head). `units`, `scored`: (length,) each entry's unit and whether it
    ranks by score (not protected)."""
    if budget == 0 or budget >= len(order) or not bool(scored[budget - 1]):
        return order[:budget]
    if int(units[budget]) != int(units[budget - 1]):
        return order[:budget]
    # Runs of one unit and tier in rank order: a unit's scored entries are adjacent, their scores tied and their
    # ranks broken by position (its protected entries, if any, rank apart, above every score).
    changes = (units[1:] != units[:-1]) | (scored[1:] != scored[:-1])
    bounds = [0, *(changes.nonzero().flatten() + 1).tolist(), len(order)]
    runs = list(zip(bounds[:-1], bounds[1:], strict=True))
    cut = next(index for index, (begin, end) in enumerate(runs) if begin < budget < end)
    start = runs[cut][0]
    later = runs[cut + 1 :]
    fill = _exact_pick([end - begin for begin, end in later], budget - start)
    if fill is None:
        return order[:budget]
    return torch.cat([order[:start], *(order[later[index][0] : later[index][1]] for index in fill)])


def _exact_pick(sizes: list[int], target: int) -> list[int] | None:
    """Indices of `sizes` whose sum is exactly `target`, the earliest entries preferred (each taken when the rest
    can still be made up from the entries after it); None where no choice sums to `target`."""
    # reachable[i]: a bit set of the sums (up to target) that entries i.. can make.
    limit = (1 << (target + 1)) - 1
    reachable = [1] * (len(sizes) + 1)
    for index in range(len(sizes) - 1, -1, -1):
        after = reachable[index + 1]
        reachable[index] = (after | (after << sizes[index])) & limit
    if not reachable[0] >> target & 1:
        return None
    picked, left = [], target
    for index, size in enumerate(sizes):
        if left == 0:
            break
        if size <= left and reachable[index + 1] >> (left - size) & 1:
            picked.append(index)
            left -= size
    return picked


def _ranked(scores: Tensor, protected: Tensor) -> Tensor:
    """(kv_heads, length) ranks to take the top of: protected tokens above every score, later ones first."""
    length = scores.shape[1]
    # Scores become ranks in [0, 1) (order kept, any scale); protected tokens rank above all of them, and
    # among themselves later positions win, so a budget tighter than the protected set keeps the window.
    order = torch.nan_to_num(scores.float(), nan=-torch.inf).argsort(dim=1, stable=True).argsort(dim=1)
    index = torch.arange(length, device=scores.device)
    return torch.where(protected, 2.0 + index / length, order.float() / length)


def adaptive_budgets(scores: list[Tensor], total: int, minimum: int) -> list[int]:
    """Splits `total` tokens over layers: more where the score distribution is flat (many similar tokens).

    scores: per layer (kv_heads, length_l), values >= 0 (a NaN counts as 0). The flatness of a layer is the normalised
    entropy of its scores seen as a distribution, averaged over heads. Each layer gets at least
    `minimum` and at most its length; the sum is exactly `min(total, sum of lengths)`.
    """
    lengths = [layer.shape[1] for layer in scores]
    total = min(total, sum(lengths))
    floors = [min(minimum, length) for length in lengths]
    flatness = []
    for layer in scores:
        weights = layer.float().nan_to_num(nan=0.0).clamp_min(0) + 1e-8  # NaN ranks lowest, as in `_ranked`
        probs = weights / weights.sum(dim=1, keepdim=True)
        entropy = -(probs * probs.log()).sum(dim=1) / math.log(max(layer.shape[1], 2))
        flatness.append(float(entropy.mean()))
    budgets = list(floors)
    remaining = total - sum(budgets)
    active = [i for i in range(len(scores)) if budgets[i] < lengths[i]]
    while remaining > 0 and active:
        # Every layer of a flatness 0 (one token, or all mass on one) shares evenly only when all are: weights
        # and their sum must agree, or the shares pass `remaining`.
        share_weights = {i: flatness[i] for i in active}
        if not any(share_weights.values()):
            share_weights = dict.fromkeys(active, 1.0)
        weight_sum = sum(share_weights.values())
        shares = {i: remaining * share_weights[i] / weight_sum for i in active}
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


def global_budgets(
    scores: list[Tensor], total: int, minimum: int, per_layer: Literal["mean", "max"] = "mean", floor: int = 0
) -> list[int]:
    """Splits `total` tokens over layers by one threshold on scores comparable across layers (KVzip).

    scores: per layer (kv_heads, length_l). A layer gets, over its heads, the mean (`per_layer="mean"`) or
    the most (`"max"`) of how many of each head's scores pass the threshold, at least `minimum` and at most
    its length; the threshold is the one that keeps `total` tokens per KV head overall ("mean"), or the
    highest whose layer shares fit in `total` ("max"); the sum is exactly `min(total, sum of lengths)`.
    A `floor` above `minimum` then lifts every layer to at least that many tokens (or its length), taking
    the difference from the layers above it in proportion to how far above they are.
    """
    lengths, total = _fitted(scores, total, minimum)

    def wanted_at(threshold: Tensor) -> list[float]:
        passing = [(layer.float() >= threshold).sum(dim=1).float() for layer in scores]
        return [float(count.max() if per_layer == "max" else count.mean()) for count in passing]

    if per_layer == "max" and total:
        # The layers' shares only grow as the threshold falls: bisect over the scores for the lowest that fits.
        candidates = torch.cat([layer.float().reshape(-1) for layer in scores]).sort(descending=True).values
        fits, low, high = 0, 0, len(candidates) - 1
        while low <= high:
            middle = (low + high) // 2
            if sum(wanted_at(candidates[middle])) <= total:
                fits, low = middle, middle + 1
            else:
                high = middle - 1
        wanted = wanted_at(candidates[fits])
    else:
        wanted = wanted_at(_threshold(scores, total))
    return _bounded(wanted, lengths, minimum, floor, total)


def per_head_budgets(scores: list[Tensor], total: int, minimum: int, floor: int = 0) -> list[list[int]]:
    """Splits `total` tokens per KV head over every (layer, KV head) by one threshold (KVzip's head budgets).

    scores: per layer (kv_heads, length_l), comparable across layers. Returns per layer, per KV head, how many
    of that head's scores pass the threshold, at least `minimum` and at most the layer's length; the threshold
    keeps `total` tokens per KV head overall, so the sum over every (layer, head) is exactly kv_heads x
    `min(total, sum of lengths)`. Within one layer the heads differ: one may keep nearly every token and
    another only its sinks and window. A `floor` above `minimum` lifts every (layer, head) as `global_budgets`
    lifts every layer.
    """
    heads = scores[0].shape[0]
    lengths, total = _fitted(scores, total, minimum)
    threshold = _threshold(scores, total)
    wanted = [float(count) for layer in scores for count in (layer.float() >= threshold).sum(dim=1)]
    cells = [length for length in lengths for _ in range(heads)]
    flat = _bounded(wanted, cells, minimum, floor, total * heads)
    return [flat[index : index + heads] for index in range(0, len(flat), heads)]


def _fitted(scores: list[Tensor], total: int, minimum: int) -> tuple[list[int], int]:
    """The layers' lengths and `total` capped at their sum; raises when `minimum` per layer does not fit."""
    lengths = [layer.shape[1] for layer in scores]
    total = min(total, sum(lengths))
    if sum(min(minimum, length) for length in lengths) > total:
        raise ValueError(f"{len(scores)} layers of at least {minimum} tokens do not fit in {total}")
    return lengths, total


def _threshold(scores: list[Tensor], total: int) -> Tensor:
    """The score that `total` tokens per KV head over all layers (per layer (kv_heads, length_l)) reach."""
    pooled = torch.cat([layer.float().reshape(-1) for layer in scores])
    return pooled.topk(total * scores[0].shape[0]).values[-1] if total else pooled.new_tensor(torch.inf)


def _bounded(wanted: list[float], lengths: list[int], minimum: int, floor: int, total: int) -> list[int]:
    """Shares of `total`, each at least `minimum` and at most its length; a `floor` above `minimum` lifts them
    first, taking the difference from the shares above it in proportion to how far above they are."""
    if floor > minimum:
        floors = [min(floor, length) for length in lengths]
        wanted = lifted_to_floor([min(length, w) for length, w in zip(lengths, wanted, strict=True)], floors, total)
    else:
        floors = [min(minimum, length) for length in lengths]
    return settled(wanted, floors, lengths, total)


def settled(wanted: list[float], floors: list[int], lengths: list[int], total: int) -> list[int]:
    """`wanted` shares rounded within [floors, lengths], the sum then settled to exactly `total`.

    Rounding and the floors move the sum off `total`: the difference is settled one token at a time on the
    share furthest from what it wanted, within its bounds.
    """
    budgets = [max(low, min(length, round(w))) for low, length, w in zip(floors, lengths, wanted, strict=True)]
    while (excess := sum(budgets) - total) != 0:
        step = -1 if excess > 0 else 1
        movable = [i for i, budget in enumerate(budgets) if floors[i] <= budget + step <= lengths[i]]
        pick = max(movable, key=lambda i: step * (wanted[i] - budgets[i]))
        budgets[pick] += step
    return budgets


def lifted_to_floor(shares: list[float], floors: list[int], total: int) -> list[float]:
    """Per-layer `shares` raised to `floors`, the excess over `total` taken from the layers above their floor
    in proportion to how far above they are (none falls below its floor while `sum(floors) <= total`)."""
    raised = [max(share, low) for share, low in zip(shares, floors, strict=True)]
    above = [share - low for share, low in zip(raised, floors, strict=True)]
    extra, spare = sum(raised) - total, sum(above)
    if extra <= 0 or not spare:
        return raised
    return [share - extra * part / spare for share, part in zip(raised, above, strict=True)]
