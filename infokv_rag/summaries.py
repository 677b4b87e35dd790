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


def weighted_kmeans(points: Tensor, weights: Tensor, clusters: int, generator: torch.Generator) -> Tensor:
    """Cluster index of every point: points (count, dim) float32 with weights (count,) >= 0 -> (count,) int64.

    Lloyd's iterations from a k-means++ start (each next centre drawn in proportion to weight times squared
    distance to the nearest centre so far, so a repeated point is never drawn twice); a cluster that
    empties keeps its centre (it may win points back, or stay empty).
    """
    draw_weights = weights + 1e-12  # a point of weight 0 may still be drawn when nothing else is left
    first = int(torch.multinomial(draw_weights.cpu(), 1, generator=generator))
    centres = [points[first]]
    nearest = (points - points[first]).square().sum(dim=1)
    for _ in range(1, clusters):
        chance = (draw_weights * nearest).cpu()
        pick = int(torch.multinomial(chance, 1, generator=generator)) if bool((chance > 0).any()) else first
        centres.append(points[pick])
        nearest = torch.minimum(nearest, (points - points[pick]).square().sum(dim=1))
    centre = torch.stack(centres)
    for _ in range(KMEANS_ITERATIONS):
        assignment = torch.cdist(points, centre).argmin(dim=1)
        mass = torch.zeros(clusters, device=points.device).index_add_(0, assignment, weights)
        sums = torch.zeros_like(centre).index_add_(0, assignment, points * weights[:, None])
        filled = mass > 0
        centre[filled] = sums[filled] / mass[filled, None]
    return torch.cdist(points, centre).argmin(dim=1)


def absorb(summary: EvictedSummary | None, keys: Tensor, values: Tensor, size: int, seed: int) -> EvictedSummary:
    """The summary of what `summary` stood for plus newly evicted entries, at most `size` per KV head.

    keys, values: (kv_heads, evicted, head_dim); fewer points than `size` keep one entry each.
    """
    kv_heads, _, head_dim = keys.shape
    generator = torch.Generator().manual_seed(seed)
    if summary is None:
        summary = EvictedSummary.empty(kv_heads, head_dim, keys.dtype, keys.device)
    points_k = torch.cat([summary.keys.float(), keys.float()], dim=1)
    points_v = torch.cat([summary.values.float(), values.float()], dim=1)
    weights = torch.cat([summary.log_counts.exp(), keys.new_ones(keys.shape[:2], dtype=torch.float32)], dim=1)
    clusters = min(size, points_k.shape[1])
    centres_k, centres_v, log_counts = [], [], []
    for head in range(kv_heads):
        assignment = weighted_kmeans(points_k[head], weights[head], clusters, generator)
        mass = weights.new_zeros(clusters).index_add_(0, assignment, weights[head])
        # An emptied cluster gets log count -inf: attention gives it no weight.
        share = (weights[head] / mass.clamp_min(1e-30)[assignment])[:, None]
        centres_k.append(points_k.new_zeros(clusters, head_dim).index_add_(0, assignment, points_k[head] * share))
        centres_v.append(points_v.new_zeros(clusters, head_dim).index_add_(0, assignment, points_v[head] * share))
        log_counts.append(mass.log())
    return EvictedSummary(
        torch.stack(centres_k).to(keys.dtype), torch.stack(centres_v).to(values.dtype), torch.stack(log_counts)
    )
