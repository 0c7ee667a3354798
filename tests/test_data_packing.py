"""Packing samples into token-budget rows: every token once, positions restarting per sample,
labels and per-token signals aligned as in single-sample rows; the overlong policy."""

import random

import pytest
import torch

from longmoe.data.balance import plan_step
from longmoe.data.overlong import check_budget, fit_lengths
from longmoe.data.packing import IGNORE, pack_rows, row_sample_lengths
from longmoe.data.sample import Sample, trained_tokens
from longmoe.errors import ConfigError, UserError
from _rows import single_rows

V = 53


def rand_sample(rng: random.Random, index: int, P: int | None = None, R: int | None = None) -> Sample:
    P = rng.randrange(0, 9) if P is None else P
    R = rng.randrange(1, 12) if R is None else R
    row = {"prompt": [rng.randrange(V) for _ in range(P)],
           "response": [rng.randrange(V) for _ in range(R)],
           "advantage": ([rng.gauss(0, 1) for _ in range(R)] if rng.random() < 0.5
                         else rng.gauss(0, 1))}
    for key in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
        if rng.random() < 0.7:
            row[key] = [-rng.random() * 5 for _ in range(R)]
    if rng.random() < 0.5:
        row["loss_mask"] = [int(rng.random() < 0.7) for _ in range(R)]
    return Sample.from_row(row, index=index, where=f"test row {index}")


def as_row(s: Sample, logprob_key: str = "old_logprobs") -> dict:
    """The sample as the single-sample packer's dict, with one of its log-prob fields."""
    adv = s.advantage.tolist() if isinstance(s.advantage, torch.Tensor) else s.advantage
    lp = getattr(s, logprob_key)
    return {"prompt": s.prompt.tolist(), "response": s.response.tolist(), "advantage": adv,
            "old_logprobs": None if lp is None else lp.tolist(),
            "loss_mask": None if s.loss_mask is None else s.loss_mask.int().tolist()}


def same(a, b):
    return torch.equal(a.nan_to_num(1234.5), b.nan_to_num(1234.5))


def random_rows(rng, n_rows):
    idx = iter(range(10**6))
    return [[rand_sample(rng, next(idx)) for _ in range(rng.randrange(0 if r else 1, 5))]
            for r in range(n_rows)]


@pytest.mark.parametrize("seed", [random.randrange(2**31) for _ in range(4)])
def test_packed_rows_match_single_sample_rows(seed):
    rng = random.Random(seed)
    rows = random_rows(rng, rng.randrange(1, 4))
    pad = rng.choice([1, 2, 4, 8])
    b = pack_rows(rows, pad_multiple=pad)
    R, S = b.input_ids.shape
    assert R == len(rows) and S % pad == 0 and S >= max(sum(map(len, r)) for r in rows)
    assert all(t.shape == (R, S) for t in (b.labels, b.advantages, b.old_logprobs, b.ref_logprobs,
                                           b.rollout_logprobs, b.sample_ids, b.positions))
    k = 0
    for r, row in enumerate(rows):
        o = 0
        for s in row:
            L = len(s)
            sl = slice(o, o + L)
            assert (b.sample_ids[r, sl] == k).all() and (b.sample_ids[r] == k).sum() == L
            assert torch.equal(b.positions[r, sl], torch.arange(L))
            assert torch.equal(b.input_ids[r, sl], torch.cat([s.prompt, s.response]))
            for key, packed in (("old_logprobs", b.old_logprobs), ("ref_logprobs", b.ref_logprobs),
                                ("rollout_logprobs", b.rollout_logprobs)):
                ref = single_rows([as_row(s, key)], seq_len=L)
                assert same(packed[r, sl], ref.old_logprobs[0]), key
            ref = single_rows([as_row(s)], seq_len=L)
            assert torch.equal(b.labels[r, sl], ref.labels[0])
            assert same(b.advantages[r, sl], ref.advantages[0])
            assert b.labels[r, o + L - 1] == IGNORE       # never predicts the next sample
            assert (b.labels[r, sl] != IGNORE).sum() == trained_tokens(s)
            o, k = o + L, k + 1
        # padding: nothing trained, no sample
        assert (b.sample_ids[r, o:] == -1).all() and (b.labels[r, o:] == IGNORE).all()
        assert (b.advantages[r, o:] == 0).all() and b.old_logprobs[r, o:].isnan().all()
    assert b.useful_tokens == sum(len(s) for row in rows for s in row)
    assert b.padding_tokens == R * S - b.useful_tokens
    assert row_sample_lengths(b.sample_ids) == [list(x) for x in b.row_lengths]
    assert b.sample_index == tuple(tuple(s.index for s in row) for row in rows)


def test_every_token_once():
    rng = random.Random(7)
    rows = random_rows(rng, 3)
    b = pack_rows(rows, seq_len=64)
    assert b.input_ids.shape == (3, 64)
    got = sorted((int(k), int(p), int(t)) for k, p, t in
                 zip(b.sample_ids.flatten(), b.positions.flatten(), b.input_ids.flatten()) if k >= 0)
    want = sorted((k, p, int(t)) for k, s in enumerate(s for row in rows for s in row)
                  for p, t in enumerate(torch.cat([s.prompt, s.response])))
    assert got == want


def test_one_token_samples():
    rng = random.Random(3)
    empty_prompt = rand_sample(rng, 0, P=0, R=1)    # nothing predicts its only token
    one_one = Sample.from_row({"prompt": [5], "response": [9], "advantage": 2.0,
                               "old_logprobs": [-0.5]}, 1, "x")
    b = pack_rows([[empty_prompt, one_one, empty_prompt]], seq_len=5)
    assert b.input_ids.shape == (1, 5)
    assert b.labels[0].tolist() == [IGNORE, 9, IGNORE, IGNORE, IGNORE]
    assert b.advantages[0, 1] == 2.0 and b.old_logprobs[0, 1] == -0.5
    assert b.positions[0].tolist() == [0, 0, 1, 0, 0]
    assert b.sample_ids[0].tolist() == [0, 1, 1, 2, -1]
    assert b.row_lengths == ((1, 2, 1),)
    assert b.trained_tokens == 1 == trained_tokens(one_one) + 2 * trained_tokens(empty_prompt)


def test_sample_exactly_the_budget():
    rng = random.Random(11)
    s = rand_sample(rng, 0, P=5, R=11)
    plan = plan_step([(5, 11)], world=1, budget=16, pad_multiple=4)
    assert plan.micro_batches == (((0,),),) and plan.lengths == (16,)
    assert plan.stats.padding_tokens == 0 and plan.overlong.truncated == 0
    b = pack_rows([[s]], pad_multiple=4)
    assert b.input_ids.shape == (1, 16) and b.padding_tokens == 0
    with pytest.raises(UserError, match="17 tokens"):
        plan_step([(5, 12)], world=1, budget=16)


def test_empty_micro_batch_is_one_padding_row():
    b = pack_rows([], pad_multiple=4)
    assert b.input_ids.shape == (1, 4) and b.trained_tokens == 0 and b.useful_tokens == 0
    assert (b.sample_ids == -1).all() and b.row_lengths == ((),)
    assert pack_rows([], seq_len=8).input_ids.shape == (1, 8)


def test_row_too_long_or_misaligned():
    s = rand_sample(random.Random(0), 0, P=3, R=6)
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([[s]], seq_len=8)
    with pytest.raises(ValueError, match="multiple"):
        pack_rows([[s]], seq_len=10, pad_multiple=4)


# ---- overlong ------------------------------------------------------------------------------

SIZES = [(3, 4), (2, 30), (6, 6), (0, 13), (12, 1)]     # lengths 7, 32, 12, 13, 13


def test_overlong_error_names_the_sample():
    with pytest.raises(UserError) as e:
        fit_lengths(SIZES, 12, "error", where=lambda k: f"rollouts.jsonl:{k + 1}")
    msg = str(e.value)
    assert msg.startswith("rollouts.jsonl:2:") and "32 tokens" in msg
    assert "data.max_tokens_per_micro_batch=12" in msg and "\n" not in msg


def test_overlong_drop_counts():
    lengths, c = fit_lengths(SIZES, 12, "drop", where=str)
    assert lengths == [7, 0, 12, 0, 0]
    assert (c.dropped, c.dropped_tokens, c.truncated, c.truncated_tokens) == (3, 58, 0, 0)
    plan = plan_step(SIZES, world=2, budget=12, overlong="drop")
    assert plan.overlong == c and plan.stats.samples == 2 and plan.stats.useful_tokens == 19
    assert sorted(k for r in plan.micro_batches for mb in r for k in mb) == [0, 2]


def test_overlong_truncate_counts_and_cuts():
    with pytest.raises(UserError, match="prompt of 12 tokens"):
        fit_lengths(SIZES, 12, "truncate", where=str)
    lengths, c = fit_lengths(SIZES[:4], 12, "truncate", where=str)
    assert lengths == [7, 12, 12, 12]
    assert (c.truncated, c.truncated_tokens, c.dropped) == (2, 20 + 1, 0)
    rng = random.Random(5)
    s = rand_sample(rng, 0, P=2, R=30)
    t = s.truncated(12)
    assert len(t) == 12 and torch.equal(t.response, s.response[:10])
    full, cut = pack_rows([[s]]), pack_rows([[t]])
    # The kept prefix trains exactly as it would in the whole sample (its last label excepted:
    # it predicted a token that was cut).
    assert torch.equal(cut.labels[0, :11], full.labels[0, :11])
    assert same(cut.advantages[0, :11], full.advantages[0, :11])
    assert same(cut.old_logprobs[0, :11], full.old_logprobs[0, :11])
    assert cut.labels[0, 11] == IGNORE


def test_overlong_policy_name_checked():
    with pytest.raises(ConfigError, match="data.overlong"):
        fit_lengths(SIZES, 12, "clip", where=str)


def test_check_budget():
    check_budget(32, pad_multiple=8, longest_prompt=31)
    with pytest.raises(ConfigError, match="data.max_tokens_per_micro_batch: 30 does not divide"):
        check_budget(30, pad_multiple=4)
    with pytest.raises(ConfigError, match="longest prompt"):
        check_budget(32, longest_prompt=32)
    check_budget(32, longest_prompt=40, policy="drop")
    with pytest.raises(ConfigError, match=">= 1"):
        check_budget(0)


def test_batch_to_device_is_the_same_batch():
    """PackedBatch.to: on the host as is; to an accelerator from page-locked memory without
    blocking, the same values back (GPU only)."""
    from longmoe.data.packing import pack_rows
    from longmoe.data.sample import Sample
    g = torch.Generator().manual_seed(3)
    samples = [Sample(prompt=torch.randint(0, 50, (p,), generator=g),
                      response=torch.randint(0, 50, (r,), generator=g), advantage=0.5,
                      temperature=t, routed_experts=torch.zeros(p + r, 2, 2, dtype=torch.long)
                      if p == 4 else None)
               for p, r, t in ((3, 5, 1.0), (0, 7, 0.7), (4, 2, 1.0))]
    pb = pack_rows([samples], pad_multiple=8)
    assert pb.temperature is not None and pb.routed_experts is not None
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        moved = pb.to(dev)
        for f in pb.TOKEN_FIELDS:
            got = getattr(moved, f)
            assert got.device.type == dev, f
            torch.testing.assert_close(got.cpu(), getattr(pb, f), rtol=0, atol=0, equal_nan=True)
        assert moved.row_lengths == pb.row_lengths and moved.sample_index == pb.sample_index
