"""Cache entries in codes back to float32: the decoding half of `infokv_rag.quantisation`.

Every element is ``low + code * step`` with ``step = max(high - low, 1e-8) / (2**bits - 1)``, where ``code`` is
its `bits`-wide code (8, or 4 with two codes per byte, the even channel in the low nibble) and [low, high] the
float16 range it was coded within:

- keys: codes (H, m, dh * bits // 8) uint8, ranges (H, pages, dh) per channel within pages of `page_tokens`
  entries, decoded channel-major (a (H, m, dh) view of (H, dh, m) storage), as attention reads keys fastest;
- values: codes (H, m, dh * bits // 8) uint8, ranges (H, m, groups) per entry, each shared by dh // groups
  consecutive channels, decoded entry-major (H, m, dh).

On CUDA one Triton kernel decodes a tensor in one pass (a decode per layer and forward pass is what a cache
held in codes pays); the PyTorch references decode in place with broadcast ranges, a few passes over the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import use_triton


def code_step(low: Tensor, high: Tensor, bits: int) -> Tensor:
    """What one code step is worth within [low, high] (float32, the shape of `low`)."""
    return (high.float() - low.float()).clamp_min(1e-8) / (2**bits - 1)


def _unpack_into(out: Tensor, codes: Tensor, bits: int) -> None:
    """Writes the code of each channel, codes (..., d * bits // 8) uint8, into `out` (..., d) float32, a view of
    any layout."""
    if bits == 4:
        out[..., 0::2] = codes & 15
        out[..., 1::2] = codes >> 4
    else:
        out.copy_(codes)


def _check(codes: Tensor, low: Tensor, high: Tensor, bits: int, out: Tensor | None) -> int:
    """Validates what keys and values share and returns dh, the channels the codes hold.

    The kernel indexes every tensor with these sizes unchecked, so a mismatch would read or write past one: each
    decoder checks the rest of its shapes before either path runs, and both paths refuse the same inputs.
    """
    if bits not in (4, 8):
        raise ValueError(f"codes are 4 or 8 bits wide, not {bits}")
    if codes.dtype != torch.uint8 or codes.dim() != 3 or low.dim() != 3 or low.shape != high.shape:
        raise ValueError(
            f"expected uint8 codes (H, m, bytes) and two equal (H, ranges, width) ranges; got codes "
            f"{tuple(codes.shape)} {codes.dtype}, ranges {tuple(low.shape)} and {tuple(high.shape)}"
        )
    tensors = (codes, low, high) if out is None else (codes, low, high, out)
    if len({t.device for t in tensors}) > 1:
        raise ValueError(
            f"codes, ranges and out must be on one device; got {', '.join(str(t.device) for t in tensors)}"
        )
    if low.shape[0] != codes.shape[0]:
        raise ValueError(f"codes have {codes.shape[0]} heads but ranges have {low.shape[0]}")
    return codes.shape[2] * 8 // bits


@torch.no_grad()
def dequantise_keys(
    codes: Tensor, low: Tensor, high: Tensor, bits: int, page_tokens: int, out: Tensor | None = None
) -> Tensor:
    """Keys from their codes: codes (H, m, dh * bits // 8) uint8, low / high (H, pages, dh) float16.

    `out`, when given, is where they are decoded: (H, dh, at least pages * page_tokens) float32; the reference
    writes all of its first pages * page_tokens entries per channel, the kernel the first m.
    Returns (H, m, dh) float32, channel-major (a transposed view of `out`).
    """
    dim = _check(codes, low, high, bits, out)
    heads, pages, width = low.shape
    m = codes.shape[1]
    if width != dim:
        raise ValueError(f"codes hold {dim} channels ({codes.shape[2]} bytes at {bits} bits) but key ranges {width}")
    if page_tokens < 1 or m > pages * page_tokens:
        raise ValueError(f"{m} keys do not fit {pages} pages of ranges, {page_tokens} keys a page")
    if out is not None and (out.dim() != 3 or out.shape[:2] != (heads, dim) or out.shape[2] < pages * page_tokens):
        raise ValueError(f"out must be ({heads}, {dim}, at least {pages * page_tokens}); got {tuple(out.shape)}")
    if out is None:
        out = torch.empty(heads, dim, pages * page_tokens, device=codes.device)
    if use_triton(codes, low, high, out):
        from ._triton_dequantise import dequantise_triton

        dequantise_triton(codes, low, high, bits, page_tokens, out.transpose(1, 2)[:, :m])
        return out[:, :, :m].transpose(1, 2)
    keys = out[:, :, : pages * page_tokens]
    _unpack_into(keys.transpose(1, 2)[:, :m], codes, bits)
    low_by_page, high_by_page = (ranges.float().transpose(1, 2).unsqueeze(3) for ranges in (low, high))
    keys.view(heads, dim, pages, page_tokens).mul_(code_step(low_by_page, high_by_page, bits)).add_(low_by_page)
    return keys[:, :, :m].transpose(1, 2)


@torch.no_grad()
def dequantise_values(codes: Tensor, low: Tensor, high: Tensor, bits: int, out: Tensor | None = None) -> Tensor:
    """Values from their codes: codes (H, m, dh * bits // 8) uint8, low / high (H, m, groups) float16.

    Returns (H, m, dh) float32, decoded into `out` of that shape when given.
    """
    dim = _check(codes, low, high, bits, out)
    heads, rows, groups = low.shape
    m = codes.shape[1]
    if rows != m:
        raise ValueError(f"{m} values need one range row each; got {rows}")
    if groups == 0 or dim % groups:
        raise ValueError(f"{dim} channels do not split into {groups} range groups")
    if out is not None and out.shape != (heads, m, dim):
        raise ValueError(f"out must be ({heads}, {m}, {dim}); got {tuple(out.shape)}")
    values = torch.empty(heads, m, dim, device=codes.device) if out is None else out
    if use_triton(codes, low, high, values):
        from ._triton_dequantise import dequantise_triton

        dequantise_triton(codes, low, high, bits, 1, values)
        return values
    _unpack_into(values, codes, bits)
    low_by_group, high_by_group = low.unsqueeze(3), high.unsqueeze(3)
    grouped = values.view(heads, m, groups, dim // groups)
    grouped.mul_(code_step(low_by_group, high_by_group, bits)).add_(low_by_group.float())
    return values
