"""longmoe.api.PolicyTrainer on real gloo ranks against one process: the same global list of
samples gives the same loss, statistics, gradient norm and parameter update on 2 ranks (EP 2 x
FSDP2, several packed micro-batches) as on one; several forward_backward calls accumulate
under the documented normalisation; a save/load round trip continues exactly; samples that
differ between ranks stop every rank with one error. Context parallel 2 gives the same loss,
update and log-probs too.

AdamW with a large eps (1) makes the first update lr * g / (|g| + 1): smooth in the gradient, so
float rounding between layouts stays a rounding-sized difference (with the usual eps the first
step is about sign(g), which rounding flips where an element is near 0). The MoE balance loss is
off: it is measured per micro-batch, and the layouts split micro-batches differently.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from longmoe.paired.harness import TOLERANCE, rel_err
from longmoe.paired.spawn import run_ranks

from _api_samples import make_samples, run_dict as _run_dict

TOL = 5 * TOLERANCE[torch.float32]


def _params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor
    return {n.replace("block.", ""): (p.full_tensor() if isinstance(p, DTensor) else p)
            .detach().cpu().clone() for n, p in model.named_parameters()}


def _grads(model) -> dict[str, torch.Tensor]:
    """Every gradient as docs/api.md ("Reading gradients") says to read it between
    forward_backward and optim_step: full_tensor() on every rank, in the same order."""
    from torch.distributed.tensor import DTensor
    return {n.replace("block.", ""): (p.grad.full_tensor() if isinstance(p.grad, DTensor)
                                      else p.grad).detach().cpu().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


def _train_once(run, samples, calls=None, probe=False, grads=None):
    """A fresh trainer: forward_backward over `calls` (lists of samples with keyword args), one
    optim_step; (stats of each call, optim info, parameter update, trainer). `probe`: a
    compute_logprobs after each call, which must change nothing of the step. `grads` (a dict):
    filled with the gradients read before the optim_step."""
    from longmoe.api import PolicyTrainer
    pt = PolicyTrainer(run)
    p0 = _params(pt.model)
    stats = []
    for s, kw in calls or [(samples, {})]:
        stats.append(pt.forward_backward(s, **kw))
        if probe:
            pt.compute_logprobs(s[:3])
    if grads is not None:
        grads.update(_grads(pt.model))
    info = pt.optim_step()
    return stats, info, _delta(p0, _params(pt.model)), pt


def scenario(run_dict, seed, ckpt_dir):
    """Every check that runs the same on one process and on ranks; rank-specific bad calls are
    in _rank."""
    from longmoe.train.config import from_dict
    run = from_dict(run_dict)
    S = make_samples(seed, 9)
    A, B = S[:4], S[4:]
    out = {"grads": {}}
    stats, info, delta, pt = _train_once(run, S, grads=out["grads"])
    out.update(stats=stats[0], info=info, delta=delta)
    out["logprobs"], out["entropy"] = pt.compute_logprobs(S, with_entropy=True)
    pt.save(ckpt_dir)
    S2 = make_samples(seed + 1, 5, first=100)
    out["after_save"] = [pt.forward_backward(S2), pt.optim_step(), pt.compute_logprobs(S)]
    pt.load(ckpt_dir)
    out["step_after_load"] = pt.step
    out["after_load"] = [pt.forward_backward(S2), pt.optim_step(), pt.compute_logprobs(S)]
    # Two calls normalised by the union's counts equal one call over the union (log-probs
    # computed between them change nothing).
    c = pt.counts(S)
    kw = {"num_tokens": c["tokens"], "num_samples": c["samples"]}
    out["split"] = _train_once(run, None, [(A, kw), (B, kw)], probe=True)[:3]
    # The default (each call normalised by its own counts): k calls of the same list sum k
    # equal losses, so the gradient is k times one call's.
    out["twice"] = _train_once(run, None, [(A, {}), (A, {})])[1]["grad_norm"]
    out["once"] = _train_once(run, None, [(A, {})])[1]["grad_norm"]
    out["counts"] = c
    return out


def _rank(rank, world, backend, run_dict, seed, ckpt_dir):
    from dataclasses import replace

    from longmoe.api import PolicyTrainer
    from longmoe.errors import UserError
    from longmoe.train.config import from_dict
    out = scenario(run_dict, seed, ckpt_dir)
    pt = PolicyTrainer(from_dict(run_dict))
    S = make_samples(seed, 6)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except UserError as e:
            errors[name] = str(e)

    # rank 1 gets another advantage for sample 4
    other = list(S)
    if rank == 1:
        other[4] = replace(S[4], advantage=7.0)
    attempt("differ", lambda: pt.forward_backward(other))
    attempt("length", lambda: pt.forward_backward(S[:5] if rank == 1 else S))
    bad = list(S)
    if rank == 1:
        bad[2] = replace(S[2], response=S[2].response.clone().fill_(10 ** 6))
    attempt("one_rank_bad", lambda: pt.forward_backward(bad))
    attempt("calls", lambda: pt.compute_logprobs(S) if rank else pt.forward_backward(S))
    # nothing was left half done: the trainer still trains
    out["after_errors"] = [pt.forward_backward(S)["loss"], pt.optim_step()["skipped"]]
    out["errors"] = errors
    # Context parallel 2 (each sample's row split zigzag over both ranks), FSDP2 over them
    cp_run = from_dict({**run_dict, "parallel": {**run_dict["parallel"], "ep": 1, "cp": 2}})
    stats, info, delta, pt = _train_once(cp_run, make_samples(seed, 9))
    out["cp"] = {"stats": stats[0], "info": info, "delta": delta,
                 "logprobs": pt.compute_logprobs(make_samples(seed, 9))}
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    seed = random.randrange(2**31)
    ranks = run_ranks(_rank, 2, _run_dict(seed % 1000, ep=2, fsdp=True), seed,
                      str(tmp_path_factory.mktemp("ck2")))
    one = scenario(_run_dict(seed % 1000), seed, str(tmp_path_factory.mktemp("ck1")))
    return ranks, one


def _same_update(got_by_rank, ref, what):
    """Every parameter's update equal to the reference's; expert stacks are EP-local, so the
    ranks' slices are concatenated (2 ranks of EP 2: rank r holds experts [4r, 4r + 4))."""
    assert len(ref) > 10
    for name, d in ref.items():
        assert d.abs().max() > 0, (what, name)      # the comparison can fail: it moved
        got = (torch.cat([g[name] for g in got_by_rank]) if ".experts." in name
               else got_by_rank[0][name])
        assert rel_err(got, d) < TOL, (what, name)


def test_two_ranks_equal_one_process(two_ranks):
    ranks, one = two_ranks
    for r in ranks:
        for k, v in one["stats"].items():
            if k in ("micro_batches", "row_tokens", "padding_share"):
                continue  # rows are the layout's
            assert abs(r["stats"][k] - v) <= TOL * max(abs(v), 1e-2), k
        assert set(r["stats"]) == set(one["stats"])
        assert abs(r["info"]["grad_norm"] - one["info"]["grad_norm"]) < TOL * one["info"]["grad_norm"]
        for a, b in zip(r["logprobs"] + r["entropy"], one["logprobs"] + one["entropy"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    _same_update([r["delta"] for r in ranks], one["delta"], "2 ranks")
    for r in ranks:   # CP 2: every rank holds every expert
        _same_update([r["cp"]["delta"]], one["delta"], "cp 2")
        assert abs(r["cp"]["stats"]["loss"] - one["stats"]["loss"]) <= TOL * max(
            abs(one["stats"]["loss"]), 1e-2)
        assert r["cp"]["stats"]["tokens"] == one["stats"]["tokens"]
        for a, b in zip(r["cp"]["logprobs"], one["logprobs"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert ranks[0]["stats"]["micro_batches"] > 1    # several packed micro-batches per rank
    for k in ("kl", "tis_weight", "tis_clip_frac", "dual_clip_frac", "ratio", "entropy"):
        assert k in one["stats"], k
    assert 0 < one["stats"]["tis_weight"] <= 1.5


def test_gradients_read_on_ranks(two_ranks):
    """docs/api.md, "Reading gradients": between forward_backward and optim_step, a dense
    gradient's full_tensor() is world size 1's on every rank; an expert gradient's is the rank's
    own experts, parallel.ep (here 2) times theirs until optim_step settles it."""
    ranks, one = two_ranks
    ref = one["grads"]
    assert len(ref) > 10 and any(".experts." in n for n in ref)
    for name, g in ref.items():
        assert g.abs().max() > 0, name   # the comparison can fail
        if ".experts." in name:
            assert rel_err(torch.cat([r["grads"][name] for r in ranks]) / 2, g) < TOL, name
        else:
            for r in ranks:
                assert rel_err(r["grads"][name], g) < TOL, name


def test_accumulated_calls(two_ranks):
    ranks, one = two_ranks
    for group in (ranks, [one]):
        _same_update([r["split"][2] for r in group], one["delta"], "two calls, union's counts")
    for res in ranks + [one]:
        stats = res["split"][0]
        assert stats[0]["tokens"] + stats[1]["tokens"] == res["counts"]["tokens"]
        assert abs(res["twice"] - 2 * res["once"]) < TOL * res["once"]


def test_save_load_continues_identically(two_ranks):
    ranks, one = two_ranks
    for res in ranks + [one]:
        assert res["step_after_load"] == 1
        (sa, ia, la), (sb, ib, lb) = res["after_save"], res["after_load"]
        assert sa == sb and ia == ib, (sa, sb)
        assert ia["step"] == 2
        for a, b in zip(la, lb):
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        assert not torch.equal(torch.nan_to_num(la[0]), torch.nan_to_num(res["logprobs"][0]))


def test_samples_that_differ_between_ranks_stop_every_rank(two_ranks):
    ranks, _ = two_ranks
    e0, e1 = ranks[0]["errors"], ranks[1]["errors"]
    for e in (e0, e1):
        assert set(e) == {"differ", "length", "one_rank_bad", "calls"}, e
        assert all("\n" not in m for m in e.values())
        assert "samples[4] (draw 4) differs between ranks" in e["differ"]
        assert "different lengths (5 to 6 samples" in e["length"]
        assert "different calls" in e["calls"]
    assert "samples[2] (draw 2): response[0]: token id 1000000 is outside" in e1["one_rank_bad"]
    assert "another rank rejected its samples" in e0["one_rank_bad"]
    for r in ranks:
        assert math.isfinite(r["after_errors"][0]) and r["after_errors"][1] is None
