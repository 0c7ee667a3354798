"""The collective adapter: what a vendor's process-group backend needs before and during init.

One subclass per vendor (`backends/<vendor>/collective.py`). It only describes and prepares; the
process group itself is created by longmoe.parallel, which asks the active backend for these.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

import torch

from longmoe.backends.transports import (ProcessGroupA2A, SymmetricMemoryA2A,
                                         symmetric_memory_unavailable)

TRANSPORTS = {"process_group": ProcessGroupA2A, "symmetric_memory": SymmetricMemoryA2A}
TRANSPORT_NAMES = tuple(TRANSPORTS)


class CollectiveAdapter:
    # torch.distributed backend name handed to init_process_group.
    dist_backend: str = "gloo"
    # Environment defaults set before init_process_group unless the user already set them.
    env_defaults: Mapping[str, str] = {}
    # Priority for the stream that carries all-to-all and reduce-scatter; lower is higher in torch.
    comm_stream_priority: int = 0
    # How expert all-to-all moves tokens (backends/transports.py), in the order "auto" tries them.
    a2a_transports: tuple[str, ...] = ("process_group",)
    # Why a transport this adapter leaves out is left out (shown when someone asks for it).
    a2a_missing: Mapping[str, str] = {}
    # Dtypes the process-group backend can sum in without silently upcasting or failing.
    reduce_dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float64})

    @property
    def a2a_transport(self) -> str:
        """What "auto" picks when nothing rules the first choice out."""
        return self.a2a_transports[0]

    def a2a_unavailable(self, name: str, device: torch.device) -> str | None:
        """Why transport `name` cannot run on `device` with this adapter, or None."""
        if name not in TRANSPORT_NAMES:
            return f"unknown transport {name!r}; valid: auto, {', '.join(TRANSPORT_NAMES)}"
        if name not in self.a2a_transports:
            return self.a2a_missing.get(name, f"{type(self).__name__} does not offer {name!r}")
        if name == "symmetric_memory":
            return symmetric_memory_unavailable(device)
        return None

    def a2a(self, name: str, device: torch.device):
        """A transport instance. "auto" takes the first one available here; a named one that
        cannot run raises ValueError with the reason (the caller names the setting)."""
        if name == "auto":
            for cand in self.a2a_transports:
                if self.a2a_unavailable(cand, device) is None:
                    return TRANSPORTS[cand]()
            return ProcessGroupA2A()
        why = self.a2a_unavailable(name, device)
        if why:
            raise ValueError(why)
        return TRANSPORTS[name]()

    def supports_reduce_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in self.reduce_dtypes

    def env(self) -> dict[str, str]:
        return dict(self.env_defaults)

    def env_to_apply(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The defaults not already present in `environ` (os.environ by default)."""
        environ = os.environ if environ is None else environ
        return {k: v for k, v in self.env_defaults.items() if k not in environ}

    def apply_env(self, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
        """Set the missing defaults; a value the user exported always wins. Returns what was set."""
        environ = os.environ if environ is None else environ
        applied = self.env_to_apply(environ)
        environ.update(applied)
        return applied
