"""Triton kernel for :func:`infokv_rag.kernels.entropy.predictive_entropy` (imported lazily).

One program owns BLOCK_N tokens and sweeps the whole vocabulary in BLOCK_V tiles, computing each
(BLOCK_N x BLOCK_V) logits tile with tl.dot over BLOCK_D slices of the hidden size, so logits only
ever exist in registers:

* full vocabulary (TOP_K == 0): an online log-sum-exp carrying, per token, the running max m,
  s = sum exp(z - m) and t = sum exp(z - m) * (z - m); H = log s - t / s. As in the reference,
  a -inf logit contributes 0 (not 0 * -inf = NaN) to t, and m starts at the most negative float32
  rather than -inf, so that tiles whose logits are all -inf add nothing.
* top-k (1 <= TOP_K <= 64): a running top-k list per token in registers (K_PAD = next power of
  two >= TOP_K slots). Tile values enter it by repeated max extraction, only while some row's tile
  max beats its current k-th best, which after the first tiles is rare. (tl.topk's bitonic network
  is exact too, but costs a full partial sort per tile and is ~100x slower in the interpreter.)

Limits: top_k <= 64 (registers); any n, V and d (all masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dispatch import triton_interpreter_active

# Triton's interpreter multiplies bf16/fp16 tl.dot operands as their raw integer bit patterns, so
# interpreted runs upcast tiles to float32 before tl.dot. Compiled runs keep half-precision
# operands on the tensor cores; the products are exact in the float32 accumulator either way.
_UPCAST_DOT_OPERANDS = triton_interpreter_active()

_BLOCK_N = 64
_BLOCK_V = 128
_BLOCK_D = 64
_FLOAT32_MIN = tl.constexpr(torch.finfo(torch.float32).min)


@triton.jit
def _xlogy_terms(e, zc):
    """e * zc with e = exp(zc), but 0 where e == 0: a -inf logit's 0 * -inf is 0 log 0 = 0 (NaN stays NaN)."""
    return tl.where(e == 0.0, 0.0, e * zc)


@triton.jit
def _entropy_kernel(
    h_ptr,
    w_ptr,
    out_ptr,
    n,
    vocab,
    hidden_size,
    stride_hn,
    stride_hd,
    stride_wv,
    stride_wd,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    # 64-bit row/column offsets: V * d passes 2**31 for large vocabularies and hidden sizes.
    row_offsets = rows.to(tl.int64) * stride_hn
    offs_v = tl.arange(0, BLOCK_V)
    offs_d = tl.arange(0, BLOCK_D)

    if TOP_K == 0:
        m = tl.full((BLOCK_N,), _FLOAT32_MIN, tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        t = tl.zeros((BLOCK_N,), tl.float32)
    else:
        # Running top-k per token, unsorted; slots >= TOP_K (padding up to K_PAD) stay unused.
        slots = tl.arange(0, K_PAD)
        slot_ok = slots[None, :] < TOP_K
        best = tl.full((BLOCK_N, K_PAD), float("-inf"), tl.float32)
        # The running max skips NaN where the reference's topk takes it as the largest logit: counted apart, a
        # NaN logit makes its row's entropy NaN in both paths.
        nan_logits = tl.zeros((BLOCK_N,), tl.int32)

    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + offs_v
        col_ok = cols < vocab
        col_offsets = cols.to(tl.int64) * stride_wv
        z = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for d0 in range(0, hidden_size, BLOCK_D):
            dims = d0 + offs_d
            dim_ok = dims < hidden_size
            h = tl.load(
                h_ptr + row_offsets[:, None] + dims[None, :] * stride_hd,
                mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + col_offsets[None, :] + dims[:, None] * stride_wd,
                mask=col_ok[None, :] & dim_ok[:, None],
                other=0.0,
            )
            if UPCAST:
                h = h.to(tl.float32)
                w = w.to(tl.float32)
            z = tl.dot(h, w, z, input_precision="ieee")
        z = tl.where(col_ok[None, :], z, float("-inf"))

        if TOP_K == 0:
            # m starts finite, so m_new is finite; padded columns give exp(-inf) = 0.
            m_new = tl.maximum(m, tl.max(z, axis=1))
            zc = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
            e = tl.where(col_ok[None, :], tl.exp(zc), 0.0)
            alpha = tl.exp(m - m_new)
            # Re-centre t on the new max: (z - m_new) = (z - m) + (m - m_new). While s = 0 (no finite logit
            # yet) m - m_new can overflow to -inf; the where keeps 0 * -inf = NaN out.
            shift = tl.where(s > 0, m - m_new, 0.0) * s
            t = alpha * (t + shift) + tl.sum(_xlogy_terms(e, zc), axis=1)
            s = alpha * s + tl.sum(e, axis=1)
            m = m_new
        else:
            # Move tile values into the running top-k one per row per step, largest first, while
            # some row's tile max beats its current k-th best. Past the first tiles few values
            # qualify, so this usually takes a step or two per tile rather than TOP_K.
            nan_logits += tl.sum((z != z).to(tl.int32), axis=1)
            kth = tl.min(tl.where(slot_ok, best, float("inf")), axis=1)
            tile_max = tl.max(z, axis=1)
            while tl.max((tile_max > kth).to(tl.int32), axis=0) > 0:
                take = tile_max > kth
                weakest = tl.argmin(tl.where(slot_ok, best, float("inf")), axis=1)
                best = tl.where(take[:, None] & (slots[None, :] == weakest[:, None]), tile_max[:, None], best)
                # Remove exactly one occurrence, so tied logits each keep their own slot. Rows that take nothing
                # are left out of the argmax: an all-NaN row (a NaN hidden state) has none, and the interpreter
                # fails the whole call on it; its top-k stays -inf and its entropy NaN, as in the reference.
                taken = tl.argmax(tl.where(take[:, None], z, float("-inf")), axis=1)
                z = tl.where(take[:, None] & (offs_v[None, :] == taken[:, None]), float("-inf"), z)
                kth = tl.min(tl.where(slot_ok, best, float("inf")), axis=1)
                tile_max = tl.max(z, axis=1)

    if TOP_K == 0:
        entropy = tl.log(s) - t / s
    else:
        # The caller guarantees TOP_K < V, so every real slot holds a logit; padding slots are -inf.
        zc = tl.where(slot_ok, best - tl.max(best, axis=1)[:, None], 0.0)
        e = tl.where(slot_ok, tl.exp(zc), 0.0)
        s = tl.sum(e, axis=1)
        # A -inf logit enters the top-k once k exceeds the row's finite logits.
        t = tl.sum(_xlogy_terms(e, zc), axis=1)
        entropy = tl.where(nan_logits > 0, float("nan"), tl.log(s) - t / s)
    tl.store(out_ptr + rows, entropy, mask=row_ok)


def predictive_entropy_triton(hidden: Tensor, weight: Tensor, top_k: int) -> Tensor:
    """(n,) float32 entropies; hidden (n, d), weight (V, d); 0 <= top_k <= 64, top_k < V.

    Inputs are validated by the public :func:`predictive_entropy`.
    """
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    k_pad = triton.next_power_of_2(top_k) if top_k > 0 else 1
    grid = (triton.cdiv(n, _BLOCK_N),)
    _entropy_kernel[grid](
        hidden,
        weight,
        out,
        n,
        vocab,
        hidden_size,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        TOP_K=top_k,
        K_PAD=k_pad,
        # tl.dot needs one operand dtype: mixed inputs meet in float32 tile by tile, not by copying.
        UPCAST=_UPCAST_DOT_OPERANDS or hidden.dtype != weight.dtype,
        BLOCK_N=_BLOCK_N,
        BLOCK_V=_BLOCK_V,
        BLOCK_D=_BLOCK_D,
    )
    return out
