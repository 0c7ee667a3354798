"""The MoE layer at EP = 1 routes on the device (longmoe/parallel/local_routes.py): the same rows,
order and gradients as the host-planned routes, and nothing read back to the host."""

import random

import pytest
import torch

from longmoe.config import ModelConfig
from longmoe.model.moe import MoE
from longmoe.ops.grouped_mm import grouped_mm
from longmoe.parallel.expert_parallel import ExpertDispatcher, plan_routes
from longmoe.parallel.local_routes import local_routes


def _skewed_ids(g, T, K, E):
    """Top-k ids over E experts where the last expert never appears (an empty group)."""
    return torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])


@pytest.mark.parametrize("T,K,E", [(37, 2, 5), (1, 3, 4), (64, 1, 8)])
def test_routes_match_the_host_plan(T, K, E):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    idx = _skewed_ids(g, T, K, E)
    r = local_routes(idx, E)
    plan = plan_routes(idx, E, 1)
    assert torch.equal(r.order_A, plan.order_A) and torch.equal(r.inv_A, plan.inv_A)
    assert r.offs_E.dtype == torch.int32 and torch.equal(r.offs_E, plan.offs[0])
    assert torch.diff(r.offs_E, prepend=r.offs_E.new_zeros(1)).tolist() == plan.expert_rows[0]
    assert plan.expert_rows[0][-1] == 0  # the comparison covered an empty expert


def test_routes_read_nothing_back():
    # Meta tensors hold no data: any host read (.tolist(), .item(), a bool) would raise.
    idx = torch.empty(4096, 8, dtype=torch.long, device="meta")
    r = local_routes(idx, 32)
    assert r.order_A.shape == (4096 * 8,) and r.offs_E.shape == (32,)


def test_bad_expert_index_is_named():
    with pytest.raises(ValueError, match="expert index 5, outside"):
        local_routes(torch.tensor([[0, 5]]), 5)


def test_grouped_mm_with_device_ends_only():
    g = torch.Generator().manual_seed(random.randrange(2**31))
    sizes = [5, 0, 17, 1, 0]
    x = torch.randn(sum(sizes), 13, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(len(sizes), 13, 9, dtype=torch.float64, generator=g, requires_grad=True)
    dy = torch.randn(sum(sizes), 9, dtype=torch.float64, generator=g)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y_ref = grouped_mm(x, w, sizes, impl="reference")
    gx_ref, gw_ref = torch.autograd.grad((y_ref * dy).sum(), (x, w))
    y = grouped_mm(x, w, None, offs)
    gx, gw = torch.autograd.grad((y * dy).sum(), (x, w))
    torch.testing.assert_close(y, y_ref, atol=0, rtol=0)
    torch.testing.assert_close(gx, gx_ref, atol=0, rtol=0)
    torch.testing.assert_close(gw, gw_ref, atol=0, rtol=0)
    assert gw.abs().sum() > 0
    with pytest.raises(ValueError, match="offs must hold one end row per group"):
        grouped_mm(x, w, None, offs[:3])


def _moe(seed, E=5, K=2, dtype=torch.float64, hidden=24):
    cfg = ModelConfig(vocab_size=16, hidden_size=hidden, num_layers=1, num_heads=2, num_kv_heads=1,
                      head_dim=12, num_experts=E, top_k=K, moe_ffn_size=16,
                      shared_expert_ffn_size=8, max_seq_len=64)
    torch.manual_seed(seed)
    moe = MoE(cfg).to(dtype)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe, cfg


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_layer_matches_the_host_planned_layer(dtype, tol):
    """Output and every gradient of the layer against the chunk pipeline with one chunk (its
    routes planned on the host), 29 tokens over 5 experts."""
    seed = random.randrange(2**31)
    moe, cfg = _moe(seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 29, cfg.hidden_size, generator=g).to(dtype)
    g_out = torch.randn(x0.shape, generator=g).to(dtype)

    def run(pipeline):
        moe.dispatcher = ExpertDispatcher(cfg.num_experts, None, chunks=1, pipeline=pipeline)
        moe.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        y, aux = moe(x)
        ((y * g_out).sum() + aux).backward()
        return y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}

    y, gx, grads = run(False)
    y_ref, gx_ref, grads_ref = run(True)
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol, msg=f"seed {seed}")
    torch.testing.assert_close(gx, gx_ref, atol=tol, rtol=tol, msg=f"seed {seed}")
    assert grads.keys() == grads_ref.keys() and "experts.w_in" in grads
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], atol=tol, rtol=tol,
                                   msg=f"{n}, seed {seed}")
        assert grads[n].abs().sum() > 0, n


@pytest.mark.needs_cuda
def test_layer_on_gpu_reads_nothing_back():
    """bf16 on the GPU (widths that torch._grouped_mm takes): after a first call (kernel
    compiles), the layer's forward and backward run with synchronising calls reported as errors,
    and match the same layer with host-planned routes (one chunk of the pipeline)."""
    seed = random.randrange(2**31)
    moe, cfg = _moe(seed, E=8, K=2, dtype=torch.bfloat16, hidden=32)
    moe = moe.cuda()
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(1, 257, cfg.hidden_size, generator=g).cuda().to(torch.bfloat16)

    def run(pipeline, check_syncs=False):
        moe.dispatcher = ExpertDispatcher(cfg.num_experts, None, chunks=1, pipeline=pipeline)
        moe.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        torch.cuda.synchronize()
        if check_syncs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            y, aux = moe(x)
            (y.float().square().sum() + aux).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return y.detach().float(), x.grad.float(), moe.experts.w_in.grad.float()

    run(False)
    got = run(False, check_syncs=True)
    want = run(True)
    # The two paths round in bf16 at different points. The gradients of sum(y^2) reach several
    # hundred here, where one bf16 step is 2-8, and a sum of such terms can cancel to near zero:
    # an absolute tolerance against the tensor's largest entry, and its error norm against its
    # norm (bf16 rounding alone: 2-5e-3 on a CPU; a wrong gradient is of order 1).
    for name, a, b in zip(("y", "x.grad", "w_in.grad"), got, want):
        top = float(b.abs().max())
        torch.testing.assert_close(a, b, atol=2e-2 * top, rtol=2e-2,
                                   msg=lambda m: f"{name}, seed {seed}: {m}")
        assert float((a - b).norm()) <= 1e-2 * float(b.norm()), (name, seed)
    assert got[2].abs().sum() > 0
