"""torch.compile for the plain-PyTorch pieces that run as chains of small elementwise ops on a
GPU (the Gated DeltaNet core's batched parts, its causal conv and gated norm). Inductor turns
each chain into fused Triton kernels for whichever GPU is present; the eager function stays the
reference and the CPU path. One compiled callable per function, shape mode and process. The
model's pieces compile with static shapes (`dynamic=False`): packed rows of a new length compile
them again (minutes over the first steps), up to RECOMPILE_LIMIT lengths per function. `dynamic=None` (torch's automatic dynamic shapes: at most two graphs) avoids that, but a
packed run with it stopped inside Triton 3.6's compiler on an H200, so the model does not ask
for it yet.

`forced(backend)` (or LONGMOE_FORCE_COMPILE=<backend> in the environment, which reaches spawned
ranks) runs the compiled path on any device with another torch.compile backend: tests use it on
CPU with "aot_eager_decomp_partition", which partitions forward and backward (what gets saved)
the way inductor does, without generating kernels."""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch

_CACHE: dict[tuple[Callable, str, bool | None], Callable] = {}
# Graphs one compiled function may keep (dynamo's default is 8, past which every new shape runs
# eagerly): static-shaped pieces meet one length per packed row length, up to
# data.max_tokens_per_micro_batch / data.row_multiple of them (32 at a 32K budget in 1K steps).
RECOMPILE_LIMIT = 64
_FORCED: list[str] = []


def _forced() -> str | None:
    return _FORCED[-1] if _FORCED else os.environ.get("LONGMOE_FORCE_COMPILE") or None


def compile_unavailable(device: torch.device) -> str | None:
    """None when compiled pieces can run on `device`, else why not. LONGMOE_COMPILE=0 turns
    them all off (eager everywhere: for debugging, or a GPU where inductor misbehaves)."""
    if _forced():
        return None
    if os.environ.get("LONGMOE_COMPILE", "1") == "0":
        return "turned off by LONGMOE_COMPILE=0"
    if device.type == "cpu":
        return "compiled pieces are for GPUs (CPU runs the eager form)"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch.compile needs Triton here ({type(e).__name__})"
    return None


def compiled(fn: Callable, dynamic: bool | None = False) -> Callable:
    backend = _forced() or "inductor"
    key = (fn, backend, dynamic)
    if key not in _CACHE:
        import torch._dynamo.config as dynamo_config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _CACHE[key] = torch.compile(fn, backend=backend, dynamic=dynamic)
    return _CACHE[key]


@contextlib.contextmanager
def forced(backend: str):
    _FORCED.append(backend)
    try:
        yield
    finally:
        _FORCED.pop()
