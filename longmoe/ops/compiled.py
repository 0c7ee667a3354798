"""torch.compile for the plain-PyTorch pieces that run as chains of small elementwise ops on a
GPU (the Gated DeltaNet core's batched parts, its causal conv). Inductor turns each chain into
fused Triton kernels for whichever GPU is present; the eager function stays the reference and the
CPU path. One compiled callable per function per process, shapes static."""

from __future__ import annotations

from typing import Callable

import torch

_CACHE: dict[Callable, Callable] = {}


def compile_unavailable(device: torch.device) -> str | None:
    """None when compiled pieces can run on `device`, else why not."""
    if device.type == "cpu":
        return "compiled pieces are for GPUs (CPU runs the eager form)"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch.compile needs Triton here ({type(e).__name__})"
    return None


def compiled(fn: Callable) -> Callable:
    if fn not in _CACHE:
        _CACHE[fn] = torch.compile(fn, dynamic=False)
    return _CACHE[fn]
