"""Where a model runs and in which precision: the names users write, and the defaults.

Names are checked without importing torch (the command line and the service settings reject a bad
`--dtype` at once); `resolve_placement` turns them into torch objects when a model loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

DTYPES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
"""Accepted dtype names -> torch attribute names. `auto` (or nothing) picks the device's default."""


def dtype_name(value: str | None) -> str | None:
    """The canonical name of a dtype option (`bf16` -> `bfloat16`); None for `auto` or nothing."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    canonical = DTYPES.get(value.strip().lower().removeprefix("torch."))
    if canonical is None:
        raise ConfigError(f"unknown dtype {value!r}: use auto, {', '.join(DTYPES)}")
    return canonical


def resolve_placement(
    device: str | torch.device | None = None, dtype: str | torch.dtype | None = None
) -> tuple[torch.device, torch.dtype]:
    """The device (default: CUDA when available, else CPU) and dtype (default: bfloat16 on CUDA, or
    float16 where the GPU lacks bfloat16; float32 elsewhere) a model is loaded with."""
    import torch

    if device is None or (isinstance(device, str) and device.strip().lower() in ("", "auto")):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        place = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from exc
    if place.type not in ("cpu", "cuda", "mps"):  # e.g. meta: weights without data, which fail only later
        raise ConfigError(f"device {device!r} cannot run a model: use auto, cpu, cuda, cuda:N or mps")
    if place.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for, but this torch ({torch.__version__}) sees no CUDA GPU")
    if place.type == "cuda" and place.index is not None and place.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if place.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device {device!r} was asked for, but MPS is not available on this machine")
    if isinstance(dtype, torch.dtype):
        if str(dtype).removeprefix("torch.") not in DTYPES.values():  # int8 or float64 would fail only once loaded
            raise ConfigError(f"dtype {dtype} cannot run a model: use auto, {', '.join(DTYPES)}")
        return place, dtype
    if dtype is not None and not isinstance(dtype, str):
        raise ConfigError(f"dtype {dtype!r} is neither a torch dtype nor a name: use auto, {', '.join(DTYPES)}")
    name = dtype_name(dtype)
    if name is None:
        if place.type != "cuda":
            return place, torch.float32
        return place, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return place, getattr(torch, name)
