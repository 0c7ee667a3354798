"""The host as a backend: gloo collectives, wall-clock timers, peak RSS as the memory figure."""

from __future__ import annotations

import os
import platform
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from longmoe.backends.registry import register
from longmoe.backends.base import Backend
from longmoe.backends.cpu.collective import GlooCollective
from longmoe.backends.timing import Timer, WallTimer

_PROC_STATUS = Path("/proc/self/status")
_PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def _vm_hwm_bytes() -> int | None:
    """Peak RSS from /proc (Linux), the counter that clear_refs can reset; None elsewhere."""
    try:
        for line in _PROC_STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _total_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@register
class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    data_dir = Path(__file__).parent
    collective = GlooCollective()

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, local_rank: int) -> torch.device:
        # Every rank shares the one host device; an index would only make tensors look different.
        return torch.device("cpu")

    def _read_arch(self) -> str:
        return "cpu"

    def probe(self) -> dict[str, Any]:
        errors: list[str] = []
        try:
            memory: int | None = _total_memory_bytes()
        except (OSError, ValueError) as e:
            memory = None
            errors.append(f"memory_bytes: {type(e).__name__}: {e}")
        return {
            "name": self.name,
            "arch": "cpu",
            "machine": platform.machine(),
            "sm_count": os.cpu_count(),
            "memory_bytes": memory,
            "warp_size": None,
            "device_count": 1,
            "interconnect": {"gpus_per_node": 0, "link": "loopback"},
            "errors": errors,
        }

    def timer(self) -> Timer:
        return WallTimer()

    def reset_peak_memory(self) -> None:
        # ru_maxrss cannot be reset, but Linux lets a process reset its own VmHWM by writing "5"
        # to clear_refs; where that fails, the peak counts from process start.
        try:
            _PROC_CLEAR_REFS.write_text("5")
        except OSError:
            pass

    def peak_memory_bytes(self) -> int:
        """Peak resident set size of the whole process: allocator slack, libraries and Python
        objects included, so it is an upper bound on tensor bytes, not a count of them."""
        hwm = _vm_hwm_bytes()
        if hwm is not None:
            return hwm
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # getrusage reports kB on Linux and bytes on macOS.
        return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024

    @property
    def memory_label(self) -> str:
        return "process max RSS"
