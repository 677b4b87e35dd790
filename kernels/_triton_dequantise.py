"""Triton kernel that decodes cache entries from codes in one pass (imported lazily; see :mod:`.dequantise`).

Grid (H, entry blocks): each program decodes BLOCK_M entries x every channel of one head. A channel's code is
read from byte ``channel * bits // 8`` (its nibble ``channel % 2`` when 4 bits wide); its range sits at row
``entry // rows_per_range`` and column ``channel // (dh // range width)`` of the (H, rows, width) ranges, so
one kernel serves the keys' per-page, per-channel ranges and the values' per-entry group ranges.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

_BLOCK_M = 32


@triton.jit
def _dequantise_kernel(
    codes_ptr,
    low_ptr,
    high_ptr,
    out_ptr,
    m,
    dim,
    rows_per_range,
    channels_per_range,
    stride_ch,
    stride_cm,
    stride_cb,
    stride_rh,
    stride_rr,
    stride_rc,
    stride_oh,
    stride_om,
    stride_od,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    head = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    channels = tl.arange(0, BLOCK_D)
    inside = (rows[:, None] < m) & (channels[None, :] < dim)
    byte = channels * BITS // 8
    shift = (channels % 2) * 4 if BITS == 4 else channels * 0
    packed = tl.load(
        codes_ptr + head * stride_ch + rows[:, None] * stride_cm + byte[None, :] * stride_cb, mask=inside, other=0
    )
    code = ((packed.to(tl.int32) >> shift[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
    ranges = (
        head * stride_rh
        + (rows // rows_per_range)[:, None] * stride_rr
        + (channels // channels_per_range)[None, :] * stride_rc
    )
    low = tl.load(low_ptr + ranges, mask=inside, other=0.0).to(tl.float32)
    high = tl.load(high_ptr + ranges, mask=inside, other=0.0).to(tl.float32)
    # NaN propagates, as in the reference's clamp_min.
    step = tl.maximum(high - low, 1e-8, propagate_nan=tl.PropagateNan.ALL) / ((1 << BITS) - 1)
    tl.store(
        out_ptr + head * stride_oh + rows[:, None] * stride_om + channels[None, :] * stride_od,
        low + code * step,
        mask=inside,
    )


def dequantise_triton(codes: Tensor, low: Tensor, high: Tensor, bits: int, rows_per_range: int, out: Tensor) -> None:
    """Decodes codes (H, m, dh * bits // 8) uint8 with ranges low / high (H, rows, width) float16 into `out`
    (H, m, dh) float32 of any strides; an entry's range row is entry // rows_per_range."""
    heads, m, _ = codes.shape
    dim = out.shape[2]
    if m == 0:
        return
    low, high = low.contiguous(), high.contiguous()  # one set of strides serves both
    grid = (heads, triton.cdiv(m, _BLOCK_M))
    _dequantise_kernel[grid](
        codes,
        low,
        high,
        out,
        m,
        dim,
        rows_per_range,
        dim // low.shape[2],
        *codes.stride(),
        *low.stride(),
        *out.stride(),
        BITS=bits,
        BLOCK_M=_BLOCK_M,
        BLOCK_D=triton.next_power_of_2(dim),
    )
