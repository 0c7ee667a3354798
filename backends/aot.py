"""Ahead-of-time compile targets for Triton kernels, contributed per vendor.

Each target says how to build a `triton.backends.compiler.GPUTarget`, how its vendor turns a
kernel table entry into launch options (the vendor backend's `launch_options`), its register
and shared-memory budgets, and how to read those figures off the compiled kernel. Each vendor
backend lists its own (`Backend.compile_targets`); the vendor-neutral checker in
longmoe/ops/kernels/aot.py walks them and never names a vendor itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from longmoe.backends.registry import backend_classes


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

    @property
    def kernel_table(self) -> Path:
        """The vendor's kernels.json, whose configs are compiled for this target."""
        return backend_classes()[self.vendor].data_dir / "kernels.json"

    def launch_options(self, cfg: Mapping[str, Any], num_warps_key: str = "num_warps") -> dict:
        """The options triton.compile takes for one table entry, as the vendor launches it."""
        return backend_classes()[self.vendor].launch_options(cfg, num_warps_key)


def compile_targets() -> dict[str, CompileTarget]:
    """Every registered backend's targets, by name (no device needed)."""
    return {t.name: t for cls in backend_classes().values() for t in cls.compile_targets()}
