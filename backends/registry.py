"""The backend registry: vendors register their Backend class here (backends/<vendor>/ imports
`register`), the rest of longmoe picks one through the functions below, re-exported by
longmoe.backends."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from longmoe.backends.base import Backend

ENV_VAR = "LONGMOE_BACKEND"
AUTO = "auto"
# Auto-detection tries these in order: a ROCm torch also reports torch.cuda.is_available(), so
# the ROCm check must come before the CUDA one.
DETECTION_ORDER = ("rocm", "cuda", "cpu")

log = logging.getLogger("longmoe.backends")

_REGISTRY: dict[str, type[Backend]] = {}
_INSTANCES: dict[str, Backend] = {}
_ACTIVE: Backend | None = None


def register(backend_cls: type[Backend]) -> type[Backend]:
    """Class decorator: make `backend_cls` reachable by its `name`."""
    if not backend_cls.name:
        raise ValueError(f"{backend_cls.__name__} has no name")
    _REGISTRY[backend_cls.name] = backend_cls
    _INSTANCES.pop(backend_cls.name, None)
    return backend_cls


def list_backends() -> list[str]:
    ordered = [n for n in DETECTION_ORDER if n in _REGISTRY]
    return ordered + sorted(n for n in _REGISTRY if n not in DETECTION_ORDER)


def backend_classes() -> dict[str, type[Backend]]:
    """The registered backend classes, in list_backends() order (class-level questions, such as
    compile targets, need no device)."""
    return {n: _REGISTRY[n] for n in list_backends()}


def availability() -> dict[str, str | None]:
    """Per registered backend: None when it can run here, else the one-line reason it cannot."""
    return {n: _REGISTRY[n].unavailable_reason() for n in list_backends()}


def _valid_names() -> str:
    return ", ".join(repr(n) for n in [*list_backends(), AUTO])


def detect_backend_name() -> str:
    """The first registered backend whose device is present, in DETECTION_ORDER."""
    for name in list_backends():
        if _REGISTRY[name].is_available():
            return name
    raise RuntimeError(f"no backend is available among {list_backends()}")


def get_backend(name: str) -> Backend:
    """The backend called `name` ("auto" detects one).

    Unknown name: ValueError listing the valid ones. Device not present: RuntimeError saying why.
    """
    key = name.strip().lower()
    if key == AUTO:
        key = detect_backend_name()
    cls = _REGISTRY.get(key)
    if cls is None:
        raise ValueError(f"unknown backend {name!r}; valid names: {_valid_names()}")
    if not cls.is_available():
        raise RuntimeError(f"backend {key!r} is not available: {cls.unavailable_reason()}")
    if key not in _INSTANCES:
        _INSTANCES[key] = cls()
    return _INSTANCES[key]


def active_backend() -> Backend:
    """The backend this process uses: ${ENV_VAR} when set (strict), else auto-detected."""
    global _ACTIVE
    if _ACTIVE is None:
        forced = os.environ.get(ENV_VAR, "").strip()
        if forced and forced.lower() != AUTO:
            try:
                _ACTIVE = get_backend(forced)
            except (ValueError, RuntimeError) as e:  # say where the bad name came from
                raise type(e)(f"{ENV_VAR}={forced!r}: {e}") from None
            log.info("longmoe backend: %s (from %s)", _ACTIVE.name, ENV_VAR)
        else:
            _ACTIVE = get_backend(AUTO)
            log.info("longmoe backend: auto-detected %s", _ACTIVE.name)
    return _ACTIVE


def reset_active_backend() -> None:
    """Forget the cached choice so the next active_backend() looks again (tests, env changes)."""
    global _ACTIVE
    _ACTIVE = None
