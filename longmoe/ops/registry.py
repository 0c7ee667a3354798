"""One small registry per primitive: `impl="auto"` or a name.

A named implementation that cannot run here raises `ImplUnavailable` with the reason; "auto" walks
the priority list, takes the first that can run, and logs which one it picked (once per key).
Every registry calls its plain-PyTorch reference "reference"; a name an implementation was known
by before is rejected with its new name (`renamed`), never mapped silently.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from longmoe.errors import ConfigError

log = logging.getLogger("longmoe.ops")
REFERENCE = "reference"


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
    def __init__(self, primitive: str, renamed: dict[str, str] | None = None):
        self.primitive = primitive
        self._impls: dict[str, Impl] = {}
        self._announced: set[tuple] = set()
        self.renamed = dict(renamed or {})  # former name -> current name

    def register(self, name: str, *, priority: int = 0, reference: bool = False,
                 check: Callable[..., str | None] = lambda *a, **k: None):
        if reference != (name == REFERENCE):
            raise ValueError(f"{self.primitive}: the reference implementation is registered as "
                             f"{REFERENCE!r} (and only it), got {name!r}")

        def deco(fn):
            self._impls[name] = Impl(name, fn, check, priority, reference)
            return fn
        return deco

    def renamed_message(self, name: str) -> str | None:
        """"impl 'x' is now called 'y'" for a former name, else None."""
        if name in self.renamed and name not in self._impls:
            return f"impl {name!r} is now called {self.renamed[name]!r}"
        return None

    def check_name(self, name: str, field: str, extra: tuple[str, ...] = ()) -> None:
        """ConfigError naming `field` unless `name` is auto, a registered impl or in `extra`."""
        valid = ("auto", *self.names(), *extra)
        if name in valid:
            return
        was = self.renamed_message(name)
        raise ConfigError(field, was if was else
                          f"unknown implementation {name!r}; valid: {', '.join(valid)}")

    def names(self) -> list[str]:
        return sorted(self._impls, key=lambda n: -self._impls[n].priority)

    @property
    def reference(self) -> str:
        return next(n for n, i in self._impls.items() if i.reference)

    def why_not(self, name: str, *args, **kw) -> str | None:
        return self._impls[name].check(*args, **kw)

    def select(self, impl: str, *args, **kw) -> Impl:
        if impl != "auto":
            was = self.renamed_message(impl)
            if was:
                raise ImplUnavailable(f"{self.primitive}: {was}")
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


@contextlib.contextmanager
def trial_call():
    """Scope of a one-time trial call (a fast path checked against its reference on first use).
    That first use can fall inside a recomputed block's forward: the trial's own autograd would
    then save tensors through torch.utils.checkpoint's hooks, the recomputation (which finds the
    verdict cached) would save fewer, and the backward would fail. Innermost identity hooks keep
    the trial's saved tensors to itself."""
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        yield
