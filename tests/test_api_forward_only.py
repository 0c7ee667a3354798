"""PolicyTrainer(run, forward_only=True), a reference policy: its log-probs are bit for bit those
of a trainer built without it (FSDP2 on one and two gloo ranks, and the fp32-master layout),
with its parameters in parallel.param_dtype (half the bytes of fp32 shards, no fp32 masters),
buffers untouched; every training call refuses with one line."""

from __future__ import annotations

import pytest
import torch

from longmoe.errors import UserError
from longmoe.paired.spawn import run_ranks

from _api_samples import make_samples, run_dict


def _bytes(pt) -> int:
    from torch.distributed.tensor import DTensor
    loc = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    n = sum(loc(p).numel() * loc(p).element_size() for p in pt.model.parameters())
    return n + sum(p.numel() * p.element_size() for p in (pt.master.parameters() if pt.master
                                                              else []))


def _buffers(pt) -> dict:
    return {n: (b.dtype, b.clone()) for n, b in pt.model.named_buffers()}


def _pair(d, samples):
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    full, ref = PolicyTrainer(from_dict(d)), PolicyTrainer(from_dict(d), forward_only=True)
    same_buffers = all(b[0] == full_b[0] and torch.equal(b[1], full_b[1])
                       for (b, full_b) in zip(_buffers(ref).values(), _buffers(full).values()))
    return {"lp": (full.compute_logprobs(samples), ref.compute_logprobs(samples)),
            "bytes": (_bytes(full), _bytes(ref)), "master": ref.master is None,
            "dtypes": {p.dtype for p in ref.model.parameters() if p.is_floating_point()},
            "buffers": same_buffers}


def _check(res, ratio):
    full, ref = res["lp"]
    torch.testing.assert_close(ref, full, rtol=0, atol=0, equal_nan=True)
    assert res["master"] and res["buffers"]
    assert res["dtypes"] == {torch.bfloat16}, res["dtypes"]
    assert res["bytes"][1] * ratio == res["bytes"][0], res["bytes"]


def test_reference_policy_without_fsdp_matches_and_drops_the_masters():
    d = run_dict(4)
    d["parallel"]["param_dtype"] = "bfloat16"
    _check(_pair(d, make_samples(5, 4)), 3)  # bf16 model + fp32 masters against bf16 alone


def _rank(rank, world, backend, d, samples):
    return _pair(d, samples)


@pytest.mark.parametrize("ep", [1, 2])
def test_reference_policy_under_fsdp_matches_in_half_the_bytes(ep):
    d = run_dict(4, ep=ep, fsdp=True)
    d["parallel"]["param_dtype"] = "bfloat16"
    for res in run_ranks(_rank, ep, d, make_samples(5, 4)):
        _check(res, 2)


def test_training_calls_refuse():
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    ref = PolicyTrainer(from_dict(run_dict(4)), forward_only=True)
    samples = make_samples(5, 2)
    calls = {"forward_backward": lambda: ref.forward_backward(samples),
             "optim_step": ref.optim_step, "save": lambda: ref.save("unused"),
             "load": lambda: ref.load("unused")}
    for what, call in calls.items():
        with pytest.raises(UserError, match=f"^{what}: .*forward_only .*log-probs only"):
            call()
    assert len(ref.compute_logprobs(samples)) == 2
