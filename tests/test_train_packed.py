"""Token-budget micro-batches through the trainer's step (longmoe.train.feed + step.accumulate): a
step planned into several packed micro-batches, with each micro-batch's loss normalised by the
whole step's trained tokens, gives the loss and every parameter gradient of the same global
batch trained as padded rows in one forward; so does one sample per padded micro-batch. After
one optimizer step the next step's loss agrees too (plain SGD: AdamW's first step is about the
sign of each gradient element, which float rounding flips where an element is near zero; at lr
0.2: at 0.5 one seed's hybrid run agreed in every gradient but differed by 2e-3 in the next
loss, a step that large turning rounding differences into discrete ones such as a flipped top-k
choice between near-tied experts).
Layouts: one process; 2 gloo ranks with EP 2 and FSDP2 (which reduces gradients once per step:
its reduce-scatters are counted); CP 2 over hybrid layers; a rank with an empty micro-batch. The
MoE balance loss is off: it is measured per micro-batch, so it is not additive over tokens
(docs/packing.md)."""

from __future__ import annotations

import random

import pytest
import torch

from longmoe.paired.dist_cases import _grads_by_name
from longmoe.paired.harness import TOLERANCE, rel_err
from longmoe.paired.spawn import run_ranks

TOL = 5 * TOLERANCE[torch.float32]


def _run(seed, budget=None, packing=True, ep=1, cp=1, fsdp=False, preset="tiny", batch=8,
         seq_len=48, resp="uniform:1:40", prompt=6, recompute="full", loss=None):
    return {"loss": loss or {},"model": {"preset": preset, "num_layers": 4 if preset == "tiny-hybrid" else 2,
                      "router_aux_loss_coef": 0.0, "init_std": 0.1},
            "parallel": {"ep": ep, "cp": cp, "fsdp": fsdp, "recompute": recompute, "chunks": 1},
            "impl": {"linear_ce": "chunked", "ce_chunk_tokens": 40},
            "data": {"batch_size": batch, "seq_len": seq_len, "prompt_len": prompt,
                     "group_size": 2, "response_len": resp, "max_tokens_per_micro_batch": budget,
                     "packing": packing},
            "train": {"seed": seed}}


def _train(run_dict, layout, device, count_reduce_scatters=False):
    """Two steps of the trainer's step on `layout`: step 0's loss and gradients, the plan, and
    step 1's loss after SGD applied step 0's gradients."""
    from longmoe.train.config import from_dict
    from longmoe.train.feed import Feed
    from longmoe.train.setup import build_model
    from longmoe.train.step import accumulate, step_counts
    run = from_dict(run_dict)
    model = build_model(run, layout, device)
    calls = _count_reduce_scatters(model) if count_reduce_scatters else None
    feed = Feed(run, layout.data_rank, layout.data_world)
    optim = torch.optim.SGD(model.parameters(), lr=0.2)
    out = {}
    for step in range(2):
        data = feed.step(step)
        n, samples = step_counts(data.trained_tokens, data.trained_samples, layout, device)
        loss, aux, _ = accumulate(model, data.micro, run, layout, n, device, samples)
        if step == 0:
            out.update(loss=float(loss), grads=_grads_by_name(model), micro=len(data.micro),
                       empty=data.plan.empty_micro_batches if data.plan else 0,
                       reduce_scatters=list(calls) if calls is not None else None,
                       packed_rows=[m.packed for m in data.micro])
            optim.step()
            optim.zero_grad(set_to_none=True)
        else:
            out["loss1"] = float(loss)
    out["ep"] = layout.ep
    return out


def _count_reduce_scatters(model) -> list:
    """Counts FSDP2's gradient reduce-scatters per step, through its public custom-collective
    hook (the collective itself still runs)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    calls = []

    class Counting(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    from longmoe.model.moe import GroupedExperts
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_custom_reduce_scatter(Counting())
    # First entry: the units that reduce in one synced backward. With EP over the whole world
    # the experts' mesh has one rank: nothing to reduce-scatter there.
    calls.append(sum(not isinstance(m, GroupedExperts) for m in units))
    return calls


def _rank(rank, world, backend, run_dict, count):
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import from_dict
    run = from_dict(run_dict)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    return _train(run_dict, layout, backend.device(rank), count)


def _world1(run_dict):
    from longmoe.parallel.mesh import Layout
    return _train(run_dict, Layout(1, 0, 1, None, None, None), torch.device("cpu"))


def _compare(got_ranks, ref, what):
    scale = max(abs(ref["loss"]), 1e-3)
    assert abs(sum(r["loss"] for r in got_ranks) - ref["loss"]) / scale < TOL, what
    ep = got_ranks[0]["ep"]
    assert len(ref["grads"]) > 10
    for name, g_ref in ref["grads"].items():
        if ".experts." in name and ep > 1:     # each EP rank holds its slice of the experts
            got = torch.cat([got_ranks[i]["grads"][name] for i in range(ep)])
        else:
            got = got_ranks[0]["grads"][name]
        assert rel_err(got, g_ref) < TOL, (what, name)
    assert abs(sum(r["loss1"] for r in got_ranks) - ref["loss1"]) / scale < TOL, what


# The RL objective per sample: each sample's mean over its tokens, then the mean over the step's
# samples (counted over every micro-batch), with a KL term and an entropy bonus.
SEQ_MEAN = {"loss_agg_mode": "seq-mean-token-mean", "kl_coef": 0.1, "entropy_coef": 0.01}


# 64 tokens: several packed micro-batches; 1024: every sample in one row (one micro-batch);
# packing off: one sample per micro-batch, padded to the budget.
@pytest.mark.parametrize("preset,budget,packing,loss", [
    ("tiny", 64, True, None), ("tiny", 1024, True, None), ("tiny", 48, False, None),
    ("tiny-hybrid", 64, True, None), ("tiny", 64, True, SEQ_MEAN)])
def test_packed_micro_batches_equal_padded_rows_on_one_process(preset, budget, packing, loss):
    seed = random.randrange(2**31)
    padded = _world1(_run(seed, preset=preset, loss=loss))
    assert padded["micro"] == 1
    got = _world1(_run(seed, budget, packing, preset=preset, loss=loss))
    assert (got["micro"] == 1) == (budget == 1024), got["micro"]
    assert all(p == packing for p in got["packed_rows"])
    _compare([got], padded, (preset, budget, packing, seed))


def test_packed_micro_batches_with_ep2_fsdp2_reduce_once_per_step():
    seed = random.randrange(2**31)
    run = _run(seed, 64, ep=2, fsdp=True, batch=12)
    ranks = run_ranks(_rank, 2, run, True)
    assert ranks[0]["micro"] > 1 and ranks[0]["micro"] == ranks[1]["micro"]
    for r in ranks:
        units, calls = r["reduce_scatters"][0], r["reduce_scatters"][1:]
        # once per step: one reduce-scatter per unit, not one per unit and micro-batch
        assert units > 2 and len(calls) == units, (units, len(calls), r["micro"])
    _compare(ranks, _world1(_run(seed, batch=12)), seed)


@pytest.mark.parametrize("nproc,grad_sync", [(1, "step"), (2, "micro_batch")])
def test_fsdp_reducing_after_every_micro_batch(nproc, grad_sync):
    # One FSDP rank (nothing to save by deferring) and parallel.grad_sync=micro_batch reduce
    # after each micro-batch into sharded gradients that accumulate: the same step.
    seed = random.randrange(2**31)
    run = _run(seed, 64, ep=nproc, fsdp=True, batch=8)
    run["parallel"]["grad_sync"] = grad_sync
    ranks = run_ranks(_rank, nproc, run, True)
    units, calls = ranks[0]["reduce_scatters"][0], ranks[0]["reduce_scatters"][1:]
    if nproc > 1:
        assert len(calls) == units * ranks[0]["micro"]
    _compare(ranks, _world1(_run(seed, batch=8)), seed)


def test_packed_context_parallel_over_hybrid_layers():
    seed = random.randrange(2**31)
    # Rows padded to a multiple of 2*cp = 4 and at least 12 tokens (the conv history per piece).
    run = _run(seed, 64, cp=2, fsdp=True, preset="tiny-hybrid", batch=6)
    ranks = run_ranks(_rank, 2, run, False)
    assert ranks[0]["micro"] > 1
    _compare(ranks, _world1(_run(seed, preset="tiny-hybrid", batch=6)), seed)


def test_a_rank_with_an_empty_micro_batch():
    seed = random.randrange(2**31)
    # Three samples of the budget's length on two ranks: two micro-batches each, one of the four
    # empty (a row of padding that trains nothing but joins the collectives).
    run = _run(seed, 32, ep=2, fsdp=True, batch=3, seq_len=32, resp="fixed:26")
    ranks = run_ranks(_rank, 2, run, False)
    assert [r["micro"] for r in ranks] == [2, 2] and ranks[0]["empty"] == 1
    _compare(ranks, _world1(_run(seed, batch=3, seq_len=32, resp="fixed:26")), seed)


def test_packed_training_on_the_rule_task_lowers_the_loss():
    # Log-normal response lengths packed into micro-batches: the surrogate starts near 0
    # (token-weighted group advantages) and falls as the policy learns the hidden rule.
    from longmoe.parallel.mesh import Layout
    from longmoe.train.config import from_dict
    from longmoe.train.feed import Feed
    from longmoe.train.setup import build_model
    from longmoe.train.step import accumulate, step_counts
    seed = random.randrange(2**31)
    run_dict = _run(seed, 512, batch=16, resp="lognormal:48:200", recompute="none")
    run_dict["data"]["group_size"] = 4
    del run_dict["model"]["init_std"]   # the default: a near-uniform policy, ratios near 1
    run = from_dict(run_dict)
    layout, dev = Layout(1, 0, 1, None, None, None), torch.device("cpu")
    model = build_model(run, layout, dev)
    feed = Feed(run, 0, 1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    losses, micro = [], []
    for step in range(12):
        data = feed.step(step)
        micro.append(len(data.micro))
        n, samples = step_counts(data.trained_tokens, data.trained_samples, layout, dev)
        loss, _, _ = accumulate(model, data.micro, run, layout, n, dev, samples)
        losses.append(float(loss))
        optim.step()
        optim.zero_grad(set_to_none=True)
    assert max(micro) > 1
    assert abs(losses[0]) < 0.02, losses
    assert sum(losses[-4:]) / 4 < losses[0] - 0.01, (seed, losses)


def test_file_source_epochs_shuffle_and_resume(tmp_path):
    # data.shuffle: every epoch visits each row once in its own order; a step is a function of
    # (seed, step) alone, so a fresh feed (a resumed run) trains exactly what the first did.
    import json

    from longmoe.train.config import from_dict
    from longmoe.train.feed import Feed
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": [1, i], "response": [2] * (3 + i % 4),
                                        "advantage": 0.1 * i}) + "\n" for i in range(10)))

    def feed(shuffle):
        return Feed(from_dict({"model": {"preset": "tiny"},
                               "data": {"source": "jsonl", "path": str(path), "batch_size": 4,
                                        "max_tokens_per_micro_batch": 16, "shuffle": shuffle},
                               "train": {"seed": 3}}), 0, 1)

    def indices(f, step):
        return sorted(i for m in f.step(step).micro for row in m.sample_index for i in row)

    f = feed(True)
    steps = [indices(f, s) for s in range(5)]
    assert len(set(steps[0] + steps[1])) == 8               # epoch 0, no repeat
    assert sorted(sum(steps, [])) == sorted(list(range(10)) * 2)
    assert sum(steps, []) != sorted(sum(steps, []))
    again = feed(True).step(3)
    first = f.step(3)
    assert [m.sample_index for m in again.micro] == \
        [m.sample_index for m in first.micro]
    assert all(torch.equal(a.input_ids, b.input_ids)
               for a, b in zip(again.micro, first.micro))
    assert indices(feed(False), 0) == [0, 1, 2, 3] and indices(feed(False), 3) == [2, 3, 4, 5]
    # A synthetic pool the size of the batch: every step trains the same samples.
    pool = Feed(from_dict({"model": {"preset": "tiny"},
                           "data": {"batch_size": 6, "num_samples": 6, "prompt_len": 4,
                                    "response_len": "uniform:1:9",
                                    "max_tokens_per_micro_batch": 16}}), 0, 1)
    a, b = pool.step(0), pool.step(5)
    assert indices(pool, 0) == list(range(6))
    assert [m.sample_index for m in a.micro] == [m.sample_index for m in b.micro]
