"""PolicyTrainer.offload / reload (longmoe.api.offload), the move a colocated rollout engine needs:
every call that computes with offloaded state refuses with one line naming reload(); a reload
gives back bit for bit the parameters, gradients of pending passes and AdamW moments that were
offloaded, so training continues as if nothing had moved. On a GPU (one nccl rank, FSDP2 and
the fp32-master layout) the parameters and moments really sit in page-locked host memory while
offloaded and the device keeps almost nothing allocated."""

from __future__ import annotations

import pytest
import torch

from longmoe.errors import UserError
from longmoe.paired.spawn import run_ranks

from _api_samples import make_samples, run_dict


def _local(t):
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _state(pt) -> dict[str, torch.Tensor]:
    """Host copies of every parameter, gradient and AdamW moment (local shards)."""
    out = {}
    for n, p in pt.model.named_parameters():
        out[n] = _local(p).detach().cpu().clone()
        if p.grad is not None:
            out[n + ".grad"] = _local(p.grad).detach().cpu().clone()
    for i, p in enumerate(pt.master.parameters() if pt.master else []):
        out[f"master{i}"] = p.detach().cpu().clone()
        if p.grad is not None:
            out[f"master{i}.grad"] = p.grad.detach().cpu().clone()
    for i, st in enumerate(pt.optim.state.values()):
        for k, v in st.items():
            if torch.is_tensor(v):
                out[f"optim{i}.{k}"] = _local(v).detach().cpu().clone()
    return out


def _placed(pt) -> set[str]:
    """The device types the parameters, gradients and moments are on."""
    where = {_local(p).device.type for p in pt.model.parameters()}
    where |= {_local(p.grad).device.type for p in pt.model.parameters() if p.grad is not None}
    where |= {p.device.type for p in (pt.master.parameters() if pt.master else [])}
    for st in pt.optim.state.values():
        where |= {_local(v).device.type for k, v in st.items() if torch.is_tensor(v) and k != "step"}
    return where


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_offloaded_state_refuses_every_call_and_reload_continues_exactly():
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    run = from_dict(run_dict(3))
    samples = make_samples(7, 4)
    twin, pt = PolicyTrainer(run), PolicyTrainer(run)
    for t in (twin, pt):
        t.forward_backward(samples)
        t.optim_step()
        t.forward_backward(samples[:3])
    before = _state(pt)
    ids = [id(p) for p in pt.model.parameters()]
    pt.offload()
    assert pt.params_on_host and pt.optimizer_on_host
    calls = {"forward_backward": lambda: pt.forward_backward(samples),
             "compute_logprobs": lambda: pt.compute_logprobs(samples),
             "optim_step": pt.optim_step,
             "named_weights_for_rollout": lambda: pt.named_weights_for_rollout(1 << 20),
             "export_hf": lambda: pt.export_hf("unused"), "save": lambda: pt.save("unused")}
    for what, call in calls.items():
        with pytest.raises(UserError, match=f"^{what}: .*offloaded.*reload"):
            call()
    pt.reload(params=True, optimizer=False)  # the moments stay on the host: still no step
    with pytest.raises(UserError, match="optim_step: .*optimizer state are offloaded"):
        pt.optim_step()
    pt.reload()
    assert [id(p) for p in pt.model.parameters()] == ids
    _same(_state(pt), before)
    a, b = twin.optim_step(), pt.optim_step()
    assert a["grad_norm"] == b["grad_norm"]
    _same(_state(pt), _state(twin))
    torch.testing.assert_close(pt.compute_logprobs(samples), twin.compute_logprobs(samples),
                               rtol=0, atol=0, equal_nan=True)


def test_move_names_a_bad_destination():
    from longmoe.api import PolicyTrainer
    from longmoe.api.offload import move
    from longmoe.train.config import from_dict
    pt = PolicyTrainer(from_dict(run_dict(3)))
    with pytest.raises(UserError, match="^move: where must be one of host, device, got 'gpu'"):
        move(pt, "gpu")


def _gpu_rank(rank, world, backend, d, samples):
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    pt, twin = PolicyTrainer(from_dict(d)), PolicyTrainer(from_dict(d))
    res = {}
    for t in (pt, twin):
        t.forward_backward(samples)
        t.optim_step()
        t.forward_backward(samples[:3])  # pending gradients travel too
    torch.cuda.synchronize()
    before, res["allocated"] = _state(pt), torch.cuda.memory_allocated()
    # the trainer's own device bytes (parameters, gradients, masters, moments); the allocator
    # also holds what both trainers share (cuBLAS workspaces), which stays
    res["own"] = sum(v.numel() * v.element_size() for k, v in before.items()
                     if not k.endswith(".step"))
    pt.offload()
    res["offloaded"] = torch.cuda.memory_allocated()
    res["placed"] = _placed(pt)
    res["pinned"] = all(_local(p).is_pinned() for p in pt.model.parameters())
    pt.reload()
    res["placed_after"] = _placed(pt)
    after = _state(pt)
    res["same"] = sorted(k for k in before if torch.equal(before[k], after[k]))
    res["keys"] = sorted(before)
    res["norms"] = (float(pt.optim_step()["grad_norm"]), float(twin.optim_step()["grad_norm"]))
    res["lp"] = (torch.cat(pt.compute_logprobs(samples)), torch.cat(twin.compute_logprobs(samples)))
    return res


@pytest.mark.needs_cuda
@pytest.mark.parametrize("fsdp,param_dtype", [(True, "bfloat16"), (False, "bfloat16")])
def test_offload_frees_the_device_and_reload_restores_on_gpu(fsdp, param_dtype):
    d = run_dict(3, fsdp=fsdp)
    d["train"]["device"] = "auto"
    d["parallel"]["param_dtype"] = param_dtype
    d["model"]["hidden_size"] = 512  # parameters large enough that what stays is visible
    res = run_ranks(_gpu_rank, 1, d, make_samples(7, 4), device="cuda")[0]
    assert res["allocated"] - res["offloaded"] >= 0.95 * res["own"], res
    assert res["placed"] == {"cpu"} and res["pinned"], res
    assert res["placed_after"] == {"cuda"}, res
    assert res["same"] == res["keys"]
    a, b = res["norms"]
    assert abs(a - b) <= 1e-3 * abs(b), res["norms"]
    lp, lp_twin = res["lp"]
    # NaN where a sample has no value (the first token of the empty prompt), in both
    assert torch.isnan(lp).any() and torch.equal(torch.isnan(lp), torch.isnan(lp_twin))
    assert torch.allclose(lp, lp_twin, atol=2e-2, equal_nan=True), (lp - lp_twin).nan_to_num().abs().max()
