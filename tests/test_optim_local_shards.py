"""LocalShardAdamW (longmoe/train/optim.py) against torch's AdamW stepping the same DTensors, on
two gloo ranks: uneven and empty shards, every kernel choice, amsgrad, a gradient sharded
differently from its parameter; the same state and state_dict."""

import random

import pytest
import torch

from longmoe.paired.spawn import run_ranks

KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "loop": {"foreach": False}}


def _model(seed):
    torch.manual_seed(seed)
    # 5 x 7 splits 3 / 2 rows over two ranks; the 1-row weight leaves rank 1 an empty shard.
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _compare(rank, world, backend, seed, kernel, amsgrad):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from longmoe.train.optim import LocalShardAdamW
    mesh = init_device_mesh("cpu", (world,))
    models, optims = [], []
    for cls in (torch.optim.AdamW, LocalShardAdamW):
        m = _model(seed)
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        # A parameter whose gradient arrives replicated: stepped through DTensor's dispatch.
        extra = torch.nn.Parameter(distribute_tensor(
            torch.randn(9, 3, generator=torch.Generator().manual_seed(seed)), mesh, [Shard(0)]))
        params = list(m.parameters()) + [extra]
        models.append((m, extra))
        optims.append(cls(params, lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                          amsgrad=amsgrad, **KERNELS[kernel]))
    g = torch.Generator().manual_seed(seed + 1 + rank)
    for _ in range(3):
        x = torch.randn(6, 7, generator=g)
        g_extra = torch.randn(9, 3, generator=torch.Generator().manual_seed(seed + 7))
        for (m, extra), opt in zip(models, optims):
            m(x).square().sum().backward()
            extra.grad = distribute_tensor(g_extra, mesh, [Replicate()])
            opt.step()
            opt.zero_grad(set_to_none=True)
    out = {"max_diff": 0.0, "compared": 0, "same_layout": True}
    ref_p = list(models[0][0].parameters()) + [models[0][1]]
    new_p = list(models[1][0].parameters()) + [models[1][1]]
    for a, b in zip(ref_p, new_p):
        sa, sb = optims[0].state[a], optims[1].state[b]
        out["same_layout"] &= (sa.keys() == sb.keys() and all(
            type(sa[k]) is type(sb[k]) and sa[k].dtype == sb[k].dtype
            and sa[k].device == sb[k].device for k in sa))
        for x, y in [(a, b)] + [(sa[k], sb[k]) for k in sa]:
            x = x.full_tensor() if isinstance(x, DTensor) else x
            y = y.full_tensor() if isinstance(y, DTensor) else y
            out["max_diff"] = max(out["max_diff"], float((x.detach() - y.detach()).abs().max()))
            out["compared"] += x.numel()
    # every parameter moved
    out["moved"] = all(float((p.full_tensor() - q).abs().max()) > 0 for p, q in zip(
        new_p, list(_model(seed).parameters()) + [
            torch.randn(9, 3, generator=torch.Generator().manual_seed(seed))]))
    sd = [o.state_dict() for o in optims]
    out["same_state_dict"] = (sd[0]["param_groups"] == sd[1]["param_groups"]
                              and sd[0]["state"].keys() == sd[1]["state"].keys())
    return out


@pytest.mark.parametrize("kernel,amsgrad", [("fused", False), ("foreach", True), ("loop", False)])
def test_matches_torch_adamw_on_dtensors(kernel, amsgrad):
    seed = random.randrange(2**31)
    for r in run_ranks(_compare, 2, seed, kernel, amsgrad):
        assert r["compared"] > 0 and r["moved"], (seed, r)
        assert r["max_diff"] == 0.0, (seed, r)
        assert r["same_layout"] and r["same_state_dict"], (seed, r)


def test_plain_tensors_match_torch_adamw():
    from longmoe.train.optim import LocalShardAdamW
    seed = random.randrange(2**31)
    ps = []
    for cls in (torch.optim.AdamW, LocalShardAdamW):
        p = torch.nn.Parameter(torch.randn(13, 3, generator=torch.Generator().manual_seed(seed)))
        opt = cls([p], lr=1e-2, weight_decay=0.05, maximize=True)
        for i in range(3):
            p.grad = torch.randn(13, 3, generator=torch.Generator().manual_seed(seed + i))
            opt.step()
        ps.append(p.detach())
    assert float((ps[0] - ps[1]).abs().max()) == 0.0, seed
