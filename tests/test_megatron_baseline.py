"""The megatron-core baseline of `bench moe-layer --baseline megatron` is the same layer: on 1, 2
and 4 gloo ranks, megatron's all-to-all token dispatcher in place of longmoe's pipeline gives the same
output and every gradient (input, router, experts, shared expert), fp64, uneven tokens per rank,
top-1 and top-2, a rank whose experts get no tokens.

The dispatcher keeps a CUDA side stream for its device-to-host copies and allocates its
all-to-all output on the current CUDA device. On CPU ranks the test substitutes those calls
(the stream, the device and the host copy); the collectives are real gloo all-to-alls."""

import contextlib
import random
import warnings

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("megatron.core")


class _HostStream:
    def wait_stream(self, other):
        pass

    def record_event(self):
        return self

    def synchronize(self):
        pass


def _cpu_stands_in_for_cuda():
    import megatron.core.transformer.moe.token_dispatcher as td
    td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HostStream()
    torch.cuda.current_stream = lambda *a, **k: td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    td.maybe_move_tensor_to_cpu = lambda t, as_numpy=False, record_stream=False: (
        t.numpy() if as_numpy and torch.is_tensor(t) else t)


def _compare(rank, world, backend, seed, top_k, skew):
    warnings.simplefilter("ignore")  # megatron warns that Transformer Engine/Apex are absent
    _cpu_stands_in_for_cuda()
    from longmoe.bench.megatron_moe import MegatronDispatch
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    cfg = get_preset("tiny").replace(num_experts=8, top_k=top_k)
    moe = MoE(cfg, ep_rank=rank, ep_size=world)
    init_params(moe, cfg, seed)
    moe.to(torch.float64)
    moe.batch_group = dist.group.WORLD
    if skew:  # every token prefers expert 0 (and 1): the other ranks' experts get nothing
        with torch.no_grad():
            moe.router.weight[:2] += 50.0 * moe.router.weight[:2].sign()
    g = torch.Generator().manual_seed(seed + rank)
    T = 29 + 7 * rank
    x = torch.randn(1, T, cfg.hidden_size, generator=g, dtype=torch.float64)
    if skew:
        x = x.abs() * moe.router.weight[0].detach().sign()
    c = torch.randn(1, T, cfg.hidden_size, generator=g, dtype=torch.float64)
    out = {}
    for name, disp in (("longmoe", ExpertDispatcher(cfg.num_experts, dist.group.WORLD, 1)),
                       ("megatron", MegatronDispatch(cfg.num_experts, dist.group.WORLD,
                                                     moe.experts, top_k, cfg.hidden_size,
                                                     cfg.moe_ffn_size, torch.float64))):
        moe.dispatcher = disp
        moe.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y, aux = moe(xx)
        ((y * c).sum() + aux).backward()
        out[name] = {"y": y.detach(), "dX": xx.grad,
                     **{n: p.grad.clone() for n, p in moe.named_parameters()}}
    scale = {k: v.abs().max().item() for k, v in out["megatron"].items()}
    err = {k: (out["longmoe"][k] - out["megatron"][k]).abs().max().item() for k in out["megatron"]}
    return {"err": err, "scale": scale}


@pytest.mark.parametrize("world,top_k,skew", [(1, 2, False), (2, 2, False), (2, 1, True),
                                              (4, 2, False)])
def test_megatron_dispatcher_gives_the_same_layer(world, top_k, skew):
    from longmoe.paired.spawn import run_ranks
    seed = random.randrange(2**31)
    results = run_ranks(_compare, world, seed, top_k, skew)
    for r, res in enumerate(results):
        assert {"y", "dX", "router.weight", "experts.w_in", "experts.w_out",
                "shared.gate_up.weight"} <= set(res["err"])
        for k, e in res["err"].items():
            assert e <= 1e-10 * max(1.0, res["scale"][k]), (seed, r, k, e, res["scale"][k])
        assert res["scale"]["y"] > 0 and res["scale"]["dX"] > 0
    expert_grads = [res["scale"]["experts.w_in"] for res in results]
    assert max(expert_grads) > 0
    if skew:  # the case it is there for: a rank whose experts received no rows
        assert min(expert_grads) == 0, expert_grads


def test_bench_baseline_flag_errors_name_the_flag(tmp_path):
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "moe-layer", "--device", "cpu",
                        "--baseline", "megatron", "--smoke"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode != 0 and "--baseline: megatron's dispatcher runs on GPUs only" in p.stderr
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "moe-layer", "--device", "cpu",
                        "--baseline", "deepep", "--smoke"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode != 0 and "--baseline: only 'megatron' is known" in p.stderr
