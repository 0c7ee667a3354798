"""XGMI topology through amdsmi, else hip-python. Every import and call is wrapped.

hip-python can import on a machine without the HIP runtime and fail only when a function is
called (libamdhip64 is loaded lazily), so calls are guarded as well as imports.
"""

from __future__ import annotations

from typing import Any

from longmoe.backends.torch_gpu import error_line

# hsa_amd_link_info_type_t values returned by hipExtGetLinkTypeAndHopCount.
_HSA_LINK_TYPES = {0: "hypertransport", 1: "qpi", 2: "pcie", 3: "infiniband", 4: "xgmi"}


def _link_name(value: Any) -> str:
    name = getattr(value, "name", None) or str(value)
    for known in ("xgmi", "pcie"):
        if known in name.lower():
            return known
    return name.lower()


def amdsmi_summary(device_count: int) -> tuple[dict[str, Any] | None, list[str]]:
    """(summary, errors); summary is None when amdsmi could not answer."""
    try:
        import amdsmi
    except Exception as e:
        return None, [f"amdsmi: not importable ({error_line(e)})"]
    try:
        amdsmi.amdsmi_init()
    except Exception as e:
        return None, [f"amdsmi: init failed ({error_line(e)})"]
    try:
        handles = amdsmi.amdsmi_get_processor_handles()
        summary: dict[str, Any] = {"gpus_per_node": len(handles), "link": "none"}
        if len(handles) >= 2:
            info = amdsmi.amdsmi_topo_get_link_type(handles[0], handles[1])
            summary.update(link=_link_name(info["type"]), hops=int(info["hops"]))
        return summary, []
    except Exception as e:
        return None, [f"amdsmi: topology query failed ({error_line(e)})"]
    finally:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception:
            pass  # shutdown failure after a finished query changes nothing we report


def _hip_call(hip: Any, fn_name: str, *args: Any) -> tuple[Any, ...]:
    """Call a hip-python function returning (hipError_t, *values); raise unless it succeeded."""
    err, *values = getattr(hip, fn_name)(*args)
    if err != hip.hipError_t.hipSuccess:
        raise RuntimeError(f"{fn_name} returned {err}")
    return tuple(values)


def hip_summary(device_count: int) -> tuple[dict[str, Any] | None, list[str]]:
    """(summary, errors); summary is None when hip-python could not answer."""
    try:
        from hip import hip
    except Exception as e:
        return None, [f"hip-python: not importable ({error_line(e)})"]
    try:
        (count,) = _hip_call(hip, "hipGetDeviceCount")
        summary: dict[str, Any] = {"gpus_per_node": int(count), "link": "none"}
        if count >= 2:
            link_type, hops = _hip_call(hip, "hipExtGetLinkTypeAndHopCount", 0, 1)
            summary.update(link=_HSA_LINK_TYPES.get(int(link_type), str(link_type)), hops=int(hops))
        return summary, []
    except Exception as e:
        return None, [f"hip-python: call failed ({error_line(e)})"]


def link_summary(device_count: int) -> tuple[dict[str, Any], list[str]]:
    """({gpus_per_node, link[, hops]}, errors); never raises; link "unknown" if nothing answers."""
    errors: list[str] = []
    for source in (amdsmi_summary, hip_summary):
        summary, errs = source(device_count)
        errors.extend(errs)
        if summary is not None:
            return summary, errors
    return {"gpus_per_node": device_count, "link": "unknown"}, errors
