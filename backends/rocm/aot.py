"""AMD compile targets: VGPRs (with AGPRs), spills and LDS from the AMDGPU kernel metadata."""

from __future__ import annotations

import re

from longmoe.backends.aot import CompileTarget


def _amdgcn_usage(compiled) -> tuple[int, int, int]:
    asm = compiled.asm["amdgcn"]

    def field(name):
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(m.group(1)) if m else 0
    regs = field("vgpr_count") + field("agpr_count")
    spills = field("vgpr_spill_count") + field("sgpr_spill_count")
    lds = max(field("group_segment_fixed_size"), int(getattr(compiled.metadata, "shared", 0) or 0))
    return regs, spills, lds


# MI300X (gfx942): 512 VGPRs per lane with AGPRs, 64 KiB LDS; MI355X (gfx950): 160 KiB LDS.
TARGETS = (
    CompileTarget("gfx942", "rocm", "hip", "gfx942", 64, 512, 64 * 1024, _amdgcn_usage),
    CompileTarget("gfx950", "rocm", "hip", "gfx950", 64, 512, 160 * 1024, _amdgcn_usage),
)
