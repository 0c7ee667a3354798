"""The step plan: every rank the same micro-batch count and a similar cost, deterministic on
every rank; its statistics; the gradient-accumulation normalisation."""

import os
import random
import subprocess
import sys

import pytest
import torch

from longmoe.data.balance import attention_crossover, plan_step, sample_cost
from longmoe.data.normalise import micro_batch_scale, packed_trained_tokens, step_trained_tokens
from longmoe.data.packing import IGNORE, pack_rows
from longmoe.data.pipeline import global_trained_tokens, plan_for_step, rank_micro_batches
from longmoe.data.sample import Sample
from longmoe.data.synthetic import SyntheticSource

V = 61
BUDGET, CROSS = 16384, 16384.0


def lognormal_sizes(seed, n=128):
    src = SyntheticSource(V, seed, "uniform:16:256", "lognormal:1500:16000", group_size=8)
    return [src.sizes(i) for i in range(n)]


def naive(sizes, world, budget, crossover):
    """Round-robin ranks, then first-fit micro-batches in batch order on each rank."""
    cost = [sample_cost(p + r, crossover) for p, r in sizes]
    per_rank = []
    for w in range(world):
        mbs, used = [], []
        for k in range(w, len(sizes), world):
            n = sum(sizes[k])
            b = next((b for b in range(len(mbs)) if used[b] + n <= budget), None)
            if b is None:
                mbs.append([]), used.append(0)
                b = len(mbs) - 1
            mbs[b].append(k)
            used[b] += n
        per_rank.append([sum(cost[k] for k in mb) for mb in mbs])
    M = max(map(len, per_rank))
    per_rank = [c + [0.0] * (M - len(c)) for c in per_rank]
    totals = [sum(c) for c in per_rank]
    lockstep = sum(max(c[j] for c in per_rank) for j in range(M)) * world / sum(totals)
    return max(totals) / min(totals), lockstep


def check_plan(plan, sizes, world, budget):
    M = len(plan.micro_batches[0])
    assert all(len(r) == M for r in plan.micro_batches) and len(plan.micro_batches) == world
    placed = [k for r in plan.micro_batches for mb in r for k in mb]
    assert sorted(placed) == [k for k, n in enumerate(plan.lengths) if n > 0]
    for r in plan.micro_batches:
        for mb in r:
            assert sum(plan.lengths[k] for k in mb) <= budget and list(mb) == sorted(mb)
    assert plan.stats.micro_batches == M


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world", [2, 4])
def test_balance_beats_round_robin(seed, world):
    sizes = lognormal_sizes(seed)
    plan = plan_step(sizes, world, BUDGET, crossover=CROSS)
    check_plan(plan, sizes, world, BUDGET)
    rr_ratio, rr_lockstep = naive(sizes, world, BUDGET, CROSS)
    costs = plan.stats.rank_costs
    assert max(costs) / min(costs) < min(rr_ratio, 1.35)
    assert plan.stats.lockstep_imbalance < min(rr_lockstep, 1.15)
    # as few micro-batches as the tokens allow, or one more
    lower = -(-sum(map(sum, sizes)) // BUDGET)
    assert plan.stats.micro_batches <= -(-lower // world) + 1


def test_one_rank_fills_micro_batches():
    sizes = lognormal_sizes(11, n=64)
    plan = plan_step(sizes, 1, BUDGET, crossover=CROSS)
    check_plan(plan, sizes, 1, BUDGET)
    assert plan.stats.rank_cost_imbalance == 1.0 == plan.stats.lockstep_imbalance
    assert plan.stats.micro_batches <= -(-sum(map(sum, sizes)) // BUDGET) + 1


def test_plan_is_deterministic_across_processes():
    sizes = lognormal_sizes(3)
    here = plan_step(sizes, 4, BUDGET, crossover=CROSS).micro_batches
    assert plan_step(list(sizes), 4, BUDGET, crossover=CROSS).micro_batches == here
    code = ("import sys, json; from longmoe.data.balance import plan_step; "
            "s=[tuple(x) for x in json.loads(sys.argv[1])]; "
            f"print(json.dumps(plan_step(s, 4, {BUDGET}, crossover={CROSS}).micro_batches))")
    import json
    out = subprocess.run([sys.executable, "-c", code, json.dumps(sizes)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert json.loads(out.stdout) == json.loads(json.dumps(here))


def test_fewer_samples_than_micro_batches():
    plan = plan_step([(2, 5), (1, 9), (0, 3)], world=4, budget=16)
    check_plan(plan, None, 4, 16)
    assert plan.stats.micro_batches == 1 and plan.stats.empty_micro_batches == 1
    assert sum(1 for r in plan.micro_batches if not r[0]) == 1


def test_cost_model():
    assert sample_cost(1000, 1000.0) == 2000.0
    assert sample_cost(10, 65536.0) == pytest.approx(10.0015, abs=1e-4)
    # attention's L^2/2 pairs at 4*N*D a pair equal L * per-token FLOPs at L = crossover
    per_token, pair = 6.0e9, 4 * 16 * 256 * 10
    L = attention_crossover(per_token, pair)
    assert L * L / 2 * pair == pytest.approx(L * per_token)


# ---- the step pipeline and its statistics ---------------------------------------------------

class ListSource:
    """An in-memory source of given samples."""
    def __init__(self, samples):
        self.samples, self.num_samples = samples, len(samples)

    def sizes(self, i):
        return self.samples[i].prompt_len, self.samples[i].response.numel()

    def where(self, i):
        return f"list sample {i}"

    def get_many(self, idx):
        return [self.samples[i] for i in idx]


def rand_samples(rng, n, max_p=6, max_r=40):
    out = []
    for i in range(n):
        P, R = rng.randrange(0, max_p), rng.randrange(1, max_r)
        row = {"prompt": [rng.randrange(V) for _ in range(P)],
               "response": [rng.randrange(V) for _ in range(R)],
               "advantage": [rng.gauss(0, 1) for _ in range(R)] if i % 2 else rng.gauss(0, 1),
               "old_logprobs": [-rng.random() for _ in range(R)]}
        if rng.random() < 0.5:
            row["loss_mask"] = [int(rng.random() < 0.7) for _ in range(R)]
        out.append(Sample.from_row(row, i, f"list sample {i}"))
    return out


@pytest.mark.parametrize("fixed_len", [False, True])
def test_stats_match_packed_batches(fixed_len):
    rng = random.Random(21)
    src = ListSource(rand_samples(rng, 30))
    batch = plan_for_step(src, step=2, global_batch=12, world=3, budget=32, seed=5,
                          overlong="truncate", pad_multiple=4, fixed_len=fixed_len)
    st = batch.plan.stats
    packed = [list(rank_micro_batches(src, batch, r)) for r in range(3)]
    assert all(len(p) == st.micro_batches for p in packed)
    useful = sum(b.useful_tokens for p in packed for b in p)
    pad = sum(b.padding_tokens for p in packed for b in p)
    assert (st.useful_tokens, st.padding_tokens) == (useful, pad)
    assert st.padding_share == pytest.approx(pad / (useful + pad))
    assert all(b.input_ids.shape[1] % 4 == 0 and b.input_ids.shape[1] <= 32 for p in packed for b in p)
    if fixed_len:
        assert all(b.input_ids.shape == (1, 32) for p in packed for b in p)
    assert batch.plan.overlong.truncated == sum(1 for i in batch.indices if len(src.samples[i]) > 32)


def test_accumulated_gradient_equals_one_big_batch():
    torch.manual_seed(0)
    rng = random.Random(22)
    src = ListSource(rand_samples(rng, 40, max_r=30))
    world = 3
    batch = plan_for_step(src, step=1, global_batch=24, world=world, budget=24, seed=2,
                          overlong="truncate", pad_multiple=2)
    emb = torch.nn.Embedding(V, 8, dtype=torch.float64)
    head = torch.nn.Linear(8, V, dtype=torch.float64)
    params = [*emb.parameters(), *head.parameters()]

    def token_loss_sum(b):
        logp = torch.log_softmax(head(emb(b.input_ids)), -1)
        m = b.labels != IGNORE
        lp = logp.gather(-1, b.labels.clamp(min=0)[..., None])[..., 0]
        return -(b.advantages.double() * lp * m).sum(), int(m.sum())

    def grads():
        g = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        return g

    # one big batch: every trained sample of the step in its own row, mean over trained tokens
    trained = [s.truncated(batch.plan.lengths[k]) for k, s in
               enumerate(src.get_many(batch.indices)) if batch.plan.lengths[k] > 0]
    loss, n_big = token_loss_sum(pack_rows([[s] for s in trained]))
    (loss / n_big).backward()
    want = grads()

    N = global_trained_tokens(src, batch)
    per_rank = [list(rank_micro_batches(src, batch, r)) for r in range(world)]
    assert N == n_big == step_trained_tokens(trained) == sum(packed_trained_tokens(p) for p in per_rank)
    assert sum(len(p) for p in per_rank) > world     # several micro-batches per rank
    for p in per_rank:          # ranks' gradients summed, as the data-parallel reduction does
        for b in p:
            (token_loss_sum(b)[0] * micro_batch_scale(N)).backward()
    for a, b in zip(grads(), want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)

    # the per-micro-batch mean (then averaged) is a different, token-reweighted gradient
    mbs = [b for p in per_rank for b in p]
    for b in mbs:
        s, n = token_loss_sum(b)
        if n:
            (s / n / len(mbs)).backward()
    assert not all(torch.allclose(a, b) for a, b in zip(grads(), want))
    assert micro_batch_scale(0) == 0.0
