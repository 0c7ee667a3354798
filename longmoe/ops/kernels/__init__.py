"""Triton kernels of the primitives (vendor-neutral; tiles come from the backend's tables)."""

from __future__ import annotations

import os


def triton_ready(device) -> str | None:
    """None when Triton kernels can run on `device`, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels need a GPU (or TRITON_INTERPRET=1 on CPU)"
    return None


_RUNTIME_BOUNDS: list[bool] = []


def runtime_loop_bounds() -> bool:
    """Whether a kernel's `for` loop may take a run-time bound here. Compiled, always; under
    the interpreter, Triton up to 3.6 turns the bound into a Python int with int() of a
    one-element array, which NumPy >= 2.4 refuses (TypeError). One tiny interpreted launch
    decides, once per process."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return True
    if not _RUNTIME_BOUNDS:
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def _probe(out_ptr, n):
            acc = 0
            for i in range(n):
                acc += i
            tl.store(out_ptr, acc)

        out = torch.zeros(1, dtype=torch.int32)
        try:
            _probe[(1,)](out, 3)
            _RUNTIME_BOUNDS.append(int(out) == 3)
        except Exception:  # noqa: BLE001  (the interpreter wraps the TypeError)
            _RUNTIME_BOUNDS.append(False)
    return _RUNTIME_BOUNDS[0]
