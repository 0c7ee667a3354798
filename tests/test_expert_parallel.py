"""Chunked expert parallelism on real gloo ranks against one process holding every expert."""

import random

import pytest
import torch

from longmoe.paired.dist_cases import ep_case
from longmoe.parallel.expert_parallel import chunk_bounds, source_major_to_expert_major


# wgrad "in_chunks" runs each chunk's weight gradient right after its dgrad for expert chunks and
# for one chunk, "delayed" runs them all at the end, "auto" is in_chunks except on one rank with
# several chunks; token chunks with C > 1 are always delayed.
@pytest.mark.parametrize("nproc,T,chunks,top_k,skew,by,wgrad", [
    (2, 37, 3, 2, False, "tokens", "auto"),   # chunk count that does not divide the tokens
    (1, 37, 4, 2, False, "tokens", "auto"),   # the pipeline on one rank (local all-to-alls)
    (2, 29, 1, 1, True, "tokens", "auto"),    # top-1, one expert takes every token, others none
    (2, 29, 1, 1, True, "tokens", "delayed"),
    (4, 11, 2, 2, True, "tokens", "auto"),    # 4 ranks; two ranks' experts receive nothing
    (4, 9, 9, 3, False, "tokens", "auto"),    # one token per chunk
    (2, 37, 3, 2, False, "experts", "auto"),  # 3 chunks of 4 local experts (not dividing them)
    (2, 37, 3, 2, False, "experts", "delayed"),
    (1, 37, 8, 3, False, "experts", "in_chunks"),  # one rank, one expert per chunk
    (2, 29, 4, 1, True, "experts", "auto"),   # top-1, skewed: chunks and experts with no rows
    (2, 29, 4, 1, True, "experts", "delayed"),
    (4, 11, 2, 2, True, "experts", "auto"),   # 4 ranks of 2 experts, one chunk each
])
def test_ep_matches_one_process(nproc, T, chunks, top_k, skew, by, wgrad):
    seed = random.randrange(2**31)
    res = ep_case(nproc, seed, T=T, chunks=chunks, top_k=top_k, skew=skew, chunk_by=by,
                  wgrad=wgrad)
    assert res.ok, (seed, res.failures())
    if skew:
        load = res.info["tokens_per_expert"]
        assert sum(1 for n in load if n == 0) >= 8 - 2 * top_k  # experts with zero tokens happened


@pytest.mark.needs_cuda
@pytest.mark.parametrize("wgrad", ["auto", "in_chunks", "delayed"])
def test_ep_pipeline_on_one_gpu(wgrad):
    # The pipeline on one GPU rank (local all-to-alls, real streams), both weight-gradient
    # schedules: expert chunks, one chunk, token chunks, top-1 skewed with experts left empty.
    seed = random.randrange(2**31)
    for C, by, k, skew in [(4, "experts", 2, False), (1, "experts", 2, False),
                           (3, "tokens", 2, False), (4, "experts", 1, True)]:
        res = ep_case(1, seed, T=301, chunks=C, top_k=k, skew=skew, device="cuda", chunk_by=by,
                      wgrad=wgrad)
        assert res.ok, (seed, C, by, res.failures())


@pytest.mark.needs_multi_gpu
@pytest.mark.parametrize("transport", ["process_group", "symmetric_memory"])
def test_ep_pipeline_on_two_gpus(transport):
    # The same pipeline with a real communication stream and each transport.
    seed = random.randrange(2**31)
    res = ep_case(2, seed, T=301, chunks=4, top_k=2, device="cuda", transport=transport)
    assert res.ok, (seed, res.failures())
    res = ep_case(2, seed, T=301, chunks=3, top_k=2, device="cuda", transport=transport,
                  chunk_by="tokens")
    assert res.ok, (seed, res.failures())
    res = ep_case(2, seed, T=64, chunks=3, top_k=1, skew=True, device="cuda", transport=transport)
    assert res.ok, (seed, res.failures())


def test_chunk_bounds():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(5, 5) == [(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError, match="chunks=6 exceeds"):
        chunk_bounds(5, 6)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunk_bounds(5, 0)


def test_source_to_expert_order():
    # 2 sources x 3 local experts; received rows are [src0: e0 e0 e2][src1: e1 e2 e2].
    recv_SL = torch.tensor([[2, 0, 1], [0, 1, 2]])
    rows = ["s0e0", "s0e0", "s0e2", "s1e1", "s1e2", "s1e2"]
    perm = source_major_to_expert_major(recv_SL, len(rows))
    assert [rows[i] for i in perm.tolist()] == ["s0e0", "s0e0", "s1e1", "s0e2", "s1e2", "s1e2"]


@pytest.mark.parametrize("world,ep,experts,field", [
    (3, 2, 8, "world size 3 is not divisible by ep=2"),
    (16, 16, 8, "ep=16 exceeds model.num_experts=8"),
    (6, 3, 8, "ep=3 does not divide model.num_experts=8"),
])
def test_layout_errors_name_the_value(world, ep, experts, field):
    from longmoe.errors import ConfigError
    from longmoe.parallel.mesh import validate_layout
    with pytest.raises(ConfigError, match=field):
        validate_layout(world, ep, experts)


@pytest.mark.parametrize("T,K,H", [(37, 3, 5), (64, 1, 8), (1, 8, 3)])
def test_combine_permuted_matches_index_add(T, K, H):
    """The EP=1 combine (gather back to token order, batched weighted sum) against the plain
    scatter-add of weighted rows it replaced: outputs and gradients of rows and weights."""
    from longmoe.parallel.expert_parallel import combine_permuted
    g = torch.Generator().manual_seed(T * 10 + K)
    order = torch.randperm(T * K, generator=g)
    y = torch.randn(T * K, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T, K, generator=g, dtype=torch.float64, requires_grad=True)
    got = combine_permuted(y, order, w)
    ref = torch.zeros(T, H, dtype=torch.float64).index_add(
        0, order // K, y * w.reshape(-1)[order][:, None])
    dy = torch.randn(T, H, generator=g, dtype=torch.float64)
    torch.testing.assert_close(got, ref)
    for a, b in zip(torch.autograd.grad(got, (y, w), dy), torch.autograd.grad(ref, (y, w), dy)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("T,K,H,dtype", [(37, 3, 5, torch.float64), (64, 1, 8, torch.float64),
                                         (29, 8, 16, torch.bfloat16)])
def test_dispatch_rows_backward_sums_each_tokens_rows(T, K, H, dtype):
    """The EP=1 dispatch gather's backward (gather to (token, k) order, sum over k) against
    autograd's scatter-add of plain indexing."""
    from longmoe.parallel.expert_parallel import dispatch_rows, inverse_permutation
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(T * K, generator=g)
    x = torch.randn(T, H, generator=g, dtype=dtype, requires_grad=True)
    got = dispatch_rows(x, order, inverse_permutation(order), K)
    ref = x[order // K]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    dy = torch.randn(T * K, H, generator=g, dtype=dtype)
    (ga,) = torch.autograd.grad(got, x, dy)
    # exact: each token's K rows summed in fp64; ours sums in fp32 and rounds once, so in bf16
    # it is within half a bf16 ulp (2^-8 relative) of it
    want = torch.zeros(T, H, dtype=torch.float64).index_add(0, order // K, dy.double())
    tol = {"rtol": 2**-8, "atol": 1e-6} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(ga.double(), want, msg=f"seed {seed}", **tol)


def test_chunks_by_expert_errors_name_the_value():
    from longmoe.parallel.expert_parallel import ExpertDispatcher, plan_routes
    with pytest.raises(ValueError, match="chunks=9 exceeds the 8 local experts"):
        ExpertDispatcher(8, None, 9, chunk_by="experts")
    with pytest.raises(ValueError, match="chunk_by must be one of"):
        ExpertDispatcher(8, None, 2, chunk_by="rows")
    with pytest.raises(ValueError, match="chunks=5 exceeds the 4 local experts"):
        plan_routes(torch.zeros(3, 2, dtype=torch.long), 4, 5, by="experts")


def test_expert_chunk_plan_puts_each_expert_in_one_chunk():
    """Chunk c's rows are exactly the assignments to its local experts; the sorted order runs
    chunk by chunk; per-chunk ranges cover every assignment once."""
    from longmoe.parallel.expert_parallel import plan_routes
    g = torch.Generator().manual_seed(random.randrange(2**31))
    idx = torch.randint(0, 10, (23, 3), generator=g)
    p = plan_routes(idx, 10, 3, by="experts")
    assert p.expert_bounds == [(0, 4), (4, 7), (7, 10)]
    flat = idx.reshape(-1)[p.order_A]
    assert p.a_ranges[0][0] == 0 and p.a_ranges[-1][1] == idx.numel()
    for c, ((a0, a1), (lo, hi)) in enumerate(zip(p.a_ranges, p.expert_bounds)):
        assert ((flat[a0:a1] >= lo) & (flat[a0:a1] < hi)).all()
        assert a1 - a0 == int(((idx >= lo) & (idx < hi)).sum())
        assert all(n == 0 for e, n in enumerate(p.expert_rows[c]) if not lo <= e < hi)


@pytest.mark.parametrize("numel,n", [(0, 5), (1, 1), (1000, 7), (262144, 32), (3000, 20000)])
def test_count_ids_both_ways_match_bincount(numel, n, monkeypatch):
    """count_ids compares against every bin for small problems and scatter-adds past
    ONE_HOT_COUNT_MAX: both are exact counts (the last case takes the scatter path)."""
    from longmoe.parallel import routing
    ids = torch.randint(0, n, (numel,))
    want = torch.bincount(ids, minlength=n)
    assert torch.equal(routing.count_ids(ids, n), want)
    monkeypatch.setattr(routing, "ONE_HOT_COUNT_MAX", 0)
    assert torch.equal(routing.count_ids(ids.view(-1, 1) if numel else ids, n), want)
