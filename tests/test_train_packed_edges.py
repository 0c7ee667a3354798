"""The edge samples of packing through the trainer's step, read from a JSONL file: a one-token
sample (an empty prompt and one response token: nothing to train), another empty prompt, a
two-token sample, a sample exactly the token budget, and ordinary ones. Packed into token-budget
micro-batches they give the loss, every parameter gradient and the next step's loss of the same
samples trained as padded rows in one forward: on one process (Gated DeltaNet + attention) and on
2 gloo ranks with EP 2 and FSDP2, and with CP 2 (each rank's zigzag share of the packed rows)."""

from __future__ import annotations

import json
import random

import pytest

from longmoe.paired.spawn import run_ranks
from test_train_packed import _compare, _rank, _run, _world1

BUDGET = 32
# Per-sample means: the one-token sample trains nothing and must count alike in both layouts.
SEQ_MEAN = {"loss_agg_mode": "seq-mean-token-mean", "entropy_coef": 0.01}


def _rows(rng):
    tok = lambda n: [rng.randrange(512) for _ in range(n)]  # noqa: E731 (tiny: vocab 512)
    sizes = [(0, 1), (0, 9), (1, 1), (5, BUDGET - 5), (4, 12), (2, 20), (6, 3), (3, 14)]
    return [{"prompt": tok(p), "response": tok(r), "advantage": rng.gauss(0, 1)}
            for p, r in sizes]


def _edge_run(tmp_path, seed, budget=None, **kw):
    """Every step trains the whole file (batch = its 8 rows), so the padded and the packed runs
    see the same samples whatever their order."""
    path = tmp_path / "edges.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in _rows(random.Random(seed))))
    run = _run(seed, budget, seq_len=BUDGET, **kw)
    for key in ("prompt_len", "group_size", "response_len"):
        del run["data"][key]
    run["data"].update(source="jsonl", path=str(path))
    return run


@pytest.mark.parametrize("preset,loss", [("tiny-hybrid", None), ("tiny", SEQ_MEAN)])
def test_edge_samples_packed_equal_padded_on_one_process(tmp_path, preset, loss):
    seed = random.randrange(2**31)
    padded = _world1(_edge_run(tmp_path, seed, preset=preset, loss=loss))
    got = _world1(_edge_run(tmp_path, seed, BUDGET, preset=preset, loss=loss))
    assert padded["micro"] == 1 and got["micro"] > 1 and all(got["packed_rows"])
    _compare([got], padded, (preset, seed))


@pytest.mark.parametrize("ep,cp", [(2, 1), (1, 2)], ids=["ep2-fsdp2", "cp2-fsdp2"])
def test_edge_samples_packed_on_two_ranks(tmp_path, ep, cp):
    seed = random.randrange(2**31)
    run = _edge_run(tmp_path, seed, BUDGET, ep=ep, cp=cp, fsdp=True)
    ranks = run_ranks(_rank, 2, run, False)
    assert all(r["micro"] >= 1 for r in ranks)
    _compare(ranks, _world1(_edge_run(tmp_path, seed)), (ep, cp, seed))
