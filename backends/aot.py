"""Ahead-of-time compile targets for Triton kernels, contributed per vendor.

Each target says how to build a `triton.backends.compiler.GPUTarget`, which launch options its
vendor's kernel tables may carry, its register and shared-memory budgets, and how to read those
figures off the compiled kernel. The vendor-neutral checker in longmoe/ops/kernels/aot.py walks
them; it never names a vendor itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class CompileTarget:
    name: str                  # e.g. the arch the kernel tables are keyed by
    vendor: str                # the backend whose kernels.json holds this target's configs
    triton_backend: str        # GPUTarget backend
    arch: object               # GPUTarget arch
    warp_size: int
    reg_budget: int            # registers per thread / VGPRs per lane
    shared_budget: int         # bytes of shared memory / LDS per block
    # compiled kernel -> (registers, spilled bytes or count, shared bytes)
    usage: Callable[[object], tuple[int, int, int]]
    launch_keys: tuple[str, ...] = field(default=())  # extra options passed to triton.compile


_TARGETS: dict[str, CompileTarget] = {}


def register_target(t: CompileTarget) -> CompileTarget:
    _TARGETS[t.name] = t
    return t


def compile_targets() -> dict[str, CompileTarget]:
    import longmoe.backends  # noqa: F401  (vendor packages register their targets on import)
    from longmoe.backends.cuda import aot as _cuda  # noqa: F401
    from longmoe.backends.rocm import aot as _rocm  # noqa: F401
    return dict(_TARGETS)
