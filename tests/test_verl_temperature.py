"""verl's rollout temperature through the longmoe engine: verl hands it as a number for the
batch or a tensor with one value per sequence; log-probs and entropy are those of
softmax(logits / T), as verl's FSDP engine computes them, and training at T (verl's own loss or
the fused one) equals PolicyTrainer called directly on samples at T."""

import dataclasses

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

from _verl import (_train_inputs, ragged, reference, train_mini_batch, verl_env,  # noqa: E402,F401
                   verl_logprobs, worker)
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402


def _at(samples, temps):
    return [dataclasses.replace(s, temperature=t) for s, t in zip(samples, temps)]


@pytest.mark.parametrize("per_sequence", [False, True])
def test_infer_at_temperature_matches_compute_logprobs_and_full_logits(verl_env, per_sequence):
    pt, path = reference("tiny-hybrid", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=5, seed=3)
    temps = [0.6, 1.0, 1.4, 0.8, 2.0] if per_sequence else [0.7] * 5
    want_lp, want_ent = pt.compute_logprobs(_at(samples, temps), with_entropy=True)
    if per_sequence:
        td["temperature"] = torch.tensor(temps)
    w = worker(path, "tiny-hybrid")
    for budget in (16, 200):  # one sequence per micro-batch .. all in one
        lp, ent, _ = verl_logprobs(w, td, budget, temperature=None if per_sequence else 0.7)
        for i, s in enumerate(samples):
            R = s.response.numel()
            assert torch.allclose(lp[i, :R], want_lp[i], atol=1e-5, rtol=0), (budget, i)
            assert torch.allclose(ent[i, :R], want_ent[i], atol=1e-5, rtol=5e-6), \
                (budget, i, float((ent[i, :R] - want_ent[i]).abs().max()))
    # compute_logprobs at T is checked against the model's full logits / T in
    # test_temperature.py; here, that T reached the head at all
    at_one = pt.compute_logprobs(samples)
    for t, a, b in zip(temps, want_lp, at_one):
        assert (t == 1.0) == torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_train_step_at_temperature_matches_forward_backward(verl_env, fused, per_sequence):
    """verl's micro-batching reorders sequences by length (dynamic batch size): a per-sequence
    temperature must follow its sequence, or the first on-policy step's ratio would not be 1."""
    pt, path = reference("tiny", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=1)
    temps = [0.5, 1.0, 1.6, 0.8] if per_sequence else [0.7] * 4
    samples = _at(samples, temps)
    td, with_old = _train_inputs(pt, td, samples)
    if per_sequence:
        td["temperature"] = torch.tensor(temps)
    want = pt.forward_backward(with_old)
    want_step = pt.optim_step()
    w = worker(path, "tiny", max_tokens=24, mini_batch=4, epochs=1, fused=fused)
    out = train_mini_batch(w, td, 4, temperature=0.7)
    assert w.engine.fused_last is fused
    assert w.engine.trainer.step == 1
    # on-policy at T: the old log-probs were computed at T, so the ratio is 1 on every token
    assert out["actor/ppo_kl"] == [pytest.approx(0.0, abs=1e-6)] * len(out["actor/ppo_kl"])
    assert sum(out["actor/pg_clipfrac"]) == 0.0
    assert out["loss"][0] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert out["grad_norm"][0] == pytest.approx(want_step["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), [0.7, 0.0]])
def test_bad_temperature_is_refused_before_any_micro_batch(verl_env, bad):
    pt, path = reference("tiny", verl_env)
    _, td = ragged(pt.run.model.vocab_size, "left", n=2)
    w = worker(path, "tiny")
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    if isinstance(bad, list):
        td["temperature"] = torch.tensor(bad)
    else:
        tu.assign_non_tensor(td, temperature=bad)
    with pytest.raises(ValueError, match="temperature .* is not a positive finite number"):
        w.infer_batch(td)
