"""NVLink topology through NVML. Every NVML import and call is wrapped; absence gives "unknown"."""

from __future__ import annotations

from typing import Any

from longmoe.backends.torch_gpu import error_line


def nvlink_summary(device_count: int, device_index: int = 0) -> tuple[dict[str, Any], list[str]]:
    """({gpus_per_node, link, nvlink_active_links, nvlink_version}, errors); never raises."""
    summary: dict[str, Any] = {"gpus_per_node": device_count, "link": "unknown"}
    try:
        import pynvml  # shipped by the nvidia-ml-py distribution
    except Exception as e:
        return summary, [f"pynvml: not importable ({error_line(e)})"]
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return summary, [f"pynvml: nvmlInit failed ({error_line(e)})"]
    try:
        # NVML counts every GPU on the host, not only those visible to this process.
        summary["gpus_per_node"] = int(pynvml.nvmlDeviceGetCount())
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        active, version = 0, None
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    active += 1
                    if version is None:
                        version = int(pynvml.nvmlDeviceGetNvLinkVersion(handle, link))
            except pynvml.NVMLError:
                continue  # link index past this GPU's count, or NVLink unsupported (PCIe card)
        # One GPU has no peer to link to; "pcie" there would read as a slow link that isn't there.
        link = "nvlink" if active else ("pcie" if summary["gpus_per_node"] > 1 else "none")
        summary.update(link=link, nvlink_active_links=active, nvlink_version=version)
        return summary, []
    except Exception as e:
        return summary, [f"pynvml: NVLink query failed ({error_line(e)})"]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass  # shutdown failure after a finished query changes nothing we report
