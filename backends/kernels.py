"""Kernel launch configs as data: `<vendor>/kernels.json`, keyed kernel -> arch -> shape bucket.

Tuned numbers live in JSON so the tuner can rewrite them without touching code. Lookup falls back
from the most specific key to the least: (arch, bucket), (arch, "any"), ("any", bucket),
("any", "any"). Keys that start with "_" are notes for readers and never match a kernel.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Mapping

ANY = "any"


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Mapping[str, Any]:
    p = Path(path)
    if not p.exists():
        return {}
    with p.open() as f:
        table = json.load(f)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object of kernels, got {type(table).__name__}")
    return table


def load_kernel_table(path: str | Path) -> Mapping[str, Any]:
    """Parsed table, cached per path; a missing file is an empty table (every lookup misses)."""
    return _load(str(Path(path).resolve()))


def lookup_kernel_config(
    table: Mapping[str, Any], kernel: str, arch: str, shape_bucket: str | None = None
) -> dict[str, Any]:
    """The most specific config for `kernel` on `arch` and `shape_bucket`, as a fresh dict."""
    by_arch = table.get(kernel) if not kernel.startswith("_") else None
    if not isinstance(by_arch, dict):
        known = sorted(k for k in table if not k.startswith("_"))
        raise KeyError(f"no kernel config for kernel {kernel!r}; this table has {known}")
    bucket = shape_bucket or ANY
    for a, b in ((arch, bucket), (arch, ANY), (ANY, bucket), (ANY, ANY)):
        cfg = by_arch.get(a, {}).get(b)
        if cfg is not None:
            return dict(cfg)
    raise KeyError(
        f"kernel {kernel!r} has no config for arch {arch!r}, bucket {bucket!r}, "
        "and no 'any' fallback"
    )


def kernel_config_from(
    path: str | Path, kernel: str, arch: str, shape_bucket: str | None = None
) -> dict[str, Any]:
    """Lookup against the JSON file at `path` (backends pass theirs; tests pass their own)."""
    return lookup_kernel_config(load_kernel_table(path), kernel, arch, shape_bucket)
