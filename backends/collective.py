"""The collective adapter: what a vendor's process-group backend needs before and during init.

One subclass per vendor (`backends/<vendor>/collective.py`). It only describes and prepares; the
process group itself is created by longmoe.parallel, which asks the active backend for these.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping

import torch


class CollectiveAdapter:
    # torch.distributed backend name handed to init_process_group.
    dist_backend: str = "gloo"
    # Environment defaults set before init_process_group unless the user already set them.
    env_defaults: Mapping[str, str] = {}
    # Priority for the stream that carries all-to-all and reduce-scatter; lower is higher in torch.
    comm_stream_priority: int = 0
    # How expert all-to-all moves tokens: "process_group" = torch.distributed.all_to_all_single.
    a2a_transport: str = "process_group"
    # Dtypes the process-group backend can sum in without silently upcasting or failing.
    reduce_dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float64})

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
