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


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_keep_attention_is_exact_and_keeps_only_the_kernel(preset):
    """Full recompute around the attention kernel: the same loss and gradients as stored
    activations (bitwise on CPU: same ops, same order), and a peak between plain full
    recompute and storing everything."""
    seed = random.randrange(2**31)
    keep = recompute_case("auto", seed, policy="full", keep_attention=True, preset=preset)
    full = recompute_case("auto", seed, policy="full", preset=preset)
    assert keep.ok, keep.failures()
    from longmoe.backends import active_backend
    if active_backend().device_type == "cpu":
        assert keep.max_error == 0.0
    ref = keep.peak_bytes["reference"]
    assert full.peak_bytes["candidate"] <= keep.peak_bytes["candidate"] < ref, (
        keep.peak_bytes, full.peak_bytes)
    if preset == "tiny":  # every block keeps its kernel's tensors: above plain full recompute
        assert full.peak_bytes["candidate"] < keep.peak_bytes["candidate"]


def test_keep_attention_skips_the_kernel_in_the_backward(monkeypatch):
    """The attention kernel runs once per attention block with keep_attention (twice under
    plain full recompute); Gated DeltaNet blocks are recomputed whole either way."""
    from longmoe.config import get_preset
    from longmoe.model.layers import Attention
    from longmoe.model.transformer import MoETransformer
    cfg = get_preset("tiny-hybrid")
    calls = []
    core = Attention.core
    monkeypatch.setattr(Attention, "core", lambda self, *a, **k: calls.append(1) or core(self, *a, **k))
    for keep, expected in ((True, 1), (False, 2)):
        m = MoETransformer(cfg)
        m.init_weights(0)
        m.layers = torch.nn.ModuleList(apply_recompute(b, "full", keep_attention=keep)
                                       for b in m.layers)
        kept = [getattr(b, "keep_attention", False) for b in m.layers]
        assert kept == [keep and t == "full_attention" for t in cfg.layer_types]
        ids = torch.randint(0, cfg.vocab_size, (2, 24))
        calls.clear()
        lp, _, aux, _ = m(ids, ids)
        (-lp.mean() + aux).backward()
        assert len(calls) == expected * cfg.layer_types.count("full_attention")


def test_keep_attention_in_the_run_config():
    from longmoe.errors import ConfigError
    from longmoe.train.config import from_dict
    assert from_dict({"parallel": {"keep_attention": True}}).parallel.keep_attention is True
    with pytest.raises(ConfigError, match="parallel.keep_attention"):
        from_dict({"parallel": {"keep_attention": "yes"}})
