"""Shared base for GPU backends that torch drives through its `torch.cuda` namespace.

torch exposes NVIDIA and AMD GPUs through the same API (device type "cuda", the same events and
memory counters), so only arch naming, interconnect probing and capability rules differ per vendor.
"""

from __future__ import annotations

from typing import Any

import torch

from longmoe.backends.base import Backend
from longmoe.backends.timing import EventTimer, Timer


def error_line(exc: BaseException) -> str:
    """First line of an exception, with its type: one entry for a probe's `errors` list."""
    return f"{type(exc).__name__}: {exc}".strip().splitlines()[0]


class TorchGpuBackend(Backend):
    device_type = "cuda"

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def streams(self, priority: int | None = None):
        from longmoe.backends.streams import DeviceStreams
        return DeviceStreams(self.comm_stream_priority if priority is None else priority)

    def timer(self) -> Timer:
        return EventTimer()

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated())

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def get_rng_state(self):
        return torch.cuda.get_rng_state()

    def set_rng_state(self, state) -> None:
        if state is not None:
            torch.cuda.set_rng_state(state)

    @property
    def memory_label(self) -> str:
        return "device allocated"

    def _read_arch(self) -> str:
        return self._arch_from_props(torch.cuda.get_device_properties(torch.cuda.current_device()))

    # --- vendor hooks -----------------------------------------------------------------------
    def _arch_from_props(self, props: Any) -> str:
        raise NotImplementedError

    def _interconnect(self, device_count: int) -> tuple[dict[str, Any], list[str]]:
        """(summary with at least gpus_per_node and link, errors); must not raise."""
        return {"gpus_per_node": device_count, "link": "unknown"}, []

    # --- probe ------------------------------------------------------------------------------
    def probe(self) -> dict[str, Any]:
        errors: list[str] = []
        out: dict[str, Any] = {
            "name": self.name,
            "arch": None,
            "sm_count": None,
            "memory_bytes": None,
            "warp_size": None,
            "device_count": 0,
            "interconnect": {"gpus_per_node": 0, "link": "unknown"},
            "errors": errors,
        }
        if not self.is_available():
            errors.append(f"device: {self.unavailable_reason()}")
        try:
            out["device_count"] = int(torch.cuda.device_count())
        except Exception as e:  # a broken driver install raises here rather than returning 0
            errors.append(f"device_count: {error_line(e)}")
        if out["device_count"] > 0 and self.is_available():  # a device of another vendor is not ours
            try:
                props = torch.cuda.get_device_properties(torch.cuda.current_device())
                out["arch"] = self._arch_from_props(props)
                out["device_name"] = str(props.name)
                out["sm_count"] = int(props.multi_processor_count)
                out["memory_bytes"] = int(props.total_memory)
                # Older torch builds do not expose warp_size; guessing it would hide a real gap.
                out["warp_size"] = getattr(props, "warp_size", None)
                if out["warp_size"] is None:
                    errors.append("warp_size: not exposed by this torch build")
            except Exception as e:
                errors.append(f"device properties: {error_line(e)}")
        link, link_errors = self._interconnect(out["device_count"])
        out["interconnect"] = link
        errors.extend(link_errors)
        return out
