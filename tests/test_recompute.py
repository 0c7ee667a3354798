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


def test_selective_recompute_is_exact_and_sits_between():
    seed = random.randrange(2**31)
    sel = recompute_case("auto", seed, policy="selective")
    full = recompute_case("auto", seed, policy="full")
    assert sel.ok, sel.failures()
    ref = sel.peak_bytes["reference"]
    # Peak tensor bytes: selective keeps more than full, never more than storing everything.
    assert full.peak_bytes["candidate"] <= sel.peak_bytes["candidate"] < ref, (sel.peak_bytes,
                                                                               full.peak_bytes)


def test_per_layer_policies_in_the_run_config():
    from longmoe.errors import ConfigError
    from longmoe.train.config import from_dict
    run = from_dict({"model": {"preset": "tiny", "num_layers": 3},
                     "parallel": {"recompute": ["full", "selective", "none"]}})
    assert run.parallel.recompute == ("full", "selective", "none")
    with pytest.raises(ConfigError, match="3 per-layer"):
        from_dict({"model": {"preset": "tiny", "num_layers": 2},
                   "parallel": {"recompute": ["full", "selective", "none"]}})
    with pytest.raises(ConfigError, match="parallel.recompute"):
        from_dict({"parallel": {"recompute": "some"}})
