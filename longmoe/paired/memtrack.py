"""Peak tensor memory of a function, on any device.

Accelerators report their allocator's peak through the backend. On CPU there is no allocator
counter, so `TensorBytes` (a TorchDispatchMode) adds up the storages that ops create and drops
each one when the last tensor made inside the mode that uses it dies (views count as users, and
storages are told apart by their storage object, not their address, so a storage is never freed
early and a new one is never mistaken for an old one). A storage whose memory is released while
its tensors live (`untyped_storage().resize_(0)`, as FSDP does) stays counted until they die. It sees
every tensor made inside the mode, autograd's saved tensors included. Views of storages that
existed before the mode are not counted; a storage kept alive only by a tensor made outside any
dispatch is counted as freed early, so the figure never overestimates what the ops allocated.
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
        self._owned: dict[int, list[int]] = {}  # storage object -> [bytes, live tensors on it]

    def _release(self, key: int):
        entry = self._owned.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._owned[key]
            self.live -= entry[0]

    @staticmethod
    def _key(t):
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return None
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() == 0:
                return None
            return storage._cdata, storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {k[0] for a in tree_leaves((args, kwargs)) if (k := self._key(a)) is not None}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            k = self._key(t)
            if k is None:
                continue
            key, nbytes = k
            entry = self._owned.get(key)
            if entry is None:
                if key in before:  # a view or in-place result on memory from before the mode
                    continue
                entry = self._owned[key] = [nbytes, 0]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(t, self._release, key)
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
