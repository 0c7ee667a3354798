"""Run a function on N local ranks with real process groups (gloo on CPU) and collect what each
rank returns. Used by `longmoe paired` and the tests; no collective is ever mocked."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args: tuple, out_dir: str, device: str):
    from longmoe.backends import get_backend
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = get_backend(device)
    backend.apply_collective_env()
    backend.set_device(rank)
    dist.init_process_group(backend.dist_backend, rank=rank, world_size=world)
    try:
        result = fn(rank, world, backend, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, device: str = "cpu") -> list:
    """fn(rank, world, backend, *args) on `world` spawned ranks; returns their results in order.
    `fn` must be importable (module level) because ranks start with spawn."""
    with tempfile.TemporaryDirectory(prefix="longmoe-ranks-") as out:
        mp.start_processes(_entry, args=(world, _free_port(), fn, args, out, device),
                           nprocs=world, start_method="spawn", join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
