"""Progress of the long commands (kernels compile, tune chunks, paired), on stderr so that their
stdout stays a table or JSON: one line rewritten in place on a terminal, a line per quarter of
the work when stderr is a file or a pipe (CI logs, `2> log`)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None):
        self.label, self.total = label, max(total, 0)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self._last_quarter = -1

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.t0

    def update(self, done: int, note: str = "") -> None:
        """`done` of `total` finished; `note` names the item just finished."""
        head = f"{self.label}: {done}/{self.total}"
        if self.tty:
            self.stream.write(f"\r\x1b[K{head} {note}"[:200])
        else:
            quarter = 4 * done // self.total if self.total else 4
            if quarter == self._last_quarter:
                return
            self._last_quarter = quarter
            self.stream.write(f"{head} ({self.elapsed_s:.0f} s)\n")
        self.stream.flush()

    def finish(self, text: str) -> None:
        """The item's one-line outcome, with the time it took."""
        if self.tty:
            self.stream.write("\r\x1b[K")
        self.stream.write(f"{self.label}: {text} ({self.elapsed_s:.0f} s)\n")
        self.stream.flush()


def note(text: str, stream: TextIO | None = None) -> None:
    """One line of status on stderr."""
    stream = stream if stream is not None else sys.stderr
    stream.write(text + "\n")
    stream.flush()
