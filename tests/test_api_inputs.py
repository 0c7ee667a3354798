"""longmoe.api.PolicyTrainer on one process: compute_logprobs against the model's full logits
per sample (each sample alone, unpacked, in float64), and every kind of bad input as one
UserError line naming the sample and field, raised before the model runs."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from longmoe.errors import UserError
from _api_samples import make_samples, run_dict as _run_dict


@pytest.fixture(scope="module")
def trainer():
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    return PolicyTrainer(from_dict(_run_dict(random.randrange(1000), preset="tiny-hybrid",
                                             budget=48)))


def _reference(model, s):
    """(log-probs, entropies) of one sample's response tokens from the full logits, float64."""
    ids = torch.cat([s.prompt, s.response])[None]
    logp = torch.log_softmax(model.logits(ids)[0].double(), -1)
    P = s.prompt_len
    lp = torch.full((s.response.numel(),), float("nan"), dtype=torch.float64)
    ent = lp.clone()
    for j in range(s.response.numel()):
        if P + j - 1 >= 0:
            row = logp[P + j - 1]
            lp[j] = row[s.response[j]]
            ent[j] = -(row.exp() * row).sum()
    return lp, ent


def test_compute_logprobs_match_full_logits_per_sample(trainer):
    S = make_samples(random.randrange(2**31), 7)
    S.append(make_samples(7, 1, first=7)[0])
    # 60 tokens: longer than the 48-token budget; data.overlong=error names it
    long = replace(S[0], prompt=torch.randint(0, 512, (30,)), response=torch.randint(0, 512, (30,)),
                   advantage=0.0, old_logprobs=None, ref_logprobs=None, rollout_logprobs=None)
    with pytest.raises(UserError, match=r"compute_logprobs: samples\[8\] \(draw 0\): sample of "
                                        r"60 tokens is longer than data.max_tokens_per_micro"):
        trainer.compute_logprobs(S + [long])
    lp, ent = trainer.compute_logprobs(S, with_entropy=True)
    assert trainer.compute_logprobs(S)[3].equal(lp[3])
    assert len(lp) == len(S)
    for s, a, e in zip(S, lp, ent):
        ra, re_ = _reference(trainer.model, s)
        assert a.dtype == torch.float32 and a.shape == s.response.shape and a.device.type == "cpu"
        torch.testing.assert_close(a.double(), ra, rtol=0, atol=2e-5, equal_nan=True)
        torch.testing.assert_close(e.double(), re_, rtol=0, atol=2e-5, equal_nan=True)
    assert math.isnan(lp[1][0]) and S[1].prompt_len == 0   # nothing predicts it
    assert S[3].loss_mask is not None and not torch.isnan(lp[3]).any()  # mask ignored


def _expect(fn, pattern):
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    import re
    assert re.search(pattern, msg), msg


def test_bad_inputs_name_the_sample_and_field(trainer):
    pt = trainer
    S = make_samples(11, 4)
    fb = pt.forward_backward
    s2 = S[2]
    R = s2.response.numel()

    def with_(**kw):
        out = list(S)
        out[2] = replace(s2, **kw)
        return out

    _expect(pt.optim_step, r"optim_step: no forward_backward since the last optim_step")
    _expect(lambda: fb([]), r"forward_backward: the list of samples is empty")
    _expect(lambda: fb(S[:1] + ["text"]), r"samples\[1\]: expected a longmoe.data.sample.Sample")
    ids = s2.response.clone()
    ids[R - 1] = 512
    _expect(lambda: fb(with_(response=ids)),
            rf"samples\[2\] \(draw 2\): response\[{R - 1}\]: token id 512 is outside the "
            rf"vocabulary \[0, 512\)")
    _expect(lambda: pt.compute_logprobs(with_(prompt=s2.prompt - 1000)),
            r"compute_logprobs: samples\[2\] \(draw 2\): prompt\[0\]: token id -")
    _expect(lambda: fb(with_(response=s2.response.float())), r"response must be a 1-D integer")
    for field in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        _expect(lambda: fb(with_(**{field: torch.full((R + 1,), -1.0)})),
                rf"samples\[2\] \(draw 2\): {field} must be a 1-D float tensor of {R} values")
    _expect(lambda: fb(with_(loss_mask=torch.ones(R + 2, dtype=torch.bool))),
            rf"samples\[2\] \(draw 2\): loss_mask must be a 1-D tensor of {R} values")
    _expect(lambda: fb(with_(advantage=torch.ones(R - 1) if R > 1 else torch.ones(2))),
            r"samples\[2\] \(draw 2\): advantage must be a 1-D float tensor")
    _expect(lambda: fb(with_(advantage=float("nan"))), r"samples\[2\] \(draw 2\): advantage: nan "
                                                       r"is not finite")
    adv = torch.zeros(R)
    adv[R - 1] = float("inf")
    _expect(lambda: fb(with_(advantage=adv)), rf"advantage\[{R - 1}\]: inf is not finite")
    ref = s2.ref_logprobs.clone()
    ref[R - 1] = 0.5
    _expect(lambda: fb(with_(ref_logprobs=ref)),
            rf"samples\[2\] \(draw 2\): ref_logprobs\[{R - 1}\]: 0.5 is positive")
    old = s2.old_logprobs.clone()
    old[0] = float("-inf")
    _expect(lambda: fb(with_(old_logprobs=old)), r"old_logprobs\[0\]: -inf is not finite")
    _expect(lambda: fb(with_(rollout_logprobs=None)),
            r"samples\[2\] \(draw 2\): rollout_logprobs is missing \(loss.tis_cap=1.5")
    _expect(lambda: fb(S, num_tokens=0), r"forward_backward: num_tokens must be a positive int")
    long = replace(s2, prompt=torch.randint(0, 512, (40,)), response=torch.randint(0, 512, (20,)),
                   advantage=0.5, loss_mask=None,
                   old_logprobs=None, ref_logprobs=torch.full((20,), -1.0),
                   rollout_logprobs=torch.full((20,), -1.0))
    _expect(lambda: fb(S[:2] + [long]), r"forward_backward: samples\[2\] \(draw 2\): sample of "
                                        r"60 tokens is longer than data.max_tokens_per_micro_batch")
    # Untrained tokens are not read; a rounding hair above 0 is a log-probability.
    ok = replace(s2, loss_mask=torch.ones(R, dtype=torch.bool),
                 old_logprobs=s2.old_logprobs.clone(), ref_logprobs=s2.ref_logprobs.clone())
    ok.loss_mask[0] = False
    ok.old_logprobs[0] = float("nan")
    ok.ref_logprobs[R - 1] = 1e-6
    assert pt.counts(S)["tokens"] > 0
    got = fb(S[:2] + [ok])
    assert math.isfinite(got["loss"])
    assert pt.optim_step()["skipped"] is None
