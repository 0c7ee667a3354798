"""FLOPs accounting against torch's FlopCounterMode on the real model (CPU)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longmoe.config import get_preset
from longmoe.model import MoETransformer
from longmoe.model.flops import dense_peak_flops, step_flops
from longmoe.ops.recompute import apply_recompute


def _counted(cfg, policy, B, S):
    m = MoETransformer(cfg)
    m.init_weights(0)
    m.layers = torch.nn.ModuleList(apply_recompute(b, policy) for b in m.layers)
    ids = torch.randint(0, cfg.vocab_size, (B, S))
    labels = torch.randint(0, cfg.vocab_size, (B, S))
    with FlopCounterMode(display=False) as fc:
        lp, _, aux, _ = m(ids, labels)
        (-lp.mean() + aux).backward()
    return fc.get_total_flops()


@pytest.mark.parametrize("policy", ["none", "full"])
def test_formula_matches_counted_matmuls(policy):
    # The CPU SDPA kernel has no FLOP formula in torch's counter, so the attention core (QK^T,
    # PV) is left out of the comparison; every projection, router, expert, shared-expert and
    # LM-head GEMM, forward, backward and recomputed, must match exactly.
    cfg = get_preset("tiny").replace(num_layers=3)
    B, S = 2, 48
    est = step_flops(cfg, B * S, S, policy, causal=False)
    passes = 4 if policy == "full" else 3
    assert _counted(cfg, policy, B, S) == pytest.approx(est.hardware - passes * est.forward_attn_core,
                                                         rel=1e-12)


def test_full_recompute_costs_about_a_third():
    # At the Qwen3.5 preset's shape the layers dominate the LM head, so full recompute adds
    # close to 1/3 of the model FLOPs (a little less: the head is not recomputed).
    cfg = get_preset("qwen3.5-35b-a3b")
    f = step_flops(cfg, 32768, 32768, "full")
    ratio = f.hardware / f.model
    assert 1.25 < ratio < 1.34
    none = step_flops(cfg, 32768, 32768, "none")
    assert none.hardware == none.model


def test_dense_peak_lookup():
    assert dense_peak_flops({"device_name": "NVIDIA H200"}) == pytest.approx(989.4e12, rel=0.01)
    assert dense_peak_flops({"device_name": ""}) is None
    assert dense_peak_flops({"device_name": "Some Future GPU"}) is None


def test_selective_recompute_adds_no_matmul_flops():
    cfg = get_preset("tiny").replace(num_layers=2)
    assert _counted(cfg, "selective", 2, 32) == _counted(cfg, "none", 2, 32)
    mixed = step_flops(cfg, 64, 32, ("full", "selective"))
    full = step_flops(cfg, 64, 32, "full")
    none = step_flops(cfg, 64, 32, "none")
    assert mixed.hardware == pytest.approx((full.hardware + none.hardware) / 2)
