"""Compute/communication streams for overlapping collectives with GEMMs.

The core schedules work through this small interface and never touches a vendor's stream API:
`HostStreams` (CPU: one ordered queue, every call a no-op) and `DeviceStreams` (one extra
communication stream on the current device, ordered against the compute stream with events).
"""

from __future__ import annotations

import contextlib

import torch


class HostStreams:
    """No streams: work runs in the order it is issued, which is already a valid schedule."""

    overlaps = False

    def __init__(self):
        # Marks of comm work some later step must wait for before reading its results (the
        # chunked EP pipeline leaves its last combine in flight for the shared expert).
        self.pending: list = []

    def flush_pending(self) -> None:
        for mark in self.pending:
            self.compute_waits(mark)
        self.pending.clear()

    def comm(self):
        return contextlib.nullcontext()

    def comm_waits_compute(self) -> None:
        """Work issued on the comm stream from now on waits for compute issued so far."""

    def mark_comm(self):
        """A marker after the comm work issued so far (pass to compute_waits)."""
        return None

    def compute_waits(self, mark) -> None:
        """Compute issued from now on waits for the comm work before `mark`."""

    def comm_uses(self, t: torch.Tensor) -> None:
        """`t` (allocated on the compute stream) is read or written by comm work in flight: its
        memory must not be reused before that work ends, even if Python drops it."""


class DeviceStreams(HostStreams):
    """A communication stream beside the current (compute) stream of a torch.cuda-API device
    (NVIDIA and AMD alike). `priority` comes from the backend's collective adapter."""

    overlaps = True

    def __init__(self, priority: int = 0):
        super().__init__()
        # The device index, passed to current_stream: without it each call looks the current
        # device up in Python (under cProfile on an H200 host, 495 such calls took 15 ms of five
        # 16K-token layer steps at C = 8; a chunked layer makes dozens per step).
        self.device = torch.cuda.current_device()
        self.stream = torch.cuda.Stream(self.device, priority=priority)

    def comm(self):
        return torch.cuda.stream(self.stream)

    def comm_waits_compute(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def mark_comm(self):
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def compute_waits(self, mark) -> None:
        if mark is not None:
            torch.cuda.current_stream(self.device).wait_event(mark)

    def comm_uses(self, t: torch.Tensor) -> None:
        t.record_stream(self.stream)
