"""Mixed precision without FSDP2: bf16 parameters and gradients in the model, fp32 master copies
in the optimizer (the baseline stage of `bench train-path` trains this way)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from longmoe.train.precision import MasterWeights

ENV = {**os.environ, "LONGMOE_BACKEND": "cpu"}


def test_master_weights_keep_updates_below_bf16_resolution():
    torch.manual_seed(0)
    model = nn.Linear(17, 5)
    ref = [p.detach().clone() for p in model.parameters()]
    mw = MasterWeights(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = torch.optim.SGD(mw.parameters(), lr=1e-4)
    x = torch.randn(3, 17)
    for _ in range(20):
        model(x.bfloat16()).float().square().sum().backward()
        grads = [p.grad.float().clone() for p in model.parameters()]
        mw.grads_to_master()
        assert all(p.grad is None for p in model.parameters())
        for p, g in zip(model.parameters(), grads):
            assert mw.grad_of(p).dtype == torch.float32 and torch.equal(mw.grad_of(p), g)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mw.master_to_model()
    for p, m, r in zip(model.parameters(), mw.parameters(), ref):
        assert torch.equal(p, m.to(torch.bfloat16))
        moved = (m - r).abs().max()
        assert moved > 0
    # 20 steps of lr 1e-4 move the fp32 masters by less than half a bf16 ulp of the weights, so
    # a bf16-only optimizer would have lost every update; the masters keep them.
    w0 = ref[0].to(torch.bfloat16).float()
    assert not torch.equal(mw.parameters()[0].detach(), w0)


def _mean_logprobs(tmp_path, name, *sets):
    out = tmp_path / f"{name}.jsonl"
    args = ["--config", "cpu_demo", "--nproc", "1", "--steps", "3", "--metrics-out", str(out),
            "--set", "parallel.ep=1", "--set", "parallel.chunks=1", "--set", "train.nproc=1",
            "--set", "parallel.param_dtype=bfloat16", "--set", "data.seq_len=64",
            "--set", "data.prompt_len=16", "--set", "data.batch_size=4"]
    for s in sets:
        args += ["--set", s]
    p = subprocess.run([sys.executable, "-m", "longmoe", "train", *args], env=ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(ln)["mean_logprob"] for ln in out.read_text().splitlines()]


@pytest.mark.slow  # over 10 s on two cores
def test_bf16_without_fsdp_trains_like_fsdp_mixed_precision(tmp_path):
    # Same bf16 compute, fp32 optimizer state either way; they differ only in where gradients
    # are rounded (bf16 autograd buffers here, fp32 reduce in FSDP), so the policy's mean
    # log-prob (the GRPO loss itself is a cancelling sum, too ill-conditioned to compare)
    # agrees to bf16 noise over three steps, while a step without the update would not.
    plain = _mean_logprobs(tmp_path, "plain", "parallel.fsdp=false")
    fsdp = _mean_logprobs(tmp_path, "fsdp", "parallel.fsdp=true")
    assert len(plain) == len(fsdp) == 3
    for a, b in zip(plain, fsdp):
        assert abs(a - b) <= 2e-4 * abs(b), (plain, fsdp)  # steps move it ~3e-3


def test_checkpoint_of_bf16_without_fsdp_is_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "longmoe", "train", "--config", "cpu_demo",
                        "--set", "parallel.fsdp=false", "--set", "parallel.param_dtype=bfloat16",
                        "--checkpoint-dir", str(tmp_path / "ck")], env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: parallel.fsdp"), p.stderr[-500:]
