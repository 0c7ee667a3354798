"""Shared ranks (longmoe/paired/rank_pool.py): calls reuse one gloo group, return what fresh
ranks return, a failing rank raises its own error and ends the pool, and a changed environment
gets a pool of its own."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longmoe.paired import rank_pool
from longmoe.paired.spawn import run_ranks


def _sum_rank(rank, world, backend, scale):
    t = torch.full((3,), float(rank + 1) * scale)
    dist.all_reduce(t)
    os.environ["LONGMOE_POOL_PROBE"] = "set by a call"  # undone before the next call
    return {"pid": os.getpid(), "sum": t, "probe": os.environ.get("LONGMOE_POOL_ENV"),
            "dtype": torch.get_default_dtype()}


def _dtype_rank(rank, world, backend):
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    return {"before": before, "env": os.environ.get("LONGMOE_POOL_PROBE")}


def _fail_rank(rank, world, backend):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits in a collective its peer never joins


def test_calls_reuse_the_ranks_and_match_fresh_ones():
    pool = rank_pool.RankPool(2)
    try:
        a = pool.run(_sum_rank, (1.0,))
        b = pool.run(_sum_rank, (2.0,))
        assert [r["pid"] for r in a] == [r["pid"] for r in b]  # the same two processes
        assert all(torch.equal(r["sum"], torch.full((3,), 3.0)) for r in a)
        assert all(torch.equal(r["sum"], torch.full((3,), 6.0)) for r in b)
        d = pool.run(_dtype_rank, ())
        e = pool.run(_dtype_rank, ())
        # what one call changed (default dtype, environment) the next does not see
        assert all(r["before"] == torch.float32 and r["env"] is None for r in d + e)
    finally:
        pool.close()
    with rank_pool.shared_ranks():  # under the suite's own pools too: run_ranks
        pooled = run_ranks(_sum_rank, 2, 1.0)
    outer, rank_pool._POOLS = rank_pool._POOLS, None  # fresh ranks for this call
    try:
        fresh = run_ranks(_sum_rank, 2, 1.0)
    finally:
        rank_pool._POOLS = outer
    for p, f in zip(pooled, fresh):
        assert torch.equal(p["sum"], f["sum"]) and p["dtype"] == f["dtype"]


def test_a_failing_rank_raises_its_error_and_ends_the_pool():
    pool = rank_pool.RankPool(2)
    try:
        with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
            pool.run(_fail_rank, ())
        assert not pool.alive
    finally:
        pool.close(kill=True)


def test_a_changed_environment_gets_new_ranks(monkeypatch):
    with rank_pool.shared_ranks():
        first = run_ranks(_sum_rank, 2, 1.0)
        again = run_ranks(_sum_rank, 2, 1.0)
        monkeypatch.setenv("LONGMOE_POOL_ENV", "on")
        changed = run_ranks(_sum_rank, 2, 1.0)
        monkeypatch.delenv("LONGMOE_POOL_ENV")
        back = run_ranks(_sum_rank, 2, 1.0)  # the first pool again: still open
    assert [r["pid"] for r in first] == [r["pid"] for r in again] == [r["pid"] for r in back]
    assert {r["pid"] for r in changed}.isdisjoint(r["pid"] for r in first)
    assert [r["probe"] for r in changed] == ["on", "on"] and first[0]["probe"] is None
