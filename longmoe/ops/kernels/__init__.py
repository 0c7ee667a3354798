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
