"""The policy objective through the fused LM-head path (no [tokens x vocab] logits, gradients
formed in the forward from the objective's closed-form per-token derivatives) against the plain
reference (full log-softmax, autograd through the objective's per-token loss): every
aggregation mode, KL estimator, TIS, dual clip and entropy setting, fp32 and bf16, odd shapes,
gradients with respect to the hidden states and the LM-head weight. Then whole training steps
on gloo ranks (data parallel and context parallel) against one rank with the unfused path."""

import random

import pytest
import torch

from longmoe.paired.cases import ALL_TERMS, policy_loss_case
from longmoe.paired.dist_cases import step_case
from longmoe.rl.objective import AGG_MODES, Objective

TERMS = dict(dual_clip_c=3.0, kl_coef=0.1, tis_cap=2.0, entropy_coef=0.01)
OBJECTIVES = {
    **{f"agg-{m}": Objective(loss_agg_mode=m, **TERMS) for m in AGG_MODES},
    **{f"kl-{k}": Objective(kl_coef=0.2, kl_estimator=k, loss_agg_mode="seq-mean-token-sum")
       for k in ("k1", "k2", "k3")},
    "tis-only": Objective(tis_cap=1.5),
    "dual-only": Objective(dual_clip_c=2.0, loss_agg_mode="seq-mean-token-mean"),
    "entropy-only": Objective(entropy_coef=0.05),
    "plain-grpo": Objective(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_fused_objective_matches_reference(name, dtype):
    seed = random.randrange(2**31)
    T, H, V = random.choice([(61, 19, 97), (37, 24, 211), (90, 9, 53)])
    obj = OBJECTIVES[name]
    res = policy_loss_case("fused_torch", seed, T=T, H=H, V=V, dtype=dtype,
                           chunk_tokens=random.choice([5, 16, 200]), objective=obj)
    assert res.ok, (seed, res.failures())
    assert set(res.errors) == {"loss", "logprobs", "entropy", "dH", "dW"}
    hit = res.info["tokens"]
    assert hit["clip_frac"] > 0
    if obj.dual_clip_c:
        assert hit["dual_clip_frac"] > 0, (seed, hit)
    if obj.tis_cap:
        assert hit["tis_clip_frac"] > 0, (seed, hit)


def test_the_paired_cli_case_covers_every_term():
    assert ALL_TERMS.dual_clip_c and ALL_TERMS.kl_coef and ALL_TERMS.tis_cap
    assert ALL_TERMS.entropy_coef and ALL_TERMS.loss_agg_mode != "token-mean"
    res = policy_loss_case("fused_torch", random.randrange(2**31))
    assert res.ok and res.info["objective"]["kl_estimator"] == "k3"


def test_fused_loss_changes_with_each_term():
    # Each term moves the loss and the gradients: none is silently dropped on the way to the
    # kernel (the reference comparison alone would pass if both sides dropped one).
    seed = random.randrange(2**31)
    base = policy_loss_case("fused_torch", seed, objective=Objective()).info["loss"]
    for kw in (dict(kl_coef=0.2), dict(tis_cap=1.5), dict(dual_clip_c=2.0),
               dict(entropy_coef=0.05), dict(loss_agg_mode="seq-mean-token-mean")):
        other = policy_loss_case("fused_torch", seed, objective=Objective(**kw)).info["loss"]
        assert abs(other - base) > 1e-4 * abs(base), (seed, kw, other, base)


# ---- whole steps on gloo ranks ---------------------------------------------------------------

STEP_LOSS = {"kl_coef": 0.05, "kl_estimator": "k2", "tis_cap": 2.0, "dual_clip_c": 3.0,
             "entropy_coef": 0.01}


@pytest.mark.parametrize("mode,kw", [
    ("seq-mean-token-mean", dict(cp=2, ep=1, chunks=1, recompute="none")),
    ("seq-mean-token-sum", dict(cp=1, ep=2, chunks=2, recompute="none")),
], ids=["cp2-seq-mean-token-mean", "dp2-ep2-seq-mean-token-sum"])
def test_world2_step_with_rl_terms_matches_world1(mode, kw):
    # Two gloo ranks (samples cut in two by context parallel, or split over data ranks) against
    # one rank running the unfused path: the global sample count and the whole-sample token
    # counts must be right for the loss and every gradient to agree.
    seed = random.randrange(2**31)
    res = step_case(2, seed, fsdp=True, linear_ce="chunked", batch_size=4,
                    loss={**STEP_LOSS, "loss_agg_mode": mode}, **kw)
    assert res.ok, (seed, res.failures())
    assert len(res.errors) > 20
