"""`train.kernel_manifest` over one process's life, for every driver of a PolicyTrainer (the CLI's
step loop, the verl engine): the manifest's kernel variants compile ahead in spawned processes
from before the model build on (longmoe.ops.kernels.precompile), and the variants this process
compiles or reads from Triton's cache are watched (counted per call, and on rank 0 added to the
manifest, made if missing).

    run = ManifestRun(path, backend, rank, "call")  # before the PolicyTrainer is built
    ...build, then per step or call:
    run.begin()                                     # compiles before this point are not its
    ...work...
    lines, compiles, pool = run.end()               # log lines, the call's compile counts,
                                                    # the pool's fields once it is collected
    run.close()
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

from longmoe.errors import UserError
from longmoe.ops.kernels import precompile
from longmoe.ops.kernels.compile_watch import CompileWatch
from longmoe.ops.kernels.precompile import Precompile


def check_kernel_manifest(path: str):
    """An existing manifest must read as one; a new one needs a directory to be written in."""
    if os.path.exists(path):
        try:
            precompile.load(path)
        except ValueError as e:
            raise UserError(f"train.kernel_manifest: {e}") from None
    elif not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UserError(f"train.kernel_manifest: {path}: its directory does not exist")


def start_precompile(path: str, backend) -> Precompile | None:
    """The manifest at `path` on a GPU: this rank's share of its variants for this device's
    target (every local_world-th, from its local rank) compiling in its share of the host's
    cores. None where there is nothing to compile (no manifest yet, a CPU, no Triton target)."""
    if not path or backend.device_type == "cpu" or not os.path.exists(path):
        return None
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()
                                     if dist.is_initialized() else 1))
    target = precompile.current_target()
    if target is None:
        return None
    cores = max(1, (os.cpu_count() or 1) // local_world)
    entries = precompile.for_target(precompile.load(path), target)
    return precompile.start(entries[local::local_world], workers=cores)


def finish_precompile(pre: Precompile, path: str) -> tuple[str, dict]:
    """Collect the pool after the first step or call (by then it has finished: its variants go
    in the order the last run first launched them, ahead of this run's launches, and a launch
    that gets ahead of it compiles that variant itself, as without a manifest); the log line and
    the fields (kernel_precompiled: variants compiled ahead; kernel_precompile_s: the pool's wall
    time from its start beside the model build; kernel_precompile_wait_after_s: how long
    collecting it waited)."""
    t0 = time.perf_counter()
    r = pre.wait()
    waited = time.perf_counter() - t0
    failed = (f"; {r['failed']} failed (their launches compile them)" if r["failed"] else "")
    return (f"train.kernel_manifest: {r['entries']} variant(s) from {path} compiled by "
            f"{r['workers']} process(es) in {r['wall_s']:.1f} s from the model build on"
            f"{failed}"), {
        "kernel_precompiled": r["entries"] - r["failed"], "kernel_precompile_s": r["wall_s"],
        "kernel_precompile_wait_after_s": waited}


# Manifests whose pool a ManifestRun of this process started: verl's actor and reference policy
# can be two engines in one process, and the second would compile the same variants again.
_POOLS_STARTED: set[str] = set()


class ManifestRun:
    """The pool (started here, once per manifest and process: build the model after this) and
    the compile watch of one driver. `what` names a step or call in the log lines ("step",
    "call")."""

    def __init__(self, path: str, backend, rank: int, what: str = "step"):
        self.path, self.what = path, what
        key = os.path.abspath(path) if path else ""
        self.pre = None if key in _POOLS_STARTED else start_precompile(path, backend)
        if self.pre is not None:  # beside the model build that follows
            _POOLS_STARTED.add(key)
        self.watch = CompileWatch(record=bool(path) and rank == 0).start()
        self.done = 0

    def begin(self):
        self.watch.take()  # compiles before this step or call (model build, data) are not its

    def end(self, number: int | None = None, collect: bool = True
            ) -> tuple[list[str], dict | None, dict]:
        """(log lines, this step's or call's compile counts (None where Triton has no
        listener), the pool's fields once it is collected, else {}). `number`: the step's or
        call's number in the log lines (default: how many ended in this process). The pool is
        collected at the first end() with `collect` (waiting for what it has left), or earlier
        at one that finds it finished."""
        self.done += 1
        number = self.done if number is None else number
        lines, compiles, first = [], self.watch.take(), {}
        if self.watch.entries:
            n, added = precompile.merge(self.path, self.watch.entries)
            if added:
                lines.append(f"train.kernel_manifest: {added} new variant(s) of {self.what} "
                             f"{number} added to {self.path} ({n} in all)")
            self.watch.entries.clear()
        if self.pre is not None and (collect or self.pre.done()):
            line, first = finish_precompile(self.pre, self.path)
            lines.append(line)
            self.pre = None
        return lines, compiles, first

    def close(self):
        """Stop watching; a pool not yet collected (stopped before its first step ended) is
        shut down without waiting."""
        self.watch.stop()
        if self.pre is not None and self.pre.pool is not None:
            self.pre.pool.shutdown(wait=False, cancel_futures=True)
        self.pre = None
