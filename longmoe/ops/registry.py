"""One small registry per primitive: `impl="auto"` or a name.

A named implementation that cannot run here raises `ImplUnavailable` with the reason; "auto" walks
the priority list, takes the first that can run, and logs which one it picked (once per key).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("longmoe.ops")


class ImplUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Impl:
    name: str
    fn: Callable
    # Returns None when the impl can run for these arguments, else a one-line reason.
    check: Callable[..., str | None]
    priority: int  # higher is tried first by "auto"
    reference: bool = False


class Registry:
    def __init__(self, primitive: str):
        self.primitive = primitive
        self._impls: dict[str, Impl] = {}
        self._announced: set[tuple] = set()

    def register(self, name: str, *, priority: int = 0, reference: bool = False,
                 check: Callable[..., str | None] = lambda *a, **k: None):
        def deco(fn):
            self._impls[name] = Impl(name, fn, check, priority, reference)
            return fn
        return deco

    def names(self) -> list[str]:
        return sorted(self._impls, key=lambda n: -self._impls[n].priority)

    @property
    def reference(self) -> str:
        return next(n for n, i in self._impls.items() if i.reference)

    def why_not(self, name: str, *args, **kw) -> str | None:
        return self._impls[name].check(*args, **kw)

    def select(self, impl: str, *args, **kw) -> Impl:
        if impl != "auto":
            if impl not in self._impls:
                raise ImplUnavailable(f"{self.primitive}: unknown impl {impl!r}; "
                                      f"valid: auto, {', '.join(self.names())}")
            reason = self._impls[impl].check(*args, **kw)
            if reason:
                raise ImplUnavailable(f"{self.primitive}: impl {impl!r} cannot run here: {reason}")
            return self._impls[impl]
        skipped = []
        for name in self.names():
            reason = self._impls[name].check(*args, **kw)
            if reason is None:
                key = (name, tuple(skipped))
                if key not in self._announced:
                    self._announced.add(key)
                    why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
                    log.info("%s: auto picked %r%s", self.primitive, name, why)
                return self._impls[name]
            skipped.append(f"{name}: {reason}")
        raise ImplUnavailable(f"{self.primitive}: no impl can run: {'; '.join(skipped)}")
