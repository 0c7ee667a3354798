"""Peak tensor memory of a function, on any device.

Accelerators report their allocator's peak through the backend. On CPU there is no allocator
counter, so `TensorBytes` (a TorchDispatchMode) adds up the storages that ops create and drops
them when their tensor dies. It sees every tensor made inside the mode, autograd's saved tensors
included; a storage kept alive only through a view of a dead base is counted as freed early, so
the figure is a slight underestimate, never an overestimate of what the ops allocated.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._owned: dict[int, int] = {}

    def _free(self, key: int):
        self.live -= self._owned.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                key = t.untyped_storage().data_ptr()
                nbytes = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                continue
            if key == 0 or key in self._owned:
                continue
            self._owned[key] = nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, key)
        return out


def measure(fn, backend, repeats: int = 1):
    """(result of the last call, peak extra bytes over what existed before, median ms).
    On CPU the memory run is separate from the timed runs: the tracking mode slows every op."""
    times = []
    peak = 0
    result = None
    if backend.device_type == "cpu":
        mode = TensorBytes()
        with mode:
            fn()
        peak = mode.peak
    for i in range(max(1, repeats)):
        backend.synchronize()
        if backend.device_type == "cpu":
            t0 = time.perf_counter()
            result = fn()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            base = backend.memory_allocated()
            backend.reset_peak_memory()
            timer = backend.timer()
            timer.start()
            result = fn()
            times.append(timer.stop())
            peak = max(peak, backend.peak_memory_bytes() - base)
    times.sort()
    return result, peak, times[len(times) // 2]
