"""Capability markers: tests say what they need (needs_cuda, needs_multi_gpu, needs_rocm) and are
skipped, with the reason, on machines that lack it. No test skips by vendor name."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9 default-change warning


def _capabilities() -> dict[str, str | None]:
    from longmoe.backends import active_backend
    b = active_backend()
    gpus = (b.probe().get("device_count") or 0) if b.device_type != "cpu" else 0
    return {
        "needs_cuda": None if gpus >= 1 else "needs a GPU (CUDA or ROCm device); none here",
        "needs_multi_gpu": None if gpus >= 2 else f"needs two or more GPUs; {gpus} here",
        "needs_rocm": None if b.name == "rocm" else f"needs a ROCm device; backend is {b.name}",
    }


def pytest_collection_modifyitems(config, items):
    caps = None
    for item in items:
        for mark in ("needs_cuda", "needs_multi_gpu", "needs_rocm"):
            if item.get_closest_marker(mark):
                caps = caps or _capabilities()
                if caps[mark]:
                    item.add_marker(pytest.mark.skip(reason=caps[mark]))
