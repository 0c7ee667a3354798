"""Supervised local ranks: spawn N processes running one function, wait, and end with one line.

The first failure (an error a rank raised, or a signal that killed it) ends the launch with one
line naming the rank and the error or signal; the other ranks are stopped. SIGINT or SIGTERM
sent to the launcher stop every rank (SIGTERM, SIGKILL after STOP_S). A launch's temporary files
(the rendezvous file, anything torch writes there) live in a private directory that is removed
however the launch ends; ranks whose launcher was killed remove it and exit.

Standard library only (and longmoe.errors): a rank process imports what its function needs.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import wait

from longmoe.errors import UserError

# After the first rank failure, peers get this long to exit (and report) on their own before
# being stopped: a peer's error is usually the echo of the first (a closed connection).
GRACE_S = 1.0
# SIGTERM to SIGKILL for a rank being stopped; with GRACE_S and the 0.2 s polling this stays
# inside the 5 s a user waits after an interrupt.
STOP_S = 2.0


class TrainingStopped(Exception):
    """The run stopped itself (non-finite steps or weights); the message is the one line to show."""
    exit_code = 3


def say(msg: str):
    print(f"error: {msg}", file=sys.stderr, flush=True)


class Interrupted(BaseException):
    """SIGINT or SIGTERM reached the launcher (a BaseException: no `except Exception` eats it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT/SIGTERM raise Interrupted once; later ones are ignored while ranks are stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, _frame):
        if not fired:
            fired.append(signum)
            raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def launch_dir():
    """A private directory for the launch's temporary files, TMPDIR for the ranks. torch's
    compile cache is not temporary (it is reused across runs): it stays where it would have been,
    TORCHINDUCTOR_CACHE_DIR or torchinductor_<user> in the usual temporary directory."""
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    saved_tempdir = tempfile.tempdir
    if saved["TORCHINDUCTOR_CACHE_DIR"] is None:
        with contextlib.suppress(KeyError, OSError):  # no user name: torch picks its own place
            user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                                 f"torchinductor_{user}")
    d = tempfile.mkdtemp(prefix="longmoe-launch-")
    os.environ["TMPDIR"], tempfile.tempdir = d, d
    try:
        yield d
    finally:
        tempfile.tempdir = saved_tempdir
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(d, ignore_errors=True)


# ---- in each rank ------------------------------------------------------------------------------

def _report(workdir: str, rank: int, kind: str, message: str, code: int, trace: str = "") -> int:
    """What ended this rank, for the launcher: written whole (rename) so it is never read half."""
    path = os.path.join(workdir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"kind": kind, "message": message, "exit_code": code, "traceback": trace,
                   "time": time.time()}, f)
    os.replace(path + ".tmp", path)
    return code


def _exit_with_launcher(launcher: int, workdir: str):
    """A launcher killed by SIGKILL can stop nobody: its ranks notice they were orphaned, remove
    the launch directory and exit."""
    def watch():
        while os.getppid() == launcher:
            time.sleep(0.5)
        shutil.rmtree(workdir, ignore_errors=True)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="longmoe-launcher-watch").start()


def _rank_process(target, rank: int, world: int, args: tuple, workdir: str):
    """Entry of a spawned rank: target(rank, world, *args, rendezvous_path). Ends the process
    with os._exit (see trainer.rank_main) and the exit code the launcher expects."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the launcher decides
    _exit_with_launcher(os.getppid(), workdir)
    try:
        target(rank, world, *args, os.path.join(workdir, "rendezvous"))
        code = 0
    except TrainingStopped as e:
        code = _report(workdir, rank, "stop", str(e), e.exit_code)
    except UserError as e:
        code = _report(workdir, rank, "user", str(e), 2)
    except BaseException as e:  # noqa: BLE001 - whatever it is, the launcher names it
        first = (str(e).strip().splitlines() or [""])[0]
        code = _report(workdir, rank, "error", f"{type(e).__name__}: {first}".rstrip(": "), 1,
                       traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- in the launcher ---------------------------------------------------------------------------

def _stop(procs) -> set[int]:
    """SIGTERM every running rank, SIGKILL those still there after STOP_S; which were stopped."""
    alive = {r for r, p in enumerate(procs) if p.is_alive()}
    for r in alive:
        procs[r].terminate()
    deadline = time.monotonic() + STOP_S
    for r in alive:
        procs[r].join(max(0.0, deadline - time.monotonic()))
    for r in alive:
        if procs[r].is_alive():
            procs[r].kill()
            procs[r].join(1.0)
    return alive


def _verdict(procs, stopped: set[int], workdir: str) -> int:
    """One line for the first failure, and the launch's exit code."""
    codes = [p.exitcode for p in procs]
    if all(c == 0 for c in codes):
        return 0
    reports = {}
    for r in range(len(procs)):
        path = os.path.join(workdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[r] = json.load(f)
    # A signal nobody here sent explains itself: the errors of its peers are its echo.
    for r, c in enumerate(codes):
        if c is not None and c < 0 and r not in stopped and r not in reports:
            sig = signal.Signals(-c).name
            oom = -c == signal.SIGKILL
            say(f"rank {r} was killed by {sig}"
                + (" (also what the kernel's out-of-memory killer sends)" if oom else ""))
            return 1
    if reports:
        r, rep = min(reports.items(), key=lambda kv: kv[1]["time"])
        if rep["kind"] == "error":
            sys.stderr.write(f"rank {r}: {rep['traceback']}")
            say(f"rank {r} failed: {rep['message']}")
        else:
            say(rep["message"])
        return rep["exit_code"]
    for r, c in enumerate(codes):
        if c and r not in stopped:
            say(f"rank {r} exited with code {c}")
            return 1
    say(f"rank(s) {', '.join(map(str, sorted(stopped)))} did not finish")
    return 1


def supervise(target, nproc: int, args: tuple, workdir: str) -> int:
    """Run target(rank, nproc, *args, rendezvous) on nproc spawned ranks until all finish or
    one fails (then stop the rest); print one line for a failure; return the exit code."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_process, args=(target, r, nproc, args, workdir),
                         name=f"longmoe-rank{r}") for r in range(nproc)]
    try:
        for p in procs:
            p.start()
        failed_at = None
        while True:
            running = [p for p in procs if p.exitcode is None]
            if not running or (failed_at is not None and time.monotonic() - failed_at > GRACE_S):
                break
            wait([p.sentinel for p in running], timeout=0.2)
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
    finally:
        stopped = _stop(procs)
    return _verdict(procs, stopped, workdir)


