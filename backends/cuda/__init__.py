"""NVIDIA GPUs through a CUDA build of torch: NCCL collectives, NVML topology, sm_XY arch names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from longmoe.backends.registry import register
from longmoe.backends.base import CORE_PACKAGES
from longmoe.backends.cuda.aot import TARGETS
from longmoe.backends.cuda.collective import NcclCollective
from longmoe.backends.cuda.probe import nvlink_summary
from longmoe.backends.torch_gpu import TorchGpuBackend

# torch._grouped_mm's fast path is a Hopper-or-newer kernel and takes bf16 only.
GROUPED_MM_MIN_CAPABILITY = (9, 0)


@register
class CudaBackend(TorchGpuBackend):
    name = "cuda"
    packages = CORE_PACKAGES + ("pynvml",)
    data_dir = Path(__file__).parent
    collective = NcclCollective()

    @classmethod
    def compile_targets(cls) -> tuple:
        return TARGETS

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is None and torch.cuda.is_available()

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if torch.version.hip is not None:
            return f"torch {torch.__version__} is a ROCm build; use backend 'rocm'"
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False: no visible NVIDIA GPU or driver"
        return None

    def _arch_from_props(self, props: Any) -> str:
        return f"sm_{props.major}{props.minor}"

    def _interconnect(self, device_count: int) -> tuple[dict[str, Any], list[str]]:
        return nvlink_summary(device_count)

    def supports_grouped_mm(self, dtype: torch.dtype) -> bool:
        if dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
            return False
        try:
            dev = torch.cuda.current_device()
            cache = self.__dict__.setdefault("_grouped_mm_capable", {})
            if dev not in cache:  # asked at every grouped GEMM: read the device once
                cache[dev] = torch.cuda.get_device_capability(dev) >= GROUPED_MM_MIN_CAPABILITY
            return cache[dev]
        except Exception:  # no usable device: the ops registry must take the fallback
            return False
