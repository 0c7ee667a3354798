"""Run a function on N local ranks with real process groups (gloo on CPU) and collect what each
rank returns. Used by `longmoe paired` and the tests; no collective is ever mocked."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, fn, args: tuple, out_dir: str, device: str):
    from longmoe.backends import get_backend
    from longmoe.train.trainer import leave_together
    backend = get_backend(device)
    backend.apply_collective_env()
    backend.set_device(rank)
    # A file store in this call's own temporary directory: no port to race for.
    dist.init_process_group(backend.dist_backend, init_method=f"file://{out_dir}/rendezvous",
                            rank=rank, world_size=world)
    try:
        result = fn(rank, world, backend, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        leave_together()
    finally:
        dist.destroy_process_group()
    # Skip interpreter finalisation in the spawned rank (see longmoe.train.trainer.rank_main).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, *args, device: str = "cpu") -> list:
    """fn(rank, world, backend, *args) on `world` spawned ranks; returns their results in order.
    `fn` must be importable (module level) because ranks start with spawn. Inside
    `rank_pool.shared_ranks()`, CPU calls run on ranks started once and reused."""
    from longmoe.paired.rank_pool import pooled
    pool = pooled(world, device)
    if pool is not None:
        return pool.run(fn, args)
    with tempfile.TemporaryDirectory(prefix="longmoe-ranks-") as out:
        mp.start_processes(_entry, args=(world, fn, args, out, device),
                           nprocs=world, start_method="spawn", join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
