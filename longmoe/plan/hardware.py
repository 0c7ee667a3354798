"""Accelerator profiles: data in hardware.json (each figure with its source), read here."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from longmoe.errors import UserError

_FILE = Path(__file__).with_name("hardware.json")
GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    arch: str
    bf16_dense_tflops: float
    hbm_gb: float
    usable_gib: float
    hbm_tb_s: float
    gpus_per_node: int
    intra_node_fabric: str
    intra_node_gb_s: float
    inter_node_gb_s: float
    simd_width: int
    unconfirmed: tuple[str, ...] = ()
    backend: str = ""      # the longmoe.backends name that runs this part
    link: str = ""         # the intra-node link kind its backend's probe reports

    @property
    def usable_bytes(self) -> int:
        return int(self.usable_gib * GiB)


@lru_cache(maxsize=1)
def _raw() -> dict:
    return json.loads(_FILE.read_text())


def names() -> list[str]:
    return sorted(_raw()["profiles"])


def profiles() -> dict[str, dict]:
    """The raw profiles of hardware.json, by key (the figures with their sources)."""
    return _raw()["profiles"]


def aliases() -> dict[str, str]:
    """Other spellings of the profile keys ("h100-sxm" -> "h100")."""
    return dict(_raw()["aliases"])


def profile_for_device(device_name: str) -> Hardware | None:
    """The profile whose key appears in a device's reported name ("NVIDIA H200" -> h200), or
    None (CPU, or a device without a profile)."""
    name = device_name.lower().replace(" ", "")
    if not name:
        return None
    for key in _raw()["profiles"]:
        if key in name:
            return get_hardware(key)
    return None


def get_hardware(name: str) -> Hardware:
    raw = _raw()
    key = name.strip().lower()
    key = raw["aliases"].get(key, key)
    if key not in raw["profiles"]:
        raise UserError(f"--hardware: unknown hardware {name!r}; valid: {', '.join(names())}")
    p = raw["profiles"][key]
    return Hardware(key=key, name=p["name"], arch=p["arch"],
                    bf16_dense_tflops=p["bf16_dense_tflops"], hbm_gb=p["hbm_gb"],
                    usable_gib=p["usable_gib"], hbm_tb_s=p["hbm_tb_s"],
                    gpus_per_node=p["gpus_per_node"], intra_node_fabric=p["intra_node_fabric"],
                    intra_node_gb_s=p["intra_node_gb_s"], inter_node_gb_s=p["inter_node_gb_s"],
                    simd_width=p["simd_width"], unconfirmed=tuple(p.get("unconfirmed", ())),
                    backend=p.get("backend", ""), link=p.get("link", ""))
