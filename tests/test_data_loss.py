"""RL batches (synthetic GRPO groups and JSONL rows in full rows of seq_len, longmoe.data.rows)
and the policy losses against hand computations in float64."""

import json
import math
import random

import pytest
import torch

from _rows import feed_rows, rows_of
from longmoe.data.packing import IGNORE
from longmoe.data.rows import FittedFile
from longmoe.data.rule import RuleSource
from longmoe.data.validate import fit
from longmoe.errors import UserError
from longmoe.train.config import LossConfig
from longmoe.rl.objective import TokenInputs
from longmoe.train.loss import policy_loss as _policy_loss


# ---- synthetic -------------------------------------------------------------------------------

V = 37
SYN = dict(batch_size=6, seq_len=23, prompt_len=5, group_size=3)


def syn(cfg, seed, step, rank, world):
    return feed_rows(cfg, step, rank, world, vocab=V, seed=seed)[0]


def test_synthetic_deterministic_and_distinct():
    x = syn(SYN, 11, step=3, rank=1, world=2)
    y = syn(SYN, 11, step=3, rank=1, world=2)
    for f in ("input_ids", "labels", "advantages", "old_logprobs"):
        assert torch.equal(getattr(x, f).nan_to_num(7.0), getattr(y, f).nan_to_num(7.0)), f
    assert not torch.equal(x.input_ids, syn(SYN, 11, step=3, rank=0, world=2).input_ids)
    assert not torch.equal(x.input_ids, syn(SYN, 11, step=4, rank=1, world=2).input_ids)
    assert not torch.equal(x.input_ids, syn(SYN, 12, 3, 1, 2).input_ids)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("cfg", [SYN, dict(batch_size=8, seq_len=16, prompt_len=1, group_size=4)])
def test_synthetic_layout(cfg, world):
    bt = syn(cfg, random.randrange(2**31), step=random.randrange(100),
             rank=random.randrange(world), world=world)
    # data.batch_size is the global batch: each of `world` data ranks holds its share
    B, S, P, G = cfg["batch_size"] // world, cfg["seq_len"], cfg["prompt_len"], cfg["group_size"]
    assert bt.input_ids.shape == bt.labels.shape == bt.advantages.shape == bt.old_logprobs.shape == (B, S)
    assert bt.input_ids.numel() == B * S and not bt.packed
    assert bt.input_ids.dtype == bt.labels.dtype == torch.long
    assert (0 <= bt.input_ids).all() and (bt.input_ids < V).all()
    mask = bt.labels != IGNORE
    assert ((bt.labels[mask] >= 0) & (bt.labels[mask] < V)).all()
    # Prompt positions (all but the last, which predicts the first response token) are ignored;
    # every response position is trained (equal lengths).
    assert not mask[:, : P - 1].any()
    assert mask[:, P - 1:].all()
    # Labels are next tokens.
    inner = mask[:, :-1]
    assert torch.equal(bt.labels[:, :-1][inner], bt.input_ids[:, 1:][inner])
    # One prompt per group.
    prompts = bt.input_ids[:, :P].view(B // G, G, P)
    assert (prompts == prompts[:, :1]).all()
    # Advantages: constant per response, zero off the trained tokens, sum to 0 per group.
    assert (bt.advantages[~mask] == 0).all()
    per_seq = bt.advantages[:, P - 1]
    assert torch.equal(bt.advantages[mask].view(B, -1), per_seq[:, None].expand(B, S - P + 1))
    group_sum = (bt.advantages * mask).view(B // G, G * S).sum(-1)
    torch.testing.assert_close(group_sum, torch.zeros(B // G), atol=1e-4, rtol=0)
    assert per_seq.abs().max() > 0.1  # rewards vary within groups, so the check above can fail
    # Uniform rollout policy on trained tokens, NaN elsewhere.
    torch.testing.assert_close(bt.old_logprobs[mask], torch.full((int(mask.sum()),), -math.log(V)))
    assert torch.isnan(bt.old_logprobs[~mask]).all()


def _cat(batches, f):
    return torch.cat([getattr(b, f) for b in batches])


@pytest.mark.parametrize("source", ["synthetic", "jsonl"])
def test_global_batch_is_the_same_on_any_world_size(tmp_path, source):
    # Data ranks' shares, concatenated in rank order, are the world-1 batch of the same step.
    if source == "synthetic":
        cfg = dict(batch_size=12, seq_len=19, prompt_len=4, group_size=3)
        seed = random.randrange(2**31)
    else:
        rows = [{"prompt": [i % V], "response": [(i + 1) % V, (i + 2) % V], "advantage": i * 0.5}
                for i in range(17)]  # not a multiple of the batch: the source wraps around
        cfg = dict(source="jsonl", path=str(_jsonl(tmp_path, rows)), batch_size=12, seq_len=5)
        seed = 0
    batch = lambda step, r, world: feed_rows(cfg, step, r, world, vocab=V, seed=seed)[0]  # noqa: E731
    for step in (0, 3):
        whole = batch(step, 0, 1)
        assert whole.input_ids.shape[0] == 12
        for world in (2, 3, 4, 6, 12):
            parts = [batch(step, r, world) for r in range(world)]
            for f in ("input_ids", "labels", "advantages", "old_logprobs", "sample_tokens"):
                assert torch.equal(_cat(parts, f).nan_to_num(7.0),
                                   getattr(whole, f).nan_to_num(7.0)), (step, world, f)
    assert not torch.equal(batch(0, 0, 1).input_ids, batch(1, 0, 1).input_ids)
    with pytest.raises(UserError, match=r"^data\.batch_size: 12 sequences .* 5 data ranks"):
        batch(0, 0, 5)


def test_synthetic_reward_follows_rule():
    # Responses with larger advantage follow the hidden rule more often.
    cfg = dict(batch_size=16, seq_len=64, prompt_len=4, group_size=4)
    bt = syn(cfg, 5, 0, 0, 1)
    rule = RuleSource(V, 5, 4, None, 4, full_rows=(64, 16)).rule
    P = cfg["prompt_len"]
    seq = torch.cat([bt.input_ids[:, P - 1:], bt.labels[:, -1:]], dim=1)  # last prompt token + response
    follow = (rule[seq[:, :-1]] == seq[:, 1:]).double().mean(1)
    adv = bt.advantages[:, P - 1].double()
    for g in range(cfg["batch_size"] // cfg["group_size"]):
        s = slice(g * 4, g * 4 + 4)
        # Noise can coincide with the rule (prob 1/V), so compare ranks on well-separated pairs.
        a, f = adv[s], follow[s]
        hi, lo = int(a.argmax()), int(a.argmin())
        if a[hi] - a[lo] > 1.0:
            assert f[hi] > f[lo]


# ---- JSONL -----------------------------------------------------------------------------------

def _jsonl(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return p


GOOD = {"prompt": [1, 2, 3], "response": [4, 5], "advantage": 0.5}
ONE = {"prompt": [1], "response": [2, 3]}


def _rows(data: FittedFile) -> list[dict]:
    """The kept rows as trained (truncated where data.overlong cut them), as dicts."""
    out = []
    for s in data.source.get_many([int(i) for i in data.kept]):
        s = s.truncated(data.seq_len + 1)
        row = {"prompt": s.prompt.tolist(), "response": s.response.tolist(),
               "advantage": (s.advantage.tolist() if isinstance(s.advantage, torch.Tensor)
                             else s.advantage)}
        for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs"):
            if getattr(s, k) is not None:
                row[k] = getattr(s, k).tolist()
        if s.loss_mask is not None:
            row["loss_mask"] = s.loss_mask.int().tolist()
        out.append(row)
    return out


@pytest.mark.parametrize("bad,msg", [
    ('{"prompt": [1], "response": [2],', "not valid JSON"),
    ({"prompt": [1], "response": [2]}, "missing field 'advantage'"),
    ({"response": [2], "advantage": 1.0}, "missing field 'prompt'"),
    ({"prompt": [1], "response": [2, 50], "advantage": 1.0}, "response token id 50 is outside"),
    ({"prompt": [-1], "response": [2], "advantage": 1.0}, "prompt token id -1 is outside"),
    ({"prompt": [1], "response": [2.0], "advantage": 1.0}, "response must be a list of integer"),
    ({"prompt": [1], "response": [], "advantage": 1.0}, "response is empty"),
    ({"prompt": [1], "response": [2, 3], "advantage": 1.0, "old_logprobs": [-1.0]}, "old_logprobs"),
    ({"prompt": [1], "response": [2, 3], "advantage": 1.0, "loss_mask": [1, 0, 1]}, "loss_mask"),
    ({"prompt": [1], "response": [2, 3], "advantage": [1.0]}, "advantage list has 1 values"),
    ({"prompt": [1], "response": [2], "advantage": "high"}, "advantage must be a number"),
    ({"prompt": [1], "response": [2], "advantage": True}, "advantage must be a number"),
    ("[1, 2]", "expected an object"),
    # Python's json reads NaN and Infinity (strict JSON has neither); float32 overflows past 3.4e38
    ('{"prompt": [1], "response": [2, 3], "advantage": NaN}', "advantage: nan is not a finite"),
    ('{"prompt": [1], "response": [2, 3], "advantage": [0.5, -Infinity]}',
     r"advantage\[1\]: -inf is not a finite"),
    ({**ONE, "advantage": 1e39}, "advantage: 1e\\+39 is not a finite float32"),
    ({**ONE, "advantage": [1.0, None]}, r"advantage\[1\]: None is not a number"),
    ('{"prompt": [1], "response": [2, 3], "advantage": 1, "old_logprobs": [-1.0, Infinity]}',
     r"old_logprobs\[1\]: inf is not a finite"),
    ({**ONE, "advantage": 1.0, "old_logprobs": [-1.0, 0.25]}, r"old_logprobs\[1\]: 0.25 is positive"),
    ({**ONE, "advantage": 1.0, "old_logprobs": ["x", -1.0]}, r"old_logprobs\[0\]: 'x' is not a number"),
    ({**ONE, "advantage": 1.0, "loss_mask": [1, 0.5]}, r"loss_mask\[1\]: 0.5 is not 0 or 1"),
    ({**ONE, "advantage": 1.0, "loss_mask": ["1", 0]}, r"loss_mask\[0\]: '1' is not 0 or 1"),
    ({**ONE, "advantage": 1.0, "loss_mask": [2, 0]}, r"loss_mask\[0\]: 2 is not 0 or 1"),
    ({**ONE, "advantage": 1.0, "loss_mask": [1.0, -1]}, r"loss_mask\[1\]: -1 is not 0 or 1"),
    ({**ONE, "advantage": 1.0, "loss_mask": [None, 1]}, r"loss_mask\[0\]: None is not 0 or 1"),
    ('{"prompt": [1], "response": [2, 3], "advantage": 1, "reward": NaN}', "NaN is not valid JSON"),
    # seq_len 6 trains at most 7 tokens (the last response token is only a label)
    ({"prompt": [1] * 7, "response": [2], "advantage": 1.0}, "prompt: 7 tokens leave no room"),
    ({"prompt": [1] * 4, "response": [2] * 4, "advantage": 1.0},
     "response: prompt 4 \\+ response 4 tokens exceed data.seq_len=6"),
])
def test_jsonl_errors_name_line_and_field(tmp_path, bad, msg):
    # The bad row is on line 4: a blank line still counts.
    p = _jsonl(tmp_path, [GOOD, GOOD, "", bad, GOOD])
    with pytest.raises(UserError, match=msg) as ei:
        FittedFile(p, vocab_size=40, seq_len=6)
    assert str(ei.value).startswith(f"{p}:4: "), str(ei.value)
    assert "\n" not in str(ei.value)


def test_jsonl_missing_and_empty(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        FittedFile(tmp_path / "nope.jsonl", 10, 8)
    with pytest.raises(UserError, match="no rows"):
        FittedFile(_jsonl(tmp_path, ["", "  "]), 10, 8)
    data = FittedFile(_jsonl(tmp_path, [GOOD, "", GOOD]), 10, 8)
    assert _rows(data) == [GOOD, GOOD] and data.lines == [1, 3]
    assert data.counts() == {"data_rows": 2, "data_dropped": 0, "data_truncated": 0,
                             "data_masked": 0}


def test_overlong_policies(tmp_path):
    fits = {"prompt": [1, 2], "response": [3, 4, 5, 6, 7], "advantage": 1.0}   # 7 = seq_len + 1
    long = {"prompt": [1, 2], "response": [3, 4, 5, 6, 7, 8, 9], "advantage": [0.1 * i for i in range(7)],
            "old_logprobs": [-0.5] * 7, "loss_mask": [1, 1, 0, 1, 1, 1, 1]}
    no_room = {"prompt": [1] * 7, "response": [2], "advantage": 1.0}
    p = _jsonl(tmp_path, [fits, long, fits])
    with pytest.raises(UserError, match=f"^{p}:2: response: prompt 2 \\+ response 7"):
        FittedFile(p, 40, seq_len=6)  # overlong=error is the default
    drop = FittedFile(p, 40, seq_len=6, overlong="drop")
    assert _rows(drop) == [fits, fits] and drop.dropped == [2] and drop.lines == [1, 3]
    assert drop.counts()["data_dropped"] == 1 and "1 dropped (line 2)" in drop.describe()
    cut = FittedFile(p, 40, seq_len=6, overlong="truncate")
    assert cut.truncated == [False, True, False] and "1 truncated (line 2)" in cut.describe()
    row = _rows(cut)[1]
    assert row["response"] == [3, 4, 5, 6, 7] and row["loss_mask"] == [1, 1, 0, 1, 1]
    assert row["advantage"] == torch.tensor(long["advantage"][:5]).tolist()  # as float32
    assert row["old_logprobs"] == [-0.5] * 5
    # Truncation keeps every token that fits: the packed row trains response tokens 0, 1, 3, 4.
    bt, data = feed_rows(dict(source="jsonl", path=str(p), batch_size=3, seq_len=6,
                              overlong="truncate"), 0, vocab=40)
    assert data.truncated == 1 and data.masked == 0 and bt.masked == 0
    assert bt.labels[1].tolist() == [IGNORE, 3, 4, IGNORE, 6, 7]
    # A prompt with no room is an error under truncate too, and dropped under drop.
    q = _jsonl(tmp_path, [fits, no_room], name="q.jsonl")
    with pytest.raises(UserError, match=f"^{q}:2: prompt: 7 tokens leave no room"):
        FittedFile(q, 40, seq_len=6, overlong="truncate")
    assert FittedFile(q, 40, seq_len=6, overlong="drop").dropped == [2]
    with pytest.raises(UserError, match="no rows .*1 dropped"):
        FittedFile(_jsonl(tmp_path, [no_room], name="r.jsonl"), 40, seq_len=6, overlong="drop")


def test_all_masked_rows_are_counted(tmp_path):
    masked = {"prompt": [1], "response": [2, 3], "advantage": 1.0, "loss_mask": [0, 0]}
    first_only = {"prompt": [], "response": [2], "advantage": 1.0}  # token 0 has no position
    p = _jsonl(tmp_path, [GOOD, masked, first_only, GOOD])
    data = FittedFile(p, 40, seq_len=8)
    assert data.masked == [2, 3] and data.counts()["data_masked"] == 2
    assert "2 with no trained token" in data.describe()
    cfg = dict(source="jsonl", path=str(p), batch_size=4, seq_len=8)
    bt, step = feed_rows(cfg, 0, vocab=40)
    assert bt.masked == step.masked == 2 and step.truncated == 0
    assert ((bt.labels != IGNORE).sum(1) == 0).tolist() == [False, True, True, False]
    halves = [feed_rows(cfg, 0, r, 2, vocab=40)[1] for r in range(2)]
    assert [h.masked for h in halves] == [1, 1] and sum(h.masked for h in halves) == 2


def test_fit_keeps_fitting_rows_unchanged():
    row = {"prompt": [1, 2, 3], "response": [4, 5, 6], "advantage": [1.0, 2.0, 3.0]}
    for policy in ("error", "drop", "truncate"):
        assert fit(row, 5, policy, "x:1") == (row, "ok")


def test_pack_positions_advantages_mask():
    s1 = {"prompt": [7, 8, 9], "response": [11, 12, 13, 14],
          "advantage": [0.5, -1.5, 2.5, 3.5], "loss_mask": [1, 0, 1, 1],
          "old_logprobs": [-0.1, -0.2, -0.3, -0.4]}
    s2 = {"prompt": [3], "response": [21, 22], "advantage": -0.75}
    S = 10
    bt = rows_of([s1, s2], S)
    assert torch.equal(bt.input_ids[0], torch.tensor([7, 8, 9, 11, 12, 13, 14, 0, 0, 0]))
    assert torch.equal(bt.input_ids[1, :3], torch.tensor([3, 21, 22]))
    # Response token j is predicted at position len(prompt) + j - 1; j=1 is masked out.
    lab0 = torch.full((S,), IGNORE)
    lab0[[2, 4, 5]] = torch.tensor([11, 13, 14])
    assert torch.equal(bt.labels[0], lab0)
    adv0 = torch.zeros(S)
    adv0[[2, 4, 5]] = torch.tensor([0.5, 2.5, 3.5])
    assert torch.equal(bt.advantages[0], adv0)
    old0 = bt.old_logprobs[0]
    torch.testing.assert_close(old0[[2, 4, 5]], torch.tensor([-0.1, -0.3, -0.4]))
    assert torch.isnan(old0[[0, 1, 3, 6, 7, 8, 9]]).all()
    # Scalar advantage on every response token; no old_logprobs -> NaN (on-policy).
    lab1 = torch.full((S,), IGNORE)
    lab1[[0, 1]] = torch.tensor([21, 22])
    assert torch.equal(bt.labels[1], lab1)
    assert torch.equal(bt.advantages[1, :2], torch.tensor([-0.75, -0.75]))
    assert (bt.advantages[1, 2:] == 0).all()
    assert torch.isnan(bt.old_logprobs[1]).all()
    assert bt.masked == 0 and not bt.packed


def test_pack_fills_the_sequence_and_cuts_nothing():
    # seq_len + 1 tokens fit: the last response token is the last position's label only.
    s = {"prompt": [1, 2, 3], "response": [4, 5, 6], "advantage": [1.0, 2.0, 3.0]}
    bt = rows_of([s], 5)
    assert torch.equal(bt.input_ids[0], torch.tensor([1, 2, 3, 4, 5]))
    assert torch.equal(bt.labels[0], torch.tensor([IGNORE, IGNORE, 4, 5, 6]))
    assert torch.equal(bt.advantages[0], torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="does not fit seq_len=5"):
        rows_of([{**s, "response": [4, 5, 6, 7], "advantage": 1.0}], 5)


def test_jsonl_round_robin(tmp_path):
    n_rows, B, world = 7, 6, 3
    rows = [{"prompt": [i], "response": [i + 10, i + 20], "advantage": float(i)} for i in range(n_rows)]
    path = _jsonl(tmp_path, rows)
    cfg = dict(source="jsonl", path=str(path), batch_size=B, seq_len=5)
    seen = []
    n = B // world
    for step in range(3):
        for rank in range(world):
            bt = feed_rows(cfg, step, rank, world, vocab=40)[0]
            first = step * B + rank * n  # global sequence index of the rank's first row
            want = [(first + i) % n_rows for i in range(n)]
            assert bt.input_ids[:, 0].tolist() == want, (step, rank)
            assert bt.advantages[:, 0].tolist() == [float(w) for w in want]
            seen += want
    assert set(seen) == set(range(n_rows))
    # The file opened again (another rank, a resumed run) gives the same batches.
    again = FittedFile(path, 40, 5).step_rows(2, B, 1, n, 0, False)[0]
    assert torch.equal(again.input_ids, feed_rows(cfg, 2, 1, world, vocab=40)[0].input_ids)


# ---- policy loss -----------------------------------------------------------------------------

def _inputs(gen, shape=(3, 11)):
    lp = (-torch.rand(shape, generator=gen, dtype=torch.float64) * 3 - 0.05).requires_grad_(True)
    labels = torch.randint(0, 50, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.3] = IGNORE
    labels[0, 0] = 3  # at least one trained token
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    old = lp.detach() + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05
    ent = torch.rand(shape, generator=gen, dtype=torch.float64) * 4
    return lp, labels, adv, old, ent


def policy_loss(cfg, lp, ent, labels, adv, old, global_tokens):
    """The loss with token-mean weights over `global_tokens` (the trainer's default mode)."""
    weights = cfg.objective().token_weights(labels != IGNORE, global_tokens)
    return _policy_loss(cfg, lp, ent, labels, TokenInputs(adv, weights, old))


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


def _grpo_by_hand(lp, labels, adv, old, clip_low, clip_high, n):
    lp = lp.detach()
    loss, grad = 0.0, torch.zeros_like(lp)
    clipped = 0
    for idx in zip(*torch.nonzero(labels != IGNORE, as_tuple=True)):
        l, a, o = float(lp[idx]), float(adv[idx]), float(old[idx])
        r = math.exp(l - o)
        unclipped, cl = r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a
        loss -= min(unclipped, cl)
        if cl < unclipped:
            clipped += 1  # the clamp is active: no gradient
        else:
            grad[idx] = -a * r / n
    return loss / n, grad, clipped


def test_grpo_matches_hand_with_clipping(gen):
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    lp, labels, adv, old, _ = _inputs(gen)
    labels[0, :4] = 1
    with torch.no_grad():
        # Force both clipping regimes and their unclipped mirrors:
        #   r = 1.5, A > 0  -> clipped at 1.28     r = 0.5, A < 0 -> clipped at 0.8
        #   r = 1.5, A < 0  -> unclipped           r = 0.5, A > 0 -> unclipped
        for j, (r, a) in enumerate([(1.5, 2.0), (0.5, -1.5), (1.5, -0.7), (0.5, 0.9)]):
            old[0, j] = lp[0, j] - math.log(r)
            adv[0, j] = a
    n = int((labels != IGNORE).sum()) + 5  # a global count larger than this rank's
    loss, stats = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=n)
    ref, ref_grad, clipped = _grpo_by_hand(lp, labels, adv, old, 0.2, 0.28, n)
    assert math.isclose(float(loss.detach()), ref, rel_tol=1e-12, abs_tol=1e-15), gen.initial_seed()
    assert clipped >= 2 and int(stats["clip_frac"]) == clipped
    # The forced tokens contribute exactly as the clipped/unclipped formulas say.
    lpd = lp.detach()
    term = lambda j: -min(math.exp(float(lpd[0, j] - old[0, j])) * float(adv[0, j]),
                          min(max(math.exp(float(lpd[0, j] - old[0, j])), 0.8), 1.28) * float(adv[0, j]))
    assert math.isclose(term(0), -1.28 * 2.0, rel_tol=1e-12)
    assert math.isclose(term(1), 0.8 * 1.5, rel_tol=1e-12)
    assert math.isclose(term(2), 1.5 * 0.7, rel_tol=1e-12)
    assert math.isclose(term(3), -0.5 * 0.9, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, ref_grad, atol=1e-14, rtol=1e-12)
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == 0 and lp.grad[0, 2] != 0 and lp.grad[0, 3] != 0
    mask = labels != IGNORE
    assert (lp.grad[~mask] == 0).all()
    torch.testing.assert_close(stats["ratio_sum"], torch.exp(lp - old)[mask].sum().detach())


def test_grpo_nan_old_is_on_policy(gen):
    cfg = LossConfig()
    lp, labels, adv, old, _ = _inputs(gen)
    old = torch.full_like(old, float("nan"))
    old[1, 2] = float(lp.detach()[1, 2]) + 0.1  # one token with a supplied rollout log-prob
    labels[1, 2] = 4
    n = 29
    loss, stats = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=n)
    assert torch.isfinite(loss)
    mask = labels != IGNORE
    on = mask.clone()
    on[1, 2] = False
    r = math.exp(-0.1)
    a12 = float(adv[1, 2])
    ref = -(float((adv * on).sum()) + min(r * a12, min(max(r, 0.8), 1.28) * a12)) / n
    assert math.isclose(float(loss.detach()), ref, rel_tol=1e-12), gen.initial_seed()
    loss.backward()
    ref_grad = -(adv * on) / n
    ref_grad[1, 2] = -a12 * r / n  # r = 0.905 is inside the clip range
    torch.testing.assert_close(lp.grad, ref_grad, atol=1e-14, rtol=1e-12)
    assert lp.grad[on].abs().min() > 0


def test_sft(gen):
    cfg = LossConfig(type="sft")
    lp, labels, adv, old, _ = _inputs(gen)
    mask = labels != IGNORE
    loss, _ = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=17)
    assert math.isclose(float(loss.detach()), -float(lp.detach()[mask].sum()) / 17, rel_tol=1e-12)
    loss.backward()
    torch.testing.assert_close(lp.grad, -mask.double() / 17, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_entropy_bonus(gen, kind):
    lp, labels, adv, old, ent = _inputs(gen)
    mask = labels != IGNORE
    n = 23
    base, stats0 = policy_loss(LossConfig(type=kind), lp, ent, labels, adv, old, global_tokens=n)
    with_ent, stats = policy_loss(LossConfig(type=kind, entropy_coef=0.03), lp, ent, labels, adv,
                                  old, global_tokens=n)
    ent_mean = float(ent[mask].sum()) / n
    assert math.isclose(float(with_ent.detach()), float(base.detach()) - 0.03 * ent_mean, rel_tol=1e-12)
    assert math.isclose(float(stats["entropy"]), float(ent[mask].sum()), rel_tol=1e-12)
    assert math.isclose(float(stats0["entropy"]), float(ent[mask].sum()), rel_tol=1e-12)
    assert math.isclose(float(stats["logprob_sum"]), float(lp.detach()[mask].sum()), rel_tol=1e-12)
    ent_g = ent.clone().requires_grad_(True)
    loss, _ = policy_loss(LossConfig(type=kind, entropy_coef=0.03), lp, ent_g, labels, adv, old, n)
    loss.backward()
    torch.testing.assert_close(ent_g.grad, -0.03 * mask.double() / n, atol=1e-15, rtol=0)


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_global_token_normalisation(gen, kind):
    lp, labels, adv, old, _ = _inputs(gen)
    cfg = LossConfig(type=kind)
    l1, _ = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=10)
    l3, _ = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=30)
    assert float(l1.detach()) != 0
    assert math.isclose(float(l1.detach()), 3 * float(l3.detach()), rel_tol=1e-12)
    # Split the batch across two "ranks": each normalises by the global count; the sum is the
    # single-rank loss.
    n = int((labels != IGNORE).sum())
    whole, _ = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=n)
    parts = sum(float(policy_loss(cfg, lp[s], None, labels[s], adv[s], old[s], global_tokens=n)[0].detach())
                for s in (slice(0, 1), slice(1, 3)))
    assert math.isclose(parts, float(whole.detach()), rel_tol=1e-12)
    l0, _ = policy_loss(cfg, lp, None, labels, adv, old, global_tokens=0)  # clamped to 1
    assert math.isclose(float(l0.detach()), 10 * float(l1.detach()), rel_tol=1e-12)
