"""Triton kernels for accumulated / window attention column sums (imported lazily).

Flash-style, two passes, never more than a (BLOCK_Q x BLOCK_K) logits tile per program:

1. ``_lse_kernel``, grid (H, q blocks): per query, an online log-sum-exp (base 2) over the key
   tiles up to the block's causal horizon, stored as (H, q) float32.
2. ``_column_sum_kernel``, grid (H, key blocks): per key tile, loop over the query blocks that can
   see it, recompute the logits, turn them into probabilities with the stored log-sum-exp and sum
   them down each key column. Each output element is owned by one program: no atomics, and the
   result is deterministic.

Queries are the last q of the n positions (query i at absolute position n - q + i) and attend
bottom-right causally; query head h reads KV head h // group. Limits: head dim <= 256 (one tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import triton_interpreter_active

_FLOAT32_MIN = tl.constexpr(torch.finfo(torch.float32).min)

# Triton's interpreter multiplies bf16/fp16 tl.dot operands as their raw integer bit patterns, so
# interpreted runs upcast tiles to float32 before tl.dot (see _triton_entropy.py).
_UPCAST_DOT_OPERANDS = triton_interpreter_active()

_BLOCK_Q = 64
_BLOCK_K = 64
_LOG2E = 1.4426950408889634


@triton.jit
def _load_queries(q_ptr, head, qi, dims, q_len, head_dim, stride_qh, stride_qi, stride_qd, UPCAST: tl.constexpr):
    """(BLOCK_Q, BLOCK_DH) query tile, zero-padded (64-bit head offset: H * q * dh may pass 2**31)."""
    q = tl.load(
        q_ptr + head.to(tl.int64) * stride_qh + qi[:, None] * stride_qi + dims[None, :] * stride_qd,
        mask=(qi[:, None] < q_len) & (dims[None, :] < head_dim),
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def _load_keys_t(k_ptr, kv_head, kj, dims, n, head_dim, stride_kh, stride_kn, stride_kd, UPCAST: tl.constexpr):
    """(BLOCK_DH, BLOCK_K) transposed key tile, zero-padded."""
    k = tl.load(
        k_ptr + kv_head.to(tl.int64) * stride_kh + kj[None, :] * stride_kn + dims[:, None] * stride_kd,
        mask=(kj[None, :] < n) & (dims[:, None] < head_dim),
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
    return k


@triton.jit
def _lse_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    q_len,
    n,
    head_dim,
    group,
    scale_log2,
    stride_qh,
    stride_qi,
    stride_qd,
    stride_kh,
    stride_kn,
    stride_kd,
    UPCAST: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    head = tl.program_id(0)
    qi = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    dims = tl.arange(0, BLOCK_DH)
    offs_k = tl.arange(0, BLOCK_K)
    positions = n - q_len + qi
    q = _load_queries(q_ptr, head, qi, dims, q_len, head_dim, stride_qh, stride_qi, stride_qd, UPCAST)

    # m starts finite: a tile whose logits all overflowed to -inf would otherwise leave m at -inf, and
    # exp2(m - m_new) = exp2(-inf + inf) would be NaN (the dense softmax gives those keys 0).
    m = tl.full((BLOCK_Q,), _FLOAT32_MIN, tl.float32)
    total = tl.zeros((BLOCK_Q,), tl.float32)
    horizon = tl.minimum(n - q_len + tl.program_id(1) * BLOCK_Q + BLOCK_Q, n)
    for k0 in range(0, horizon, BLOCK_K):
        kj = k0 + offs_k
        k = _load_keys_t(k_ptr, head // group, kj, dims, n, head_dim, stride_kh, stride_kn, stride_kd, UPCAST)
        s = tl.dot(q, k, input_precision="ieee") * scale_log2
        s = tl.where((kj[None, :] <= positions[:, None]) & (kj[None, :] < n), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        total = total * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m = m_new
    tl.store(lse_ptr + head.to(tl.int64) * q_len + qi, m + tl.log2(total), mask=qi < q_len)


@triton.jit
def _column_sum_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    out_ptr,
    q_len,
    n,
    head_dim,
    group,
    scale_log2,
    stride_qh,
    stride_qi,
    stride_qd,
    stride_kh,
    stride_kn,
    stride_kd,
    UPCAST: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    head = tl.program_id(0)
    k_start = tl.program_id(1) * BLOCK_K
    kj = k_start + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, BLOCK_DH)
    offs_q = tl.arange(0, BLOCK_Q)
    k = _load_keys_t(k_ptr, head // group, kj, dims, n, head_dim, stride_kh, stride_kn, stride_kd, UPCAST)

    acc = tl.zeros((BLOCK_K,), tl.float32)
    # Queries before absolute position k_start cannot see any key of this tile: start at the
    # query block holding the first one that can.
    first_query = tl.maximum(k_start - (n - q_len), 0)
    for q0 in range((first_query // BLOCK_Q) * BLOCK_Q, q_len, BLOCK_Q):
        qi = q0 + offs_q
        q_ok = qi < q_len
        q = _load_queries(q_ptr, head, qi, dims, q_len, head_dim, stride_qh, stride_qi, stride_qd, UPCAST)
        lse = tl.load(lse_ptr + head.to(tl.int64) * q_len + qi, mask=q_ok, other=0.0)
        s = tl.dot(q, k, input_precision="ieee") * scale_log2
        visible = (kj[None, :] <= (n - q_len + qi)[:, None]) & q_ok[:, None]
        acc += tl.sum(tl.where(visible, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    tl.store(out_ptr + head.to(tl.int64) * n + kj, acc, mask=kj < n)


def accumulated_attention_triton(queries: Tensor, keys: Tensor, scaling: float) -> Tensor:
    """(H, n) float32 column sums; queries (H, q, dh <= 256), keys (Hkv, n, dh), validated by the caller."""
    heads, q_len, head_dim = queries.shape
    kv_heads, n, _ = keys.shape
    # Logits in base 2 (exp2 is the native instruction): scale once by scaling * log2(e).
    scale_log2 = float(scaling) * _LOG2E
    common = dict(
        q_len=q_len,
        n=n,
        head_dim=head_dim,
        group=heads // kv_heads,
        scale_log2=scale_log2,
        stride_qh=queries.stride(0),
        stride_qi=queries.stride(1),
        stride_qd=queries.stride(2),
        stride_kh=keys.stride(0),
        stride_kn=keys.stride(1),
        stride_kd=keys.stride(2),
        # tl.dot needs one operand dtype: mixed inputs meet in float32 tile by tile.
        UPCAST=_UPCAST_DOT_OPERANDS or queries.dtype != keys.dtype,
        BLOCK_Q=_BLOCK_Q,
        BLOCK_K=_BLOCK_K,
        BLOCK_DH=max(16, triton.next_power_of_2(head_dim)),
    )
    lse = torch.empty(heads, q_len, dtype=torch.float32, device=queries.device)
    _lse_kernel[(heads, triton.cdiv(q_len, _BLOCK_Q))](queries, keys, lse, **common)
    out = torch.empty(heads, n, dtype=torch.float32, device=queries.device)
    _column_sum_kernel[(heads, triton.cdiv(n, _BLOCK_K))](queries, keys, lse, out, **common)
    return out
