"""optim.lr = 0 is a valid setting (an RL control run that holds the policy still): AdamW steps,
its moments fill, and every weight stays the same bit for bit, weight decay included (AdamW's
decay is decoupled, lr * weight_decay, so 0 too); warmup scales 0 and divides nothing by it.
A negative or non-finite rate stays an error."""

from __future__ import annotations

import random

import pytest
import torch

from longmoe.errors import ConfigError
from _api_samples import make_samples, run_dict


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()   # -0.0 and 0.0 differ here


def _trainer(lr, impl, param_dtype):
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    d = run_dict(random.randrange(1000))
    d["optim"].update(lr=lr, weight_decay=0.1, warmup_steps=2, impl=impl, grad_clip=1.0)
    d["parallel"]["param_dtype"] = param_dtype
    return PolicyTrainer(from_dict(d))


@pytest.mark.parametrize("impl,param_dtype", [("foreach", "float32"), ("fused", "float32"),
                                              ("loop", "bfloat16")])
def test_zero_lr_steps_leave_every_weight_unchanged(impl, param_dtype):
    pt = _trainer(0, impl, param_dtype)
    assert pt.run.optim.lr == 0.0 and isinstance(pt.run.optim.lr, float)
    before = {k: _bits(v) for k, v in pt.model.state_dict().items()}
    for step in range(2):
        pt.forward_backward(make_samples(step, 3))
        info = pt.optim_step()
        assert info["skipped"] is None and info["lr"] == 0.0 and info["grad_norm"] > 0
    assert pt.optim.state and pt.lr == 0.0     # AdamW stepped: its moments are there
    for k, v in pt.model.state_dict().items():
        assert torch.equal(_bits(v), before[k]), k
    # The same run at a positive rate moves them: the comparison above compares something.
    moving = _trainer(1e-3, impl, param_dtype)
    start = {k: _bits(v) for k, v in moving.model.state_dict().items()}
    moving.forward_backward(make_samples(0, 3))
    moving.optim_step()
    assert any(not torch.equal(_bits(v), start[k]) for k, v in moving.model.state_dict().items())


def test_zero_lr_is_accepted_negative_and_non_finite_are_not():
    from longmoe.train.config import load_run_config
    assert load_run_config(None, ["optim.lr=0"]).optim.lr == 0.0
    assert load_run_config(None, ["optim.lr=0.0", "optim.warmup_steps=5"]).optim.lr == 0.0
    for bad in ("-1e-9", ".nan", ".inf", "-.inf"):
        with pytest.raises(ConfigError, match=r"^optim\.lr: must be"):
            load_run_config(None, [f"optim.lr={bad}"])
