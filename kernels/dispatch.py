"""One switch between the Triton kernels and their PyTorch references.

The backend is chosen, highest precedence first, by:

1. the innermost active ``with kernel_backend(name):`` block (per thread / asyncio task),
2. the last ``set_kernel_backend(name)`` call (process wide),
3. the environment variable ``INFOKV_KERNELS``,
4. the default, ``"auto"``.

``auto`` runs Triton when every input lives on CUDA and Triton imports, the PyTorch reference
otherwise. ``torch`` always runs the reference. ``triton`` always runs Triton; on CPU tensors that is
only possible in Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is first imported:
Triton reads it then, and some libraries, transformers among them, import triton early), which is how
the tests exercise the kernels on machines without a GPU.

Triton is imported lazily, only when a Triton kernel is about to run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache

import torch

BACKENDS = ("auto", "triton", "torch")
ENV_VAR = "INFOKV_KERNELS"

_process_backend: str | None = None
_scoped_backend: ContextVar[str | None] = ContextVar("infokv_kernel_backend", default=None)


class KernelBackendError(ValueError):
    """The backend asked for is unknown, or is "triton" where Triton cannot run."""


def _validate(name: str, source: str) -> str:
    normalised = name.strip().lower()
    if normalised not in BACKENDS:
        raise KernelBackendError(f"{source}: unknown kernel backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return normalised


def set_kernel_backend(name: str | None) -> None:
    """Set the process-wide backend ("auto", "triton" or "torch"); ``None`` defers to the env var."""
    global _process_backend
    _process_backend = None if name is None else _validate(name, "set_kernel_backend")


@contextmanager
def kernel_backend(name: str) -> Iterator[None]:
    """Use backend ``name`` inside the ``with`` block only (restored on exit, even on error)."""
    token = _scoped_backend.set(_validate(name, "kernel_backend"))
    try:
        yield
    finally:
        _scoped_backend.reset(token)


def get_kernel_backend() -> str:
    """The backend in force here: "auto", "triton" or "torch"."""
    scoped = _scoped_backend.get()
    if scoped is not None:
        return scoped
    if _process_backend is not None:
        return _process_backend
    return _validate(os.environ.get(ENV_VAR, "auto"), ENV_VAR)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the ``triton`` package can be imported (checked once, without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_active() -> bool:
    """Whether Triton runs kernels in its interpreter in this process.

    Triton reads ``TRITON_INTERPRET`` when it decorates a function, and decorates its own triton.language
    functions when first imported: set any later, the variable makes only later kernels interpreted, and those
    fail calling the compiled triton.language. So once triton is imported, what counts is how it decorated
    those; until then, the variable as it is now, which that import will read.
    """
    if sys.modules.get("triton") is None:
        # Triton's own truthy spellings.
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "on", "yes"}
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def use_triton(*tensors: torch.Tensor) -> bool:
    """Decide whether a kernel call on ``tensors`` runs Triton (True) or the reference (False).

    Raises KernelBackendError when Triton is forced but cannot run these inputs.
    """
    backend = get_kernel_backend()
    if backend == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "auto":
        return on_cuda and triton_available()
    _check_forced_triton(on_cuda)
    return True


def check_kernel_backend(device: torch.device) -> str:
    """The backend in force, checked before any work on `device`: KernelBackendError for an unknown name (a
    misspelt ``INFOKV_KERNELS`` is otherwise found only at the first kernel call, deep into a job) or a forced
    "triton" that cannot run there."""
    backend = get_kernel_backend()
    if backend == "triton":
        _check_forced_triton(device.type == "cuda")
    return backend


def _check_forced_triton(on_cuda: bool) -> None:
    if not triton_available():
        raise KernelBackendError("kernel backend 'triton' was forced but the triton package is not installed")
    if not on_cuda and not triton_interpreter_active():
        raise KernelBackendError(
            "kernel backend 'triton' was forced for CPU tensors; Triton runs them only in its interpreter: "
            "set TRITON_INTERPRET=1 before triton is first imported, or use backend 'auto'/'torch'"
        )
