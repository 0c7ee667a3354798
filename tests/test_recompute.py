"""Full recompute: identical loss and gradients, less activation memory."""

import random

import pytest
import torch

from longmoe.ops import ImplUnavailable, apply_recompute
from longmoe.paired.cases import recompute_case


def test_full_recompute_is_exact_and_saves_memory():
    res = recompute_case("auto", random.randrange(2**31))
    assert res.ok, res.failures()
    from longmoe.backends import active_backend
    if active_backend().device_type == "cpu":  # GPU index_add uses atomics: not bitwise
        assert res.max_error == 0.0  # same ops in the same order: bitwise equal on CPU
    assert res.peak_bytes["candidate"] < 0.6 * res.peak_bytes["reference"], res.peak_bytes


def test_policy_and_impl_errors():
    block = torch.nn.Linear(3, 3)
    assert apply_recompute(block, "none") is block
    with pytest.raises(ValueError, match="policy"):
        apply_recompute(block, "selective-ish")
    with pytest.raises(ImplUnavailable, match="unknown impl"):
        apply_recompute(block, "full", impl="nope")
