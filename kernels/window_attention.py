"""Observation-window attention scores (SnapKV / InfoKV's attention term) and GQA group reduction.

The window is the last w document positions. Each window query's causal attention over the n keys
(bottom-right aligned: query i sits at absolute position n - w + i and sees keys 0 .. n - w + i)
is averaged over the w queries. That is the accumulated attention of the window queries divided by
w, so both share one implementation (see :mod:`.accumulated_attention`) and neither materialises
(H x w x n) probabilities at once.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from .accumulated_attention import (
    _KEY_BLOCK,
    _QUERY_BLOCK,
    accumulated_attention,
    accumulated_attention_reference,
)


def window_attention(queries: Tensor, keys: Tensor, scaling: float) -> Tensor:
    """Attention probabilities per key, averaged over the observation-window queries.

    Args:
        queries: (H, w, dh) queries of the last w positions (RoPE applied), w <= n.
        keys: (Hkv, n, dh) keys (RoPE applied); query head h reads KV head h // (H // Hkv).
        scaling: logit scale, usually dh ** -0.5.

    Returns:
        (H, n) float32; each row sums to 1.
    """
    return accumulated_attention(queries, keys, scaling).div_(queries.shape[1])


def window_attention_reference(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    *,
    query_block: int = _QUERY_BLOCK,
    key_block: int = _KEY_BLOCK,
) -> Tensor:
    """PyTorch reference of :func:`window_attention`; same shapes, any device; tiles as in
    :func:`accumulated_attention_reference`."""
    scores = accumulated_attention_reference(queries, keys, scaling, query_block=query_block, key_block=key_block)
    return scores.div_(queries.shape[1])


def group_reduce(scores: Tensor, kv_heads: int, mode: Literal["mean", "max"] = "mean") -> Tensor:
    """Reduce per-query-head scores over each GQA group.

    Args:
        scores: (H, n) per query head; heads h*G .. h*G + G - 1 share KV head h (G = H // kv_heads).
        kv_heads: number of KV heads Hkv, an int; must divide H (H >= 1).
        mode: "mean" or "max" over the G query heads of a group.

    Returns:
        (Hkv, n), same dtype as scores.
    """
    if scores.dim() != 2:
        raise ValueError(f"scores must be (H, n); got {tuple(scores.shape)}")
    heads, n = scores.shape
    # Zero heads would pass the modulo test and give a (kv_heads, n) mean over empty groups: NaN.
    if heads == 0:
        raise ValueError("scores has no query heads (H = 0)")
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads != 0:
        raise ValueError(f"kv_heads ({kv_heads!r}) must be an int that divides the number of query heads ({heads})")
    grouped = scores.reshape(kv_heads, heads // kv_heads, n)
    if mode == "mean":
        return grouped.mean(dim=1)
    if mode == "max":
        return grouped.amax(dim=1)
    raise ValueError(f"mode must be 'mean' or 'max'; got {mode!r}")
