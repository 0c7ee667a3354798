"""FLOPs accounting against torch's FlopCounterMode on the real model (CPU)."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from longmoe.config import get_preset
from longmoe.model import MoETransformer
from longmoe.model.flops import attention_core_flops_per_token, dense_peak_flops, step_flops
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


def test_packed_lengths_count_attention_per_sample():
    from longmoe.model.flops import attention_core_flops_per_token, balance_crossover
    cfg = get_preset("qwen3.5-35b-a3b")
    # Rows that are one sample each: the same count as tokens in sequences of that length.
    same = step_flops(cfg, 3 * 4096, 4096, "full", lengths=[4096] * 3)
    ref = step_flops(cfg, 3 * 4096, 4096, "full")
    assert same.hardware == pytest.approx(ref.hardware, rel=1e-12)
    assert same.forward_attn_core == pytest.approx(ref.forward_attn_core, rel=1e-12)
    # Packed: everything per token but attention, whose core is per sample: sum of L(L+1)/2.
    lengths = [1, 700, 3000, 12000]
    p = step_flops(cfg, 0, 0, "none", lengths=lengths)
    flat = step_flops(cfg, sum(lengths), 1, "none")       # no attention context beyond itself
    full = sum(cfg.layer_type(i) == "full_attention" for i in range(cfg.num_layers))
    pairs = sum(L * (L + 1) / 2 for L in lengths)
    extra = 3 * full * 4 * cfg.num_heads * cfg.head_dim * (pairs - sum(lengths))
    assert p.model == pytest.approx(flat.model + extra, rel=1e-12)
    assert p.forward_attn_core > 0
    assert attention_core_flops_per_token(cfg, 1) * sum(lengths) * full < p.forward_attn_core
    # The balance crossover: where attention's L^2 work equals the per-token work.
    c = balance_crossover(cfg)
    assert 60_000 < c < 90_000
    assert balance_crossover(cfg.replace(layer_types=("linear_attention",) * cfg.num_layers)) \
        == float("inf")


def test_keep_attention_drops_the_recomputed_attention_cores():
    cfg = get_preset("qwen3.5-35b-a3b")
    full = step_flops(cfg, 32768, 32768, "full")
    keep = step_flops(cfg, 32768, 32768, "full", keep_attention=True)
    n_attn = cfg.layer_types.count("full_attention")
    core = attention_core_flops_per_token(cfg, 32768) * 32768
    assert keep.model == full.model
    assert full.hardware - keep.hardware == pytest.approx(n_attn * core, rel=1e-12)
    assert step_flops(cfg, 32768, 32768, "none", keep_attention=True).hardware == full.model
