"""Installed versions of the packages longmoe cares about, read from metadata, never imported.

Importing megatron-core or a vendor library here would cost seconds and can fail on a machine
without the matching driver; package metadata answers the version question without either.
"""

from __future__ import annotations

from importlib import metadata

# Display name -> distributions that provide it, first match wins. The alternates are the names
# the same module ships under in vendor wheels (e.g. triton bundled with a ROCm torch).
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton-rocm", "pytorch-triton"),
    "liger-kernel": ("liger-kernel", "liger-kernel-nightly"),
    "megatron-core": ("megatron-core",),
    "cut-cross-entropy": ("cut-cross-entropy",),
    "hip-python": ("hip-python",),
    "pynvml": ("nvidia-ml-py", "pynvml"),
    "amdsmi": ("amdsmi",),
}


def package_version(name: str) -> str | None:
    for dist in DISTRIBUTIONS.get(name, (name,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def versions(names: tuple[str, ...] | None = None) -> dict[str, str | None]:
    """Version string per package, None where it is not installed."""
    return {n: package_version(n) for n in (names or tuple(DISTRIBUTIONS))}
