"""Summaries of evicted entries: what compression drops still weighs in, as a few centroids per KV head.

Evicting a token also removes its share of every later softmax, so a question's attention over a
compressed cache spreads over fewer entries than over the full one and reads differently even where the
answer's own tokens were kept. Per (layer, KV head) the evicted keys are clustered (k-means, weighted by
how many entries each point already stands for) into `size` centroids; each enters attention with its
cluster's mean key and mean value, its log count added to its logit, so a cluster weighs in as its members
would if their keys were its mean (a lower bound of their total, by Jensen). A chunked ingestion folds
each compression's evictions into the summary it has: the clusters' sums and counts are exact, only the
grouping is approximate. Chosen and measured on the real-document splits (README, "Real documents").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .cache import EvictedSummary

KMEANS_ITERATIONS = 10


def nearest_centre(points: Tensor, centres: Tensor) -> Tensor:
    """points (heads, count, dim), centres (heads, clusters, dim) -> (heads, count) index of each point's nearest."""
    return (centres.square().sum(dim=2).unsqueeze(1) - 2 * points @ centres.transpose(1, 2)).argmin(dim=2)


def weighted_kmeans(points: Tensor, weights: Tensor, clusters: int, generator: torch.Generator) -> Tensor:
    """Cluster of every point, per head: points (heads, count, dim) float32 with weights (heads, count) >= 0 ->
    (heads, count) int64; `generator` on the points' device (nothing here waits on the device).

    Lloyd's iterations from a k-means++ start (each next centre drawn in proportion to weight times squared
    distance to the nearest centre so far, so a repeated point is never drawn twice while others are left);
    a cluster that empties keeps its centre (it may win points back, or stay empty).
    """
    heads = torch.arange(points.shape[0], device=points.device)
    squared = points.square().sum(dim=2)
    draw = weights + 1e-12  # a point of weight 0 may still be drawn when nothing else is left

    def distance_to(centre: Tensor) -> Tensor:
        return squared - 2 * (points @ centre.unsqueeze(2)).squeeze(2) + centre.square().sum(dim=1, keepdim=True)

    def drawn(chance: Tensor) -> Tensor:
        chance = chance.clamp_min(0)
        # Every point is a centre already: a duplicate, which empties.
        chance = torch.where(chance.sum(dim=1, keepdim=True) > 0, chance, 1.0)
        # torch.multinomial's own one-sample draw (the argmax of chance over Exp(1) noise), the same draws
        # from the same generator, without its validity checks: each waited on the device, once per centre.
        noise = torch.empty_like(chance).exponential_(1, generator=generator)
        return points[heads, (chance / noise).argmax(dim=1)]

    centres = [drawn(draw)]
    nearest = distance_to(centres[0])
    for _ in range(1, clusters):
        centres.append(drawn(draw * nearest))
        nearest = torch.minimum(nearest, distance_to(centres[-1]))
    centre = torch.stack(centres, dim=1)
    for _ in range(KMEANS_ITERATIONS):
        members = membership(nearest_centre(points, centre), weights, clusters)
        mass = members.sum(dim=2, keepdim=True)
        centre = torch.where(mass > 0, torch.bmm(members, points) / mass.clamp_min(1e-30), centre)
    return nearest_centre(points, centre)


def membership(assignment: Tensor, weights: Tensor, clusters: int) -> Tensor:
    """(heads, clusters, count): each point's weight in the row of its cluster, assignment and weights
    (heads, count); a product with the points sums each cluster's (one matrix product, not a scatter)."""
    members = weights.new_zeros(weights.shape[0], clusters, weights.shape[1])
    return members.scatter_(1, assignment.unsqueeze(1), weights.unsqueeze(1))


def absorb(
    summary: EvictedSummary | None, keys: Tensor, values: Tensor, size: int, seed: int, weights: Tensor | None = None
) -> EvictedSummary:
    """The summary of what `summary` stood for plus newly evicted entries, at most `size` per KV head.

    keys, values: (kv_heads, evicted, head_dim); fewer points than `size` keep one entry each. `weights`
    (kv_heads, evicted), 1 or 0, leaves out the entries of weight 0 (a head that keeps them elsewhere).
    """
    kv_heads, _, head_dim = keys.shape
    generator = torch.Generator(device=keys.device).manual_seed(seed)
    if summary is None:
        summary = EvictedSummary.empty(kv_heads, head_dim, keys.dtype, keys.device)
    points_k = torch.cat([summary.keys.float(), keys.float()], dim=1)
    points_v = torch.cat([summary.values.float(), values.float()], dim=1)
    if weights is None:
        weights = keys.new_ones(keys.shape[:2], dtype=torch.float32)
    weights = torch.cat([summary.log_counts.exp(), weights.float()], dim=1)
    clusters = min(size, points_k.shape[1])
    members = membership(weighted_kmeans(points_k, weights, clusters, generator), weights, clusters)
    mass = members.sum(dim=2)
    # An emptied cluster gets log count -inf: attention gives it no weight.
    share = members / mass.clamp_min(1e-30).unsqueeze(2)
    centre_k, centre_v = torch.bmm(share, points_k), torch.bmm(share, points_v)
    return EvictedSummary(centre_k.to(keys.dtype), centre_v.to(values.dtype), mass.log())
