"""Scoring and decoding kernels for InfoKV: Triton on CUDA, PyTorch references everywhere.

A leaf package: it imports nothing from the rest of infokv_rag, and Triton only when a Triton
kernel is about to run. Choose the backend with ``INFOKV_KERNELS`` (auto | triton | torch),
:func:`set_kernel_backend` or ``with kernel_backend(...)``; see :mod:`.dispatch`.

Every kernel returns float32 and computes in float32 from float32, bfloat16 or float16 inputs, under
torch.no_grad(): nothing here is differentiated, and an input that requires grad (an nn.Linear's weight)
would otherwise make autograd keep every tile alive, memory O(n x V) instead of O(tile).
"""

from .accumulated_attention import TRITON_MAX_HEAD_DIM, accumulated_attention, accumulated_attention_reference
from .dequantise import code_step, dequantise_keys, dequantise_values
from .dispatch import (
    KernelBackendError,
    check_kernel_backend,
    get_kernel_backend,
    kernel_backend,
    set_kernel_backend,
)
from .entropy import TRITON_MAX_TOP_K, predictive_entropy, predictive_entropy_reference, predictive_surprisal
from .window_attention import group_reduce, window_attention, window_attention_reference

__all__ = [
    "KernelBackendError",
    "TRITON_MAX_HEAD_DIM",
    "TRITON_MAX_TOP_K",
    "accumulated_attention",
    "accumulated_attention_reference",
    "check_kernel_backend",
    "code_step",
    "dequantise_keys",
    "dequantise_values",
    "get_kernel_backend",
    "group_reduce",
    "kernel_backend",
    "predictive_entropy",
    "predictive_entropy_reference",
    "predictive_surprisal",
    "set_kernel_backend",
    "window_attention",
    "window_attention_reference",
]
