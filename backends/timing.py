"""Timers that return elapsed milliseconds: wall clock on the host, event pairs on a GPU stream."""

from __future__ import annotations

import time

import torch


class Timer:
    """Use as `with backend.timer() as t: ...; t.elapsed_ms`, or `t.start(); ...; ms = t.stop()`."""

    elapsed_ms: float | None = None

    def start(self) -> "Timer":
        raise NotImplementedError

    def stop(self) -> float:
        raise NotImplementedError

    def __enter__(self) -> "Timer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class WallTimer(Timer):
    """Host wall clock; right for CPU work, wrong for asynchronous GPU work (use EventTimer)."""

    def __init__(self) -> None:
        self._t0: float | None = None

    def start(self) -> "WallTimer":
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> float:
        if self._t0 is None:
            raise RuntimeError("timer stopped before it was started")
        self.elapsed_ms = (time.perf_counter() - self._t0) * 1e3
        return self.elapsed_ms


class EventTimer(Timer):
    """A pair of timing events on the current stream: measures device time, not launch time.

    torch exposes the same event API on every GPU build, so one class serves all of them.
    """

    def __init__(self) -> None:
        self._start: torch.cuda.Event | None = None

    def start(self) -> "EventTimer":
        self._start = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)
        self._start.record()
        return self

    def stop(self) -> float:
        if self._start is None:
            raise RuntimeError("timer stopped before it was started")
        self._end.record()
        # Wait for this event only, not the whole device, so other streams keep running.
        self._end.synchronize()
        self.elapsed_ms = float(self._start.elapsed_time(self._end))
        return self.elapsed_ms
