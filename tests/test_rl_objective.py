"""The policy objective's per-token math (longmoe/rl/objective.py): closed-form derivatives
against autograd for every combination of terms, each term against numbers worked by hand,
and the aggregation modes on packed rows (several samples per row by sample id) split across
ranks and context-parallel pieces."""

import itertools
import math
import random

import pytest
import torch

from longmoe.errors import ConfigError
from longmoe.ops.linear_ce import linear_logprobs
from longmoe.ops.linear_ce_fused import linear_policy_loss
from longmoe.rl.objective import (AGG_MODES, Objective, TokenInputs, counts_to_int, local_counts,
                                  sample_token_counts)

LN = math.log


def _gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def _token_inputs(g, T):
    """fp64 per-token inputs reaching every regime: ratios inside and beyond both clip bounds
    and the dual-clip bound, on-policy tokens, TIS weights above and below the cap."""
    logp = -torch.rand(T, generator=g, dtype=torch.float64) * 4 - 0.01
    old = logp + torch.randn(T, generator=g, dtype=torch.float64) * 0.8
    old[: T // 6] = logp[: T // 6] - 1.5 - torch.rand(T // 6, generator=g, dtype=torch.float64)
    old[T // 6: T // 6 + T // 8] = float("nan")
    ref = logp + torch.randn(T, generator=g, dtype=torch.float64) * 0.5
    roll = torch.where(torch.isnan(old), logp, old) + torch.randn(T, generator=g, dtype=torch.float64)
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    ent = torch.rand(T, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(T, generator=g) < 0.8
    weights = torch.rand(T, generator=g, dtype=torch.float64) * mask
    perm = torch.randperm(T, generator=g)  # the regimes spread over the tokens
    return (logp[perm], ent[perm], mask[perm],
            TokenInputs(adv[perm], weights[perm], old[perm], ref[perm], roll[perm]))


COMBOS = list(itertools.product([0.0, 3.0], [None, "k1", "k2", "k3"], [0.0, 1.5], [0.0, 0.02]))


@pytest.mark.parametrize("dual,kl,tis,ent_coef", COMBOS)
def test_closed_form_matches_autograd(dual, kl, tis, ent_coef):
    obj = Objective(dual_clip_c=dual, kl_coef=0.3 if kl else 0.0, kl_estimator=kl or "k3",
                    tis_cap=tis, entropy_coef=ent_coef)
    logp, ent, mask, x = _token_inputs(_gen(), 211)
    lp = logp.clone().requires_grad_()
    en = ent.clone().requires_grad_()
    per = obj.token_loss(lp, en, x, mask)
    d_lp, d_ent = torch.autograd.grad(per.sum(), [lp, en], allow_unused=True,
                                      materialize_grads=True)
    loss, w_lp, w_ent = obj.token_loss_grads(logp, ent, x, mask)
    torch.testing.assert_close(loss, per.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(w_lp, d_lp, rtol=1e-12, atol=1e-15)
    if ent_coef:
        torch.testing.assert_close(w_ent, d_ent, rtol=1e-12, atol=1e-15)
    else:
        assert w_ent is None and not d_ent.any()
    assert not loss[~mask].any() and not w_lp[~mask].any()
    # The inputs reach the regimes the terms act in, so a wrong branch would show.
    st = obj.stats(logp, ent, x, mask)
    assert st["clip_frac"] > 10
    if dual:
        assert st["dual_clip_frac"] > 3
    if tis:
        assert 5 < st["tis_clip_frac"] < mask.sum() - 5


def _one(obj, logp, adv, old=float("nan"), ref=None, roll=None, ent=None):
    """(loss, d loss/d logp) of a single token with weight 1, by the closed form."""
    f = lambda v: None if v is None else torch.tensor([v], dtype=torch.float64)
    x = TokenInputs(f(adv), f(1.0), f(old), f(ref), f(roll))
    loss, g, _ = obj.token_loss_grads(f(logp), f(ent if ent is not None else 0.0), x,
                                      torch.tensor([True]))
    return float(loss), float(g)


def test_clipped_and_dual_clip_by_hand():
    lp = -1.0
    ppo, dual = Objective(), Objective(dual_clip_c=3.0)
    # A = -1, r = 5: PPO's loss -min(-5, -0.8) = 5 with gradient -A r = 5; dual clip caps it at
    # c * |A| = 3, a constant.
    assert _one(ppo, lp, -1.0, old=lp - LN(5)) == pytest.approx((5.0, 5.0), rel=1e-12)
    assert _one(dual, lp, -1.0, old=lp - LN(5)) == pytest.approx((3.0, 0.0), abs=1e-12)
    # A = -1, r = 2 (loss 2 < 3): the dual clip leaves it.
    assert _one(dual, lp, -1.0, old=lp - LN(2)) == pytest.approx((2.0, 2.0), rel=1e-12)
    # A = +2, r = 5: clipped at 1.28 (no gradient); the dual clip applies to A < 0 only.
    assert _one(dual, lp, 2.0, old=lp - LN(5)) == pytest.approx((-2.56, 0.0), abs=1e-12)
    # A = -0.5, r = 0.5: clipped at 0.8 -> loss 0.4, no gradient.
    assert _one(dual, lp, -0.5, old=lp - LN(0.5)) == pytest.approx((0.4, 0.0), abs=1e-12)
    # On-policy (old not given): r = 1, loss -A, gradient -A.
    assert _one(dual, lp, -0.7) == pytest.approx((0.7, 0.7), rel=1e-12)


def test_kl_estimators_by_hand():
    lp, ref = -2.0, -1.5  # d = ref - logp = 0.5
    d = 0.5
    want = {"k1": (-d, 1.0), "k2": (d * d / 2, -d), "k3": (math.exp(d) - d - 1, 1 - math.exp(d))}
    for est, (k, dk) in want.items():
        obj = Objective(kl_coef=0.25, kl_estimator=est)
        # A = 0 leaves only the KL term.
        assert _one(obj, lp, 0.0, ref=ref) == pytest.approx((0.25 * k, 0.25 * dk), rel=1e-12)
    # k3 stays exact for a tiny gap (no cancellation in exp(d) - d - 1).
    tiny = 1e-9
    loss, _ = _one(Objective(kl_coef=1.0), lp, 0.0, ref=lp + tiny)
    assert loss == pytest.approx(tiny * tiny / 2, rel=1e-6)


def test_truncated_importance_sampling_by_hand():
    lp = -1.0
    obj = Objective(tis_cap=2.0)
    # old = logp (r = 1, loss -A), rollout 3x less likely than old: weight min(3, 2) = 2.
    assert _one(obj, lp, 0.5, old=lp, roll=lp - LN(3)) == pytest.approx((-1.0, -1.0), rel=1e-12)
    # 1.5x: under the cap, weight 1.5.
    assert _one(obj, lp, 0.5, old=lp, roll=lp - LN(1.5)) == pytest.approx((-0.75, -0.75), rel=1e-12)
    # old not given: the weight compares the current policy (detached) with the rollout's.
    assert _one(obj, lp, 0.5, roll=lp + LN(2)) == pytest.approx((-0.25, -0.25), rel=1e-12)
    # The weight multiplies the policy-gradient term only, not the KL or the entropy terms.
    both = Objective(tis_cap=2.0, kl_coef=1.0, kl_estimator="k1", entropy_coef=0.1)
    loss, g = _one(both, lp, 0.5, old=lp, roll=lp - LN(3), ref=lp - 0.2, ent=1.5)
    assert (loss, g) == pytest.approx((-1.0 + 0.2 - 0.15, -1.0 + 1.0), rel=1e-12)


def test_stats_by_hand():
    obj = Objective(tis_cap=2.0, dual_clip_c=3.0, kl_coef=0.1, kl_estimator="k1")
    lp = torch.tensor([-1.0, -1.0, -2.0, -0.5], dtype=torch.float64)
    r = torch.tensor([5.0, 1.5, 0.5, 1.0], dtype=torch.float64)
    x = TokenInputs(torch.tensor([-1.0, 1.0, 1.0, 3.0]), torch.ones(4),
                    lp - torch.log(r), lp - 0.3, lp - torch.log(r) - LN(3) * torch.tensor([1, 0, 0, 0]))
    mask = torch.tensor([True, True, True, False])
    st = obj.stats(lp, None, x, mask)
    # Token 0 (A < 0, r = 5): the unclipped branch is PPO's, its loss 5 capped at 3 by the dual
    # clip. Token 1 (A > 0, r = 1.5): clipped at 1.28. Token 2 (A > 0, r = 0.5): unclipped.
    assert int(st["clip_frac"]) == 1
    assert int(st["dual_clip_frac"]) == 1
    assert float(st["ratio_sum"]) == pytest.approx(7.0)
    assert float(st["logprob_sum"]) == pytest.approx(-4.0)
    assert float(st["kl_sum"]) == pytest.approx(3 * 0.3)
    assert float(st["tis_weight_sum"]) == pytest.approx(2.0 + 1 + 1)
    assert int(st["tis_clip_frac"]) == 1
    assert "entropy" not in st


@pytest.mark.parametrize("field,value", [
    ("clip_low", 1.0), ("clip_low", -0.1), ("clip_high", float("nan")), ("kl_coef", -0.1),
    ("kl_coef", float("inf")), ("kl_estimator", "k4"), ("tis_cap", -1.0), ("dual_clip_c", 1.0),
    ("dual_clip_c", 0.5), ("loss_agg_mode", "seq-mean"), ("entropy_coef", True),
])
def test_objective_rejects_bad_fields(field, value):
    with pytest.raises(ConfigError, match=f"^{field}: ") as e:
        Objective(**{field: value})
    assert "\n" not in str(e.value)


def test_sample_token_counts_and_local_counts():
    ids = torch.tensor([[7, 7, 7, 900, 900, -1], [3, 3, 5, 5, 5, 5]])
    mask = torch.tensor([[1, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 1]]).bool()
    counts = sample_token_counts(mask, ids)
    assert counts.tolist() == [[2, 2, 2, 2, 2, 0], [0, 0, 3, 3, 3, 3]]
    # Sample 3 trains nothing: it is not counted; each split piece counts its share.
    assert counts_to_int(local_counts(mask, counts)) == (7, 3)
    a, b = local_counts(mask[:, :3], counts[:, :3]), local_counts(mask[:, 3:], counts[:, 3:])
    assert float(a[1]) == pytest.approx(1 + 1 / 3) and counts_to_int(a + b) == (7, 3)


def test_token_weights():
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]]).bool()
    st = torch.tensor([[2, 2, 2, 1], [1, 0, 0, 0]])  # samples: (0,0-1), (0,3), (1,0)
    w = lambda mode, **k: Objective(loss_agg_mode=mode).token_weights(mask, 8, 6, st, **k).tolist()
    assert w("token-mean") == [[1 / 8, 1 / 8, 0, 1 / 8], [1 / 8, 0, 0, 0]]
    assert w("seq-mean-token-sum") == [[1 / 6, 1 / 6, 0, 1 / 6], [1 / 6, 0, 0, 0]]
    assert w("seq-mean-token-mean") == [[1 / 12, 1 / 12, 0, 1 / 6], [1 / 6, 0, 0, 0]]
    with pytest.raises(ValueError, match="needs n_samples"):
        Objective(loss_agg_mode="seq-mean-token-sum").token_weights(mask, 8)
    # Nothing trained anywhere: zero weights, not a division by zero.
    z = Objective(loss_agg_mode="seq-mean-token-mean").token_weights(mask & False, 0, 0, st * 0)
    assert not z.any() and torch.isfinite(z).all()


# ---- aggregation over packed rows ------------------------------------------------------------

OBJ_TERMS = dict(dual_clip_c=3.0, kl_coef=0.1, tis_cap=2.0, entropy_coef=0.01)


def _packed(g, R=3, S=29, H=13, V=47):
    """Rows packed with several samples each (sample ids, -1 padding), labels and inputs."""
    ids = torch.full((R, S), -1)
    k = 0
    for r in range(R):
        o = 0
        while o < S - 2:
            n = int(torch.randint(2, 10, (1,), generator=g))
            ids[r, o:o + n] = k
            o, k = o + n, k + 1
    h = torch.randn(R, S, H, generator=g, dtype=torch.float64) * 0.5
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    y = torch.randint(0, V, (R, S), generator=g)
    y[(ids < 0) | (torch.rand(R, S, generator=g) < 0.2)] = -100
    y[ids == 1] = -100  # a sample that trains nothing does not count
    with torch.no_grad():
        lp0, _ = linear_logprobs(h, w, y)
    f = lambda s: (lp0 + s * torch.randn(R, S, generator=g, dtype=torch.float64)).clamp(max=0)
    x = dict(advantages=torch.randn(R, S, generator=g, dtype=torch.float64), old_logprobs=f(0.6),
             ref_logprobs=f(0.5), rollout_logprobs=f(0.9))
    return h, w, y, ids, x


def _loss_and_grads(obj, h, w, y, x, weights, impl="fused_torch"):
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _, _ = linear_policy_loss(hh, ww, y, obj, TokenInputs(weights=weights, **x), impl=impl,
                                    chunk_tokens=7)
    dh, dw = torch.autograd.grad(loss, [hh, ww])
    return loss.detach(), dh, dw


@pytest.mark.parametrize("mode", AGG_MODES)
def test_packed_rows_give_the_per_sequence_answer(mode):
    g = _gen()
    h, w, y, ids, x = _packed(g)
    obj = Objective(loss_agg_mode=mode, **OBJ_TERMS)
    mask = y != -100
    st = sample_token_counts(mask, ids)
    n_tok, n_smp = counts_to_int(local_counts(mask, st))
    got = _loss_and_grads(obj, h, w, y, x, obj.token_weights(mask, n_tok, n_smp, st))
    # The per-sequence answer: each sample alone through the plain reference (its own tokens,
    # a sum or a mean over them), then the mean over the samples that train a token (or, for
    # token-mean, every token of the batch alike).
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    total, n_seen = 0.0, 0
    for k in ids.unique().tolist():
        sel = (ids == k) & mask
        if k < 0 or not sel.any():
            continue
        n_seen += 1
        n = int(sel.sum())
        per = {"token-mean": 1.0 / n_tok, "seq-mean-token-sum": 1.0 / n_smp,
               "seq-mean-token-mean": 1.0 / (n_smp * n)}[mode]
        lk, _, _ = linear_policy_loss(hh[sel], ww, y[sel], obj,
                                      TokenInputs(weights=torch.full((n,), per, dtype=torch.float64),
                                                  **{f: t[sel] for f, t in x.items()}),
                                      impl="reference")
        total = total + lk
    want = (total.detach(), *torch.autograd.grad(total, [hh, ww]))
    assert n_seen == n_smp and n_smp >= 6
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    if mode != "token-mean":  # the modes differ on these inputs: the check above discriminates
        tm = Objective(**OBJ_TERMS)
        other = _loss_and_grads(tm, h, w, y, x, tm.token_weights(mask, n_tok))
        assert (other[1] - got[1]).abs().max() > 1e-3 * got[1].abs().max()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_split_over_ranks_and_context_parallel_pieces_adds_up(mode):
    # Rows over two "data ranks", each rank's columns cut in two pieces as context parallel
    # does (cutting samples): per-piece counts summed (the all-reduce) and per-piece weights
    # from the whole-sample token counts give the loss and gradients of the whole batch.
    g = _gen()
    h, w, y, ids, x = _packed(g, R=4)
    obj = Objective(loss_agg_mode=mode, **OBJ_TERMS)
    mask = y != -100
    st = sample_token_counts(mask, ids)  # before any split
    whole = _loss_and_grads(obj, h, w, y, x, obj.token_weights(mask, *counts_to_int(
        local_counts(mask, st)), st))
    cut = 11
    pieces = [(rows, cols) for rows in (slice(0, 1), slice(1, 4))
              for cols in (slice(0, cut), slice(cut, None))]
    summed = sum(local_counts(mask[p], st[p]) for p in pieces)
    n_tok, n_smp = counts_to_int(summed)
    assert (n_tok, n_smp) == counts_to_int(local_counts(mask, st))
    loss, dh, dw = 0.0, torch.zeros_like(h), torch.zeros_like(w)
    for p in pieces:
        lp_, dh_p, dw_p = _loss_and_grads(obj, h[p], w, y[p], {f: t[p] for f, t in x.items()},
                                          obj.token_weights(mask[p], n_tok, n_smp, st[p]))
        loss, dw = loss + lp_, dw + dw_p
        dh[p] = dh_p
    for a, b in zip((loss, dh, dw), whole):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
