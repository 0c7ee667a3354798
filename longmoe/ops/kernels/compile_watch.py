"""What a training step spends compiling kernels: Triton's compilation listener sees every kernel
variant the step compiles (and every one it reads back from Triton's on-disk cache), with the
compiler's own stage times.

A first step is slower than the next ones because each kernel variant it meets (a new set of
constexprs or argument specialisations) compiles on its first launch, one after another on the
host. The step log reports, per step, the variants compiled, the compiler's seconds and the
variants read from the disk cache, so the first step's excess can be split into compiling and
everything else (first-use setup of libraries, the allocator growing). Where Triton has no
listener (not installed, or a version without `triton.knobs.compilation.listener`) the watch is
inactive and the step log carries no such fields.
"""

from __future__ import annotations


def _seconds(times) -> float:
    """The compiler's time from a listener's CompileTimes (microseconds), 0 where absent."""
    if times is None:
        return 0.0
    us = getattr(times, "ir_initialization", 0) or 0
    us += sum(d for _, d in (getattr(times, "lowering_stages", None) or ()))
    us += getattr(times, "store_results", 0) or 0
    return us / 1e6


class CompileWatch:
    """Counts compiles between `take()` calls. `start()` chains onto a listener already set
    (another tool's), `stop()` puts it back. With `record`, every variant compiled or loaded
    from the cache also becomes a manifest entry in `entries` (longmoe.ops.kernels.precompile)."""

    def __init__(self, record: bool = False):
        self.active, self.record, self.entries = False, record, []
        self._knobs = self._listen = self._prev = None
        self._reset()

    def _reset(self):
        self.compiled, self.seconds, self.cache_loads = 0, 0.0, 0

    def start(self) -> "CompileWatch":
        try:
            from triton import knobs
            comp = knobs.compilation
            prev = comp.listener
        except (ImportError, AttributeError):
            return self

        def listen(*, src, metadata, metadata_group, times, cache_hit, **extra):
            if self.record:
                from longmoe.ops.kernels.precompile import entry
                e = entry(src, metadata)
                if e is not None:
                    self.entries.append(e)
            if cache_hit:
                self.cache_loads += 1
            else:
                self.compiled += 1
                self.seconds += _seconds(times)
            if prev is not None:
                prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit, **extra)

        comp.listener = listen
        self._knobs, self._listen, self._prev, self.active = comp, listen, prev, True
        return self

    def stop(self):
        if self.active and self._knobs.listener is self._listen:
            self._knobs.listener = self._prev
        self.active = False

    def take(self) -> dict | None:
        """{kernel_compiles, kernel_compile_s, kernel_cache_loads} since the last take (None
        when inactive), and start counting again."""
        if not self.active:
            return None
        out = {"kernel_compiles": self.compiled, "kernel_compile_s": self.seconds,
               "kernel_cache_loads": self.cache_loads}
        self._reset()
        return out
