"""Predictive entropy of the LM head's next-token distribution, without n x vocab logits.

For final hidden states ``hidden`` (n, d) and LM-head weight ``weight`` (V, d), token t's logits are
z_t = weight @ hidden_t and its entropy is H(softmax(z_t)). With ``top_k`` > 0 the distribution is
restricted to the k largest logits and renormalised, which is the same as the softmax over those
k logits. Both paths compute in float32 whatever the input dtype.

With m = max z, s = sum exp(z - m) and t = sum exp(z - m) * (z - m):

    H = -sum p log p = log s - t / s,

so three running scalars per token suffice for the full vocabulary (an online log-sum-exp that
rescales s and t when the running max grows), and the k largest logits suffice for top-k.

A logit of -inf (an fp32 overflow of hidden @ weight.T) has p = 0 and contributes 0 log 0 = 0, as in
H = -sum xlogy(p, p), not exp(z - m) * (z - m) = 0 * -inf = NaN: z - m is floored at the most negative
float32, where exp still gives 0 and the term is 0. m is floored there too, so that a tile whose logits
are all -inf adds s = t = 0 instead of centring on -inf (-inf - -inf is NaN). A row with no finite
logit stays NaN, as its softmax is; NaN logits stay NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import get_kernel_backend, use_triton

#: Largest top_k the Triton kernel handles (its running top-k lives in registers).
TRITON_MAX_TOP_K = 64

# Reference tile sizes. Per step the reference holds a (512 x 2048) float32 logits tile (4 MiB),
# its exp (4 MiB), the BLAS packing of the weight tile (2048 x d float32, 7 MiB at d = 896) and,
# for bf16/fp16 weights, a float32 copy of that tile (7 MiB): about 20-25 MiB measured, whatever
# n and V are. Doubling either block roughly doubles that; 512 x 2048 keeps the matmuls efficient.
_TOKEN_BLOCK = 512
_VOCAB_BLOCK = 2048

_FLOAT32_MIN = torch.finfo(torch.float32).min


def _check_inputs(hidden: Tensor, weight: Tensor, top_k: int) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be (n, d) and weight (V, d); got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden has d={hidden.shape[1]}, weight has d={weight.shape[1]}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = full vocabulary); got {top_k!r}")


def _check_targets(targets: Tensor, hidden: Tensor, weight: Tensor) -> None:
    """Refuse targets that indexing would misread: a negative one silently scores a row from the end of
    the vocabulary, one >= V is a device-side assert on CUDA, and uint8 or bool ones index as masks."""
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be ({hidden.shape[0]},); got {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be int64 or int32 row indices; got {targets.dtype}")
    if targets.device != weight.device:
        raise ValueError(f"targets are on {targets.device} but weight is on {weight.device}")
    if targets.numel():
        # One reduction over the (n,) targets and one host sync, whatever V is.
        low, high = torch.stack(torch.aminmax(targets)).tolist()
        if low < 0 or high >= weight.shape[0]:
            raise ValueError(f"targets must lie in [0, {weight.shape[0]}) (rows of weight); got {low} .. {high}")


def _effective_top_k(top_k: int, vocab: int) -> int:
    """Top-k over at least the whole vocabulary is the full-vocabulary entropy (coded as 0)."""
    return 0 if top_k >= vocab else top_k


@torch.no_grad()
def predictive_entropy(hidden: Tensor, weight: Tensor, top_k: int = 20) -> Tensor:
    """Entropy of softmax(hidden @ weight.T) per token, over the top-k logits (0 = all).

    Args:
        hidden: (n, d) final hidden states (after the final norm), float32/bf16/fp16.
        weight: (V, d) LM-head weight, on the same device.
        top_k: 0 for the full vocabulary, else entropy of the top-k probabilities renormalised.

    Returns:
        (n,) float32 entropies in nats.

    Runs the Triton kernel or the PyTorch reference as the dispatch switch decides; the Triton
    kernel supports top_k <= TRITON_MAX_TOP_K (larger k falls back to the reference under "auto").
    """
    _check_inputs(hidden, weight, top_k)
    k = _effective_top_k(top_k, weight.shape[0])
    if hidden.shape[0] == 0:
        return torch.empty(0, dtype=torch.float32, device=hidden.device)
    if use_triton(hidden, weight):
        if k <= TRITON_MAX_TOP_K:
            from ._triton_entropy import predictive_entropy_triton

            return predictive_entropy_triton(hidden, weight, k)
        if get_kernel_backend() == "triton":
            raise ValueError(f"the Triton entropy kernel supports top_k <= {TRITON_MAX_TOP_K}; got {top_k}")
    return predictive_entropy_reference(hidden, weight, k)


@torch.no_grad()
def predictive_entropy_reference(
    hidden: Tensor,
    weight: Tensor,
    top_k: int = 20,
    *,
    token_block: int = _TOKEN_BLOCK,
    vocab_block: int = _VOCAB_BLOCK,
) -> Tensor:
    """PyTorch reference of :func:`predictive_entropy`, tiled over tokens and vocabulary.

    Shapes and semantics as :func:`predictive_entropy`. Never holds more than one
    (token_block x vocab_block) float32 logits tile (plus its exp), so its extra memory does not
    grow with n or V. Works on any device.
    """
    _check_inputs(hidden, weight, top_k)
    k = _effective_top_k(top_k, weight.shape[0])
    n = hidden.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=hidden.device)
    for start in range(0, n, token_block):
        h = hidden[start : start + token_block].float()
        block = _full_entropy(h, weight, vocab_block) if k == 0 else _top_k_entropy(h, weight, k, vocab_block)
        out[start : start + token_block] = block
    return out


def _tile_logits(h: Tensor, weight: Tensor, start: int, vocab_block: int) -> Tensor:
    """(tokens, tile) float32 logits for vocabulary rows [start, start + vocab_block)."""
    return h @ weight[start : start + vocab_block].float().T


def _tile_stats(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(m, s, t) of a (tokens, tile) logits tile (consumed in place): max, sum exp(z-m), sum exp(z-m)*(z-m),
    each (tokens,), with m and z - m floored so that -inf logits add 0 (see module doc)."""
    m = z.amax(dim=1).clamp_(min=_FLOAT32_MIN)
    # An in-place clamp, not a mask of e == 0: a fraction of the cost, next to the tile's matmul.
    z.sub_(m[:, None]).clamp_(min=_FLOAT32_MIN)
    e = z.exp()
    s = e.sum(dim=1)
    t = z.mul_(e).sum(dim=1)
    return m, s, t


def _full_entropy(h: Tensor, weight: Tensor, vocab_block: int) -> Tensor:
    """(tokens,) full-vocabulary entropy via an online log-sum-exp over vocabulary tiles."""
    _, s, t = _online_stats(h, weight, vocab_block)
    return s.log() - t / s


def _online_stats(h: Tensor, weight: Tensor, vocab_block: int) -> tuple[Tensor, Tensor, Tensor]:
    """(m, s, t) of each token's logits over the whole vocabulary, merged tile by tile (see module doc)."""
    m, s, t = _tile_stats(_tile_logits(h, weight, 0, vocab_block))
    for start in range(vocab_block, weight.shape[0], vocab_block):
        m2, s2, t2 = _tile_stats(_tile_logits(h, weight, start, vocab_block))
        m_new = torch.maximum(m, m2)
        # Re-centre both partial sums on the new max: exp(z - m_new) = exp(m - m_new) * exp(z - m)
        # and (z - m_new) = (z - m) + (m - m_new).
        d1, d2 = m - m_new, m2 - m_new
        a1, a2 = d1.exp(), d2.exp()
        # A part with no finite logit (s = 0) may lie so far below m_new that d is -inf: d * s would be NaN.
        t = a1 * (t + d1.where(s > 0, 0.0) * s) + a2 * (t2 + d2.where(s2 > 0, 0.0) * s2)
        s = a1 * s + a2 * s2
        m = m_new
    return m, s, t


def _top_k_entropy(h: Tensor, weight: Tensor, k: int, vocab_block: int) -> Tensor:
    """(tokens,) entropy over each token's k largest logits, merged tile by tile."""
    best = h.new_empty((h.shape[0], 0))
    for start in range(0, weight.shape[0], vocab_block):
        z = _tile_logits(h, weight, start, vocab_block)
        tile_best = z.topk(min(k, z.shape[1]), dim=1, sorted=False).values
        merged = torch.cat((best, tile_best), dim=1)
        best = merged.topk(min(k, merged.shape[1]), dim=1, sorted=False).values
    _, s, t = _tile_stats(best)
    return s.log() - t / s


@torch.no_grad()
def predictive_surprisal(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    token_block: int = _TOKEN_BLOCK,
    vocab_block: int = _VOCAB_BLOCK,
) -> Tensor:
    """Surprisal -log softmax(hidden @ weight.T)[target] of each token's next token, in nats.

    Args:
        hidden: (n, d) final hidden states (after the final norm).
        weight: (V, d) LM-head weight (or a subset of its rows), on the same device.
        targets: (n,) int64 or int32 row indices into `weight` of the tokens that followed, on
            weight's device, each in [0, V).

    Returns:
        (n,) float32. The log-normaliser comes from the same online log-sum-exp as the
        full-vocabulary entropy, tiled the same way, so the extra memory does not grow with n or V.
        One PyTorch path on every device: the cost is the tiled matmul, which BLAS and cuBLAS
        already run at full speed.
    """
    _check_inputs(hidden, weight, 0)
    _check_targets(targets, hidden, weight)
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], token_block):
        h = hidden[start : start + token_block].float()
        m, s, _ = _online_stats(h, weight, vocab_block)
        target_logits = (h * weight[targets[start : start + token_block]].float()).sum(dim=1)
        out[start : start + token_block] = m + s.log() - target_logits
    return out
