"""Accumulated (H2O-style) attention: per key, the attention probability summed over queries.

The q queries are the last q of the n key positions (query i sits at absolute position
n - q + i) and attend causally, bottom-right aligned: query i sees keys 0 .. n - q + i. With GQA,
query head h reads KV head h // (H // Hkv). The result for head h and key j is

    A[h, j] = sum_i softmax_j(scaling * q_{h,i} . k_{h // G, j})   (masked keys excluded),

which costs O(q * n) compute. Both implementations keep memory at O(tile): pass 1 finds every
query's log-sum-exp over key tiles, pass 2 recomputes the logits tile by tile and adds the
normalised probabilities into the key columns. The observation-window score
(:mod:`.window_attention`) is the same quantity for the last w queries, divided by w.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import get_kernel_backend, use_triton

#: Largest head dim the Triton kernels handle (a query or key row is one register tile).
TRITON_MAX_HEAD_DIM = 256

# Reference tiles: rows = (query heads of one KV group) x query_block, columns = key_block. For
# the default model (7 heads per group) a 896 x 4096 float32 logits tile is 14 MiB.
_QUERY_BLOCK = 128
_KEY_BLOCK = 4096

_FLOAT32_MIN = torch.finfo(torch.float32).min


def _check_inputs(queries: Tensor, keys: Tensor) -> None:
    """Validate (H, q, dh) queries against (Hkv, n, dh) keys; raise ValueError with the reason."""
    if queries.dim() != 3 or keys.dim() != 3:
        raise ValueError(
            f"queries must be (H, q, dh) and keys (Hkv, n, dh); got {tuple(queries.shape)} and {tuple(keys.shape)}"
        )
    heads, q_len, head_dim = queries.shape
    kv_heads, n, key_dim = keys.shape
    if head_dim != key_dim:
        raise ValueError(f"head dim mismatch: queries have {head_dim}, keys have {key_dim}")
    # Zero heads would pass the modulo test with a GQA group of 0, which neither path can score.
    if heads == 0 or kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(
            f"need at least one query head, and a multiple of KV heads: got {heads} query and {kv_heads} KV heads"
        )
    if not 1 <= q_len <= n:
        raise ValueError(f"need 1 <= queries ({q_len}) <= keys ({n}): queries are the last positions of the keys")
    if queries.device != keys.device:
        raise ValueError(f"queries are on {queries.device} but keys are on {keys.device}")


@torch.no_grad()
def accumulated_attention(queries: Tensor, keys: Tensor, scaling: float) -> Tensor:
    """Column sums of causal attention probabilities over all queries.

    Args:
        queries: (H, q, dh) the last q positions' queries (RoPE applied), q <= n.
        keys: (Hkv, n, dh) keys (RoPE applied); H must be a multiple of Hkv.
        scaling: logit scale, usually dh ** -0.5.

    Returns:
        (H, n) float32; row h sums to q (each query's probabilities sum to 1).

    Runs the Triton kernels or the PyTorch reference as the dispatch switch decides; the Triton kernels
    support head dims <= TRITON_MAX_HEAD_DIM (larger ones fall back to the reference under "auto").
    """
    _check_inputs(queries, keys)
    if use_triton(queries, keys):
        head_dim = queries.shape[2]
        if head_dim <= TRITON_MAX_HEAD_DIM:
            from ._triton_attention import accumulated_attention_triton

            return accumulated_attention_triton(queries, keys, scaling)
        if get_kernel_backend() == "triton":
            raise ValueError(f"the Triton attention kernels support head dim <= {TRITON_MAX_HEAD_DIM}; got {head_dim}")
    return accumulated_attention_reference(queries, keys, scaling)


@torch.no_grad()
def accumulated_attention_reference(
    queries: Tensor,
    keys: Tensor,
    scaling: float,
    *,
    query_block: int = _QUERY_BLOCK,
    key_block: int = _KEY_BLOCK,
) -> Tensor:
    """PyTorch reference of :func:`accumulated_attention`; same shapes, any device.

    Per KV group and block of query_block queries, a two-pass softmax over key tiles of key_block
    keys: extra memory is O(G * query_block * key_block), independent of n and q.
    """
    _check_inputs(queries, keys)
    heads, q_len, head_dim = queries.shape
    kv_heads, n, _ = keys.shape
    group = heads // kv_heads
    offset = n - q_len  # absolute position of query 0
    out = torch.zeros(heads, n, dtype=torch.float32, device=keys.device)
    for g in range(kv_heads):
        head_slice = slice(g * group, (g + 1) * group)
        for q0 in range(0, q_len, query_block):
            q1 = min(q0 + query_block, q_len)
            rows = queries[head_slice, q0:q1].float().reshape(group * (q1 - q0), head_dim)
            positions = torch.arange(offset + q0, offset + q1, device=keys.device).repeat(group)
            horizon = offset + q1  # the block's last query sees keys [0, horizon)
            key_g = keys[g]

            # Pass 1: each query's log-sum-exp. The running max starts finite, so exp(m - m_new) never sees
            # inf - inf, even after a tile whose logits all overflowed to -inf (as the Triton kernel does).
            m = torch.full((rows.shape[0],), _FLOAT32_MIN, dtype=torch.float32, device=keys.device)
            total = torch.zeros(rows.shape[0], dtype=torch.float32, device=keys.device)
            for k0 in range(0, horizon, key_block):
                logits, _ = _masked_logits(rows, key_g, positions, k0, min(k0 + key_block, horizon), scaling)
                m_new = torch.maximum(m, logits.amax(dim=1))
                total = total * (m - m_new).exp() + logits.sub_(m_new[:, None]).exp_().sum(dim=1)
                m = m_new
            lse = m + total.log()

            # Pass 2: normalised probabilities, summed over the block's queries per head.
            for k0 in range(0, horizon, key_block):
                logits, future = _masked_logits(rows, key_g, positions, k0, min(k0 + key_block, horizon), scaling)
                # A masked key's probability is exactly 0. For a NaN query (lse = NaN) exp(-inf - NaN) is
                # NaN and would reach keys it cannot see, so zero after the exp, as the Triton kernel does.
                probs = logits.sub_(lse[:, None]).exp_().masked_fill_(future, 0.0)
                out[head_slice, k0 : k0 + probs.shape[1]] += probs.view(group, q1 - q0, -1).sum(dim=1)
    return out


def _masked_logits(
    rows: Tensor, keys: Tensor, positions: Tensor, start: int, stop: int, scaling: float
) -> tuple[Tensor, Tensor]:
    """(R, stop - start) float32 scaled logits of rows (R, dh) against keys[start:stop] of one KV
    head (n, dh), -inf where a key lies after the row's absolute position (positions, (R,)), and
    that (R, stop - start) bool mask of future keys."""
    logits = (rows @ keys[start:stop].float().T).mul_(scaling)
    key_pos = torch.arange(start, stop, device=keys.device)
    future = key_pos[None, :] > positions[:, None]
    return logits.masked_fill_(future, float("-inf")), future
