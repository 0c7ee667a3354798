"""Ranks started once and reused: inside `shared_ranks()`, `run_ranks` on CPU hands each call to
a pool of gloo ranks that already joined their process group, instead of spawning new ones.

Starting two ranks costs two interpreters importing torch and longmoe (seconds on a 2-core
machine), often more than the work they run; the test suite makes dozens of such calls. The
ranks are real processes on a real gloo group, exactly as `run_ranks` starts them; between calls
each rank restores its environment and working directory, draws a fresh torch seed (a new
process starts with a random one too) and resets the default dtype and grad mode.

A pool serves the calls made with the parent's environment, working directory and import path
as they were when it started; a call made with any of them changed (a test that sets an
environment variable its ranks read) gets a pool of its own. Up to MAX_POOLS pools stay open,
the least recently used closed first. A call that fails on any rank ends the
pool (its peers may be waiting inside a collective that will never complete) and raises what
`torch.multiprocessing` raises for a failed rank; the next call starts a new pool.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Per-test bookkeeping pytest sets in the parent; no rank reads it.
_IGNORED_ENV = ("PYTEST_CURRENT_TEST",)


def _context_key() -> tuple:
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k not in _IGNORED_ENV))
    return env, os.getcwd(), tuple(sys.path)


def _serve(rank: int, world: int, out_dir: str, tasks, results):
    from longmoe.backends import get_backend
    backend = get_backend("cpu")
    backend.apply_collective_env()
    backend.set_device(rank)
    dist.init_process_group(backend.dist_backend, init_method=f"file://{out_dir}/rendezvous",
                            rank=rank, world_size=world)
    env, cwd, parent = dict(os.environ), os.getcwd(), os.getppid()
    while True:
        try:
            job = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the parent is gone: nobody will ask again
                break
            continue
        if job is None:
            break
        n, fn, args = job
        torch.seed()
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            result = fn(rank, world, backend, *args)
            torch.save(result, Path(out_dir) / f"call{n}-rank{rank}.pt")
            results.put((n, rank, None))
        except BaseException:
            results.put((n, rank, traceback.format_exc()))
            break
        finally:
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
    results.close()
    results.join_thread()  # what was put reaches the parent before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as in run_ranks: no interpreter finalisation under live gloo connections


class RankPool:
    """`world` CPU ranks on one gloo group, serving calls one at a time."""

    def __init__(self, world: int):
        self.world, self.calls = world, 0
        self._dir = tempfile.TemporaryDirectory(prefix="longmoe-pool-")
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._procs = [ctx.Process(target=_serve, args=(r, world, self._dir.name, self._tasks[r],
                                                        self._results), daemon=False)
                       for r in range(world)]
        for p in self._procs:
            p.start()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn, args: tuple) -> list:
        n = self.calls = self.calls + 1
        for q in self._tasks:
            q.put((n, fn, args))
        pending = set(range(self.world))
        while pending:
            try:
                got, rank, error = self._results.get(timeout=1.0)
            except queue.Empty:
                self._check_alive(pending)
                continue
            if got != n:
                continue
            if error is not None:
                pid = self._procs[rank].pid
                self.close(kill=True)
                raise mp.ProcessRaisedException(
                    f"\n\n-- Process {rank} terminated with the following error:\n{error}",
                    rank, pid)
            pending.discard(rank)
        out = []
        for r in range(self.world):
            f = Path(self._dir.name) / f"call{n}-rank{r}.pt"
            out.append(torch.load(f, weights_only=False))
            f.unlink()
        return out

    def _check_alive(self, pending: set[int]):
        for r in sorted(pending):
            p = self._procs[r]
            if not p.is_alive():
                code, pid = p.exitcode, p.pid
                self.close(kill=True)
                raise mp.ProcessExitedException(
                    f"process {r} terminated with exit code {code}", error_index=r,
                    error_pid=pid, exit_code=code)

    def close(self, kill: bool = False):
        procs, self._procs = self._procs, []
        if not kill:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 30
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        self._dir.cleanup()


MAX_POOLS = 4
# (world, context key) -> pool, least recently used first; None outside shared_ranks()
_POOLS: dict[tuple, RankPool] | None = None


def pooled(world: int, device: str) -> RankPool | None:
    """The pool `run_ranks` should use for this call, or None (outside `shared_ranks()`, or not
    on CPU)."""
    if _POOLS is None or device != "cpu":
        return None
    key = (world, _context_key())
    pool = _POOLS.pop(key, None)
    if pool is not None and not pool.alive:
        pool.close(kill=True)
        pool = None
    if pool is None:
        while len(_POOLS) >= MAX_POOLS:
            _POOLS.pop(next(iter(_POOLS))).close()
        pool = RankPool(world)
    _POOLS[key] = pool  # now the most recently used
    return pool


@contextlib.contextmanager
def shared_ranks():
    """While open, `run_ranks(..., device="cpu")` reuses one pool of ranks per world size;
    closing it stops them. Nested uses share the outermost one's pools."""
    global _POOLS
    if _POOLS is not None:
        yield
        return
    _POOLS = {}
    try:
        yield
    finally:
        pools, _POOLS = _POOLS, None
        for pool in pools.values():
            pool.close(kill=not pool.alive)
