"""The rollout temperature: log-probs and entropy are those of softmax(logits / T), T per sample,
as the rollout engine sampled. The LM head divides its normalised hidden state by T (logits are
linear in it) before the linear cross-entropy, fused policy loss included; checked against the
plain log-softmax of full logits divided by T, per sample, in packed rows, and the field's
checks at every entry (JSONL row, API sample)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from longmoe.config import get_preset
from longmoe.data.packing import pack_rows
from longmoe.data.sample import Sample
from longmoe.errors import UserError
from longmoe.model.transformer import LMHead
from longmoe.rl.objective import FusedLoss, Objective, TokenInputs

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


def _head(dtype, seed, V=203, H=48):
    cfg = get_preset("tiny").replace(vocab_size=V, hidden_size=H)
    head = LMHead(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) * 0.3)
        head.norm.weight.copy_(1 + 0.1 * torch.randn(H, generator=g))
    head.chunk_tokens = 16  # several chunks per row
    return head.to(dtype), g


def _reference(head, x, labels, temp):
    """fp64 log-softmax of the full logits divided by the temperature (the head's own norm)."""
    h = head.norm(x.detach()).double()
    z = (h @ head.weight.detach().double().T) / temp.double()[..., None]
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(logp.exp() * logp).sum(-1)
    keep = labels != -100
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["reference", "chunked", "chunked_inplace"])
def test_head_logprobs_and_entropy_at_temperature(dtype, impl):
    seed = random.randrange(2**31)
    head, g = _head(dtype, seed)
    head.impl = impl
    B, S, V = 2, 37, head.weight.shape[0]
    x = torch.randn(B, S, head.weight.shape[1], generator=g).to(dtype)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, ::5] = -100
    temp = 0.3 + 1.7 * torch.rand(B, S, generator=g)   # per position, as packed rows give it
    lp, ent, _ = head(x, labels, with_entropy=True, temperature_BS=temp)
    want_lp, want_ent = _reference(head, x, labels, temp)
    torch.testing.assert_close(lp.double(), want_lp, **TOL[dtype], msg=f"seed {seed}")
    torch.testing.assert_close(ent.double(), want_ent, **TOL[dtype], msg=f"seed {seed}")
    # temperature 1 is the plain head
    one, _, _ = head(x, labels, temperature_BS=torch.ones(B, S))
    plain, _, _ = head(x, labels)
    torch.testing.assert_close(one, plain, rtol=0, atol=0)


def test_head_gradients_at_temperature():
    """d/dx and d/dW of a weighted log-prob sum through the head at per-position temperatures,
    against autograd through the fp64 reference."""
    seed = random.randrange(2**31)
    head, g = _head(torch.float32, seed)
    head.impl = "chunked"
    B, S, V = 1, 29, head.weight.shape[0]
    x = torch.randn(B, S, head.weight.shape[1], generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    temp = 0.5 + torch.rand(B, S, generator=g)
    coef = torch.randn(B, S, generator=g)
    lp, _, _ = head(x, labels, temperature_BS=temp)
    dx, dw = torch.autograd.grad((lp * coef).sum(), [x, head.weight])
    x64 = x.detach().double().requires_grad_()
    ref = LMHead(get_preset("tiny").replace(vocab_size=V, hidden_size=x.shape[-1])).double()
    ref.load_state_dict({k: v.double() for k, v in head.state_dict().items()})
    h = ref.norm(x64)
    logp = torch.log_softmax((h @ ref.weight.T) / temp.double()[..., None], -1)
    want = logp.gather(-1, labels[..., None])[..., 0]
    rx, rw = torch.autograd.grad((want * coef.double()).sum(), [x64, ref.weight])
    torch.testing.assert_close(dx.double(), rx, atol=1e-5, rtol=1e-4, msg=f"seed {seed}")
    torch.testing.assert_close(dw.double(), rw, atol=1e-5, rtol=1e-4, msg=f"seed {seed}")


def test_fused_policy_loss_at_temperature_equals_objective_on_tempered_logprobs():
    seed = random.randrange(2**31)
    head, g = _head(torch.float32, seed)
    B, S, V = 1, 41, head.weight.shape[0]
    x = torch.randn(B, S, head.weight.shape[1], generator=g, requires_grad=True)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, :4] = -100
    temp = torch.full((B, S), 0.7)
    mask = labels != -100
    want_lp, _ = _reference(head, x, labels, temp)
    obj = Objective(clip_low=0.2, clip_high=0.28)
    inputs = TokenInputs(advantages=torch.randn(B, S, generator=g),
                         weights=mask / mask.sum(),
                         old_logprobs=(want_lp + 0.05 * torch.randn(B, S, generator=g)).float())
    _, _, loss = head(x, labels, policy=FusedLoss(obj, inputs, "fused_torch"), temperature_BS=temp)
    (dx,) = torch.autograd.grad(loss, [x])
    # the same objective on log-probs from full logits / T, autograd through it
    x2 = x.detach().clone().requires_grad_()
    h = head.norm(x2)
    logp = torch.log_softmax((h @ head.weight.T) / temp[..., None], -1)
    lp = torch.where(mask, logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    want = obj.token_loss(lp, None, inputs, mask).sum()   # w_t * loss_t, summed
    (rx,) = torch.autograd.grad(want, [x2])
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-5, msg=f"seed {seed}")
    torch.testing.assert_close(dx, rx, atol=1e-6, rtol=1e-4, msg=f"seed {seed}")


def test_packed_rows_carry_each_samples_temperature():
    g = torch.Generator().manual_seed(0)
    s = [Sample(torch.randint(0, 50, (p,), generator=g), torch.randint(0, 50, (r,), generator=g),
                advantage=0.1, temperature=t) for p, r, t in ((3, 4, 0.6), (2, 5, 1.0), (1, 3, 1.3))]
    pb = pack_rows([s[:2], s[2:]], pad_multiple=4)
    assert pb.temperature.shape == pb.input_ids.shape
    for r, row in enumerate((s[:2], s[2:])):
        o = 0
        for smp in row:
            assert bool((pb.temperature[r, o:o + len(smp)] == smp.temperature).all())
            o += len(smp)
        assert bool((pb.temperature[r, o:] == 1.0).all())   # padding
    assert pack_rows([[s[1]]]).temperature is None         # all at 1: no per-token division


def test_policy_trainer_logprobs_at_temperature_match_full_logits():
    """compute_logprobs of samples at different temperatures packed into one row equals each
    sample's own forward: log_softmax(logits / T) of its response tokens; forward_backward at
    temperature T reports the same mean log-prob."""
    from longmoe.api import PolicyTrainer
    pt = PolicyTrainer.from_config(None, ["model.preset=tiny", "train.device=cpu",
                                          "model.init_std=0.2",
                                          "data.max_tokens_per_micro_batch=64"])
    V = pt.run.model.vocab_size
    g = torch.Generator().manual_seed(random.randrange(2**31))
    temps = (0.5, 1.0, 1.7)
    samples = [Sample(torch.randint(0, V, (4,), generator=g), torch.randint(0, V, (6,), generator=g),
                      advantage=1.0, temperature=t, index=i) for i, t in enumerate(temps)]
    got = pt.compute_logprobs(samples)
    for s, lp in zip(samples, got):
        ids = torch.cat([s.prompt, s.response])[None]
        with torch.no_grad():
            z = pt.model.logits(ids)[0].double() / s.temperature
        want = torch.log_softmax(z, -1)[s.prompt_len - 1:-1].gather(-1, s.response[:, None])[:, 0]
        torch.testing.assert_close(lp.double(), want, atol=2e-5, rtol=0)
    out = pt.forward_backward(samples)
    mean = sum(float(lp.sum()) for lp in got) / sum(lp.numel() for lp in got)
    assert math.isclose(out["mean_logprob"], mean, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "hot"])
def test_bad_temperature_is_refused_by_name(bad):
    from longmoe.api import PolicyTrainer
    from longmoe.data.validate import check_sample
    pt = PolicyTrainer.from_config(None, ["model.preset=tiny", "train.device=cpu"])
    s = Sample(torch.tensor([1, 2]), torch.tensor([3, 4]), advantage=0.0, temperature=bad)
    for call in (lambda: pt.compute_logprobs([s]), lambda: pt.forward_backward([s])):
        with pytest.raises(UserError, match=r"samples\[0\]: temperature: .* not a positive finite"):
            call()
    row = {"prompt": [1, 2], "response": [3, 4], "advantage": 0.0, "temperature": bad}
    with pytest.raises(UserError, match=r"^f\.jsonl:3: temperature: "):
        check_sample(row, "f.jsonl:3", 100)


def _fsdp_rank(rank, world, backend, d, samples):
    """What the LM head receives under FSDP2 with bf16 compute: the loss's per-token inputs and
    the temperature, as the unit's forward sees them."""
    import longmoe.model.transformer as tr
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    seen = []
    plain = tr.LMHead.forward

    def spy(self, x, labels, with_entropy=False, policy=None, temperature_BS=None):
        got = {f: getattr(policy.inputs, f) for f in ("advantages", "weights", "old_logprobs")}
        got["temperature"] = temperature_BS
        seen.append({f: t.clone() for f, t in got.items() if t is not None})
        return plain(self, x, labels, with_entropy, policy, temperature_BS)

    tr.LMHead.forward = spy
    try:
        pt = PolicyTrainer(from_dict(d))
        pt.forward_backward(samples)
    finally:
        tr.LMHead.forward = plain
    return seen


def test_fsdp_hands_the_loss_inputs_and_temperature_to_the_head_unrounded():
    """FSDP2 casts floating-point forward arguments to param_dtype by default; the root and the
    head must not: a bf16 old log-prob near -6 would be off by up to 0.016, and 1/N weights and
    temperatures would move too. Two gloo ranks, bf16 parameters."""
    from longmoe.paired.spawn import run_ranks

    from _api_samples import make_samples, run_dict
    d = run_dict(4, fsdp=True, loss={"clip_low": 0.2, "clip_high": 0.28})
    d["parallel"]["param_dtype"] = "bfloat16"
    samples = [Sample(s.prompt, s.response, s.advantage, old_logprobs=s.old_logprobs,
                      loss_mask=s.loss_mask, temperature=0.6 + 0.1 * i, index=s.index,
                      where=s.where) for i, s in enumerate(make_samples(7, 4))]
    given_old = {float(v) for s in samples for v in s.old_logprobs}
    given_t = {float(torch.tensor(s.temperature, dtype=torch.float32)) for s in samples}
    calls = [c for seen in run_ranks(_fsdp_rank, 2, d, samples) for c in seen]
    assert sum("temperature" in c for c in calls) >= 2   # both ranks had samples
    for c in calls:
        assert all(c[f].dtype in (torch.float32, torch.float64) for f in c), \
            {f: c[f].dtype for f in c}
        old = c["old_logprobs"][torch.isfinite(c["old_logprobs"])]
        assert {float(v) for v in old} <= given_old
        if "temperature" in c:
            assert {float(v) for v in c["temperature"].unique()} <= given_t | {1.0}


def test_jsonl_and_parquet_rows_carry_the_temperature(tmp_path):
    """The `temperature` field of a JSONL line or Parquet row reaches the sample (missing: 1),
    checked by the row validator."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from longmoe.data.sources import JsonlSource, ParquetSource
    from longmoe.data.validate import check_sample
    rows = [{"prompt": [1, 2], "response": [3, 4, 5], "advantage": 0.5, "temperature": 0.6},
            {"prompt": [6], "response": [7], "advantage": -1.0}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    check = lambda row, where: check_sample(row, where, 100)  # noqa: E731
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in rows],
                             "response": [r["response"] for r in rows],
                             "advantage": [r["advantage"] for r in rows],
                             "temperature": [r.get("temperature") for r in rows]}),
                   tmp_path / "r.parquet")
    for src in (JsonlSource(path, check), ParquetSource(tmp_path / "r.parquet", check)):
        assert [s.temperature for s in src.get_many([0, 1])] == [0.6, 1.0]


def _experts_rank(rank, world, backend, d, samples):
    """The dtypes the experts' FSDP unit receives (EP > 1 wraps it apart): tokens, weights."""
    from longmoe.api import PolicyTrainer
    from longmoe.model.moe import GroupedExperts
    from longmoe.train.config import from_dict
    seen = []
    plain = GroupedExperts.forward

    def spy(self, x, rows, w_A=None, offs=None):
        seen.append((x.dtype, None if w_A is None else w_A.dtype))
        return plain(self, x, rows, w_A, offs)

    GroupedExperts.forward = spy
    try:
        PolicyTrainer(from_dict(d)).forward_backward(samples)
    finally:
        GroupedExperts.forward = plain
    return seen


def test_fsdp_hands_the_experts_fp32_combine_weights_as_one_rank_does():
    """EP 2 x FSDP2 with bf16 parameters: the experts' unit gets the router's fp32 combine
    weights as given (as at EP 1, where the experts are no unit of their own), not rounded to
    bf16 by FSDP's input cast; its tokens arrive in bf16 from the block."""
    from longmoe.paired.spawn import run_ranks

    from _api_samples import make_samples, run_dict
    d = run_dict(4, ep=2, fsdp=True)
    d["parallel"]["param_dtype"] = "bfloat16"
    calls = [c for seen in run_ranks(_experts_rank, 2, d, make_samples(9, 4)) for c in seen]
    assert calls and all(w == torch.float32 for _, w in calls), calls
    assert all(x == torch.bfloat16 for x, _ in calls), calls
