"""AMD GPUs through a ROCm build of torch: RCCL, amdsmi/hip-python topology, gfx arch names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longmoe.backends.registry import register
from longmoe.backends.base import CORE_PACKAGES
from longmoe.backends.rocm.aot import TARGETS
from longmoe.backends.rocm.collective import RcclCollective
from longmoe.backends.rocm.probe import link_summary
from longmoe.backends.torch_gpu import TorchGpuBackend

# Instinct archs where torch._grouped_mm has a ROCm kernel worth trying (MI300 and MI350 series).
GROUPED_MM_ARCHS = frozenset({"gfx942", "gfx950"})


@register
class RocmBackend(TorchGpuBackend):
    name = "rocm"
    packages = CORE_PACKAGES + ("hip-python", "amdsmi")
    data_dir = Path(__file__).parent
    collective = RcclCollective()
    # AMD's Triton code generator takes these per launch; the tables tune them per arch.
    launch_keys = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

    @classmethod
    def compile_targets(cls) -> tuple:
        return TARGETS

    def __init__(self) -> None:
        self._grouped_mm_ok: dict[torch.dtype, bool] = {}

    @classmethod
    def is_available(cls) -> bool:
        return bool(torch.version.hip) and torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.version.hip:
            return f"torch {torch.__version__} is not a ROCm build (torch.version.hip is None)"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False: no visible AMD GPU or driver"
        return None

    def _arch_from_props(self, props: Any) -> str:
        # gcnArchName carries feature flags ("gfx942:sramecc+:xnack-"); configs key on the base.
        return str(props.gcnArchName).split(":")[0]

    def _interconnect(self, device_count: int) -> tuple[dict[str, Any], list[str]]:
        return link_summary(device_count)

    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        if dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
            return False
        if self.arch not in GROUPED_MM_ARCHS:
            return False
        if dtype not in self._grouped_mm_ok:
            self._grouped_mm_ok[dtype] = _grouped_mm_runs(dtype)
        return self._grouped_mm_ok[dtype]


def _grouped_mm_runs(dtype: torch.dtype) -> bool:
    """Try one tiny grouped GEMM: ROCm support for torch._grouped_mm varies by torch release,
    so a version check would be a guess where a 2-group call is a fact."""
    try:
        a = torch.randn(32, 64, device="cuda", dtype=dtype)
        # The second operand is passed transposed (K contiguous), the layout the fast path wants.
        b = torch.randn(2, 64, 64, device="cuda", dtype=dtype).transpose(-2, -1)
        offs = torch.tensor([16, 32], device="cuda", dtype=torch.int32)
        out = torch._grouped_mm(a, b, offs=offs)
        torch.cuda.synchronize()
        return tuple(out.shape) == (32, 64)
    except Exception:  # any failure means "use the fallback", which is always correct
        return False
