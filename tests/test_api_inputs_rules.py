"""The input rules every path shares: a loss mask is bool or 0/1 (integers or floats) in the API,
JSONL and Parquet alike; the normalisers a caller passes are at least the call's own counts; NaN
never means on-policy (a missing old_logprobs does), and at a trained token it is an error on
every path."""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import replace

import pytest
import torch

from longmoe.errors import UserError
from _api_samples import make_samples, run_dict


@pytest.fixture(scope="module")
def pt():
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    return PolicyTrainer(from_dict(run_dict(random.randrange(1000))))


def _expect(fn, pattern):
    with pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and re.search(pattern, msg), msg


def _grads(pt):
    return {n: p.grad.clone() for n, p in pt.model.named_parameters() if p.grad is not None}


def _drop_grads(pt):
    pt.model.zero_grad(set_to_none=True)
    pt._reset_pending()


def test_loss_mask_of_any_zero_one_dtype_trains_like_bool(pt):
    S = make_samples(3, 5)
    mask = S[3].loss_mask
    assert mask is not None and mask.dtype == torch.bool and not mask.all() and mask.any()
    ref = pt.forward_backward(S)
    g_ref = _grads(pt)
    _drop_grads(pt)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.float32, torch.float64):
        T = list(S)
        T[3] = replace(S[3], loss_mask=mask.to(dtype))
        assert pt.counts(T) == pt.counts(S)
        got = pt.forward_backward(T)
        assert got["loss"] == ref["loss"] and got["tokens"] == ref["tokens"], dtype
        g = _grads(pt)
        assert g.keys() == g_ref.keys()
        for n in g:
            assert torch.equal(g[n], g_ref[n]), (dtype, n)
        _drop_grads(pt)


@pytest.mark.parametrize("value", [0.5, 2, -1, float("nan")])
def test_loss_mask_values_other_than_zero_one_name_sample_and_field(pt, value):
    S = make_samples(4, 4)
    R = S[2].response.numel()
    m = torch.ones(R, dtype=torch.float32 if isinstance(value, float) else torch.int64)
    m[R - 1] = value
    T = list(S)
    T[2] = replace(S[2], loss_mask=m)
    for fn in (lambda: pt.forward_backward(T), lambda: pt.counts(T)):
        _expect(fn, rf"samples\[2\] \(draw 2\): loss_mask\[{R - 1}\]: .* is not 0 or 1")
    # compute_logprobs reads no training field: the mask does not matter there
    assert len(pt.compute_logprobs(T)) == len(T)


def test_normalisers_below_the_calls_own_counts_are_errors(pt):
    from longmoe.api.batches import plan_call, rank_step_data
    S = make_samples(5, 6)
    c = pt.counts(S)
    assert c["tokens"] > 3 and c["samples"] > 1
    _expect(lambda: pt.forward_backward(S, num_tokens=3),
            rf"^forward_backward: num_tokens=3 is below this call's own {c['tokens']} trained "
            rf"tokens")
    _expect(lambda: pt.forward_backward(S, num_samples=c["samples"] - 1),
            rf"^forward_backward: num_samples={c['samples'] - 1} is below this call's own "
            rf"{c['samples']} samples")
    # A StepData (the CLI's path) is held to the same rule.
    data = rank_step_data(pt.run, plan_call(pt.run, S, 1, pt.crossover, "t"), 0)
    _expect(lambda: pt.forward_backward(data, num_tokens=c["tokens"] - 1),
            r"num_tokens=\d+ is below this call's own")
    one = pt.forward_backward(S, num_tokens=c["tokens"], num_samples=c["samples"])
    half = pt.forward_backward(S, num_tokens=2 * c["tokens"], num_samples=2 * c["samples"])
    assert half["loss"] == pytest.approx(one["loss"] / 2, rel=1e-5)
    assert pt._calls == 2
    _drop_grads(pt)


def test_nan_old_logprobs_are_never_on_policy(pt):
    """On-policy is old_logprobs=None (ratio 1); a NaN at a trained token is an error whose
    message says so; a NaN where nothing trains is never read."""
    S = make_samples(6, 3)
    s = S[0]
    R = s.response.numel()
    assert s.prompt_len > 0 and R >= 2 and s.loss_mask is None
    on = replace(s, old_logprobs=None)
    stats = pt.forward_backward([on])
    assert stats["ratio"] == pytest.approx(1.0, abs=1e-6)
    _drop_grads(pt)
    old = s.old_logprobs.clone()
    old[R - 1] = float("nan")
    _expect(lambda: pt.forward_backward([replace(s, old_logprobs=old)]),
            rf"^forward_backward: samples\[0\] \(draw 0\): old_logprobs\[{R - 1}\]: nan is not "
            rf"finite \(a trained token needs a log-probability; on-policy is "
            rf"old_logprobs=None\)")
    mask = torch.ones(R, dtype=torch.int64)
    mask[R - 1] = 0
    finite = pt.forward_backward([replace(s, loss_mask=mask)])
    _drop_grads(pt)
    masked = pt.forward_backward([replace(s, old_logprobs=old, loss_mask=mask)])
    _drop_grads(pt)
    assert masked["loss"] == finite["loss"] and math.isfinite(masked["loss"])


# ---- the file paths: the same mask values, and no NaN log-prob -------------------------------

ROW = {"prompt": [1, 2], "response": [3, 4, 5], "advantage": 0.5,
       "old_logprobs": [-1.0, -2.0, -0.5]}


@pytest.mark.parametrize("mask", [[True, False, True], [1, 0, 1], [1.0, 0.0, 1.0]])
def test_files_accept_the_masks_the_api_accepts(tmp_path, mask):
    from longmoe.data.rows import FittedFile, full_rows
    from longmoe.data.sources import JsonlSource
    from longmoe.data.validate import check_sample
    p = tmp_path / "r.jsonl"
    p.write_text(json.dumps({**ROW, "loss_mask": mask}) + "\n")
    src = JsonlSource(p, lambda row, where: check_sample(row, where, 40))
    assert src.get_many([0])[0].loss_mask.tolist() == [True, False, True]
    data = FittedFile(p, vocab_size=40, seq_len=8)   # the rows way (no token budget)
    assert data.counts()["data_rows"] == 1 and data.masked == []
    labels = full_rows(data.source, data.kept, 8).labels[0]
    assert labels[1:4].tolist() == [3, -100, 5]  # response tokens 0 and 2 trained


def test_parquet_bool_mask_column_loads(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from longmoe.data.sources import ParquetSource
    from longmoe.data.validate import check_sample
    table = pa.table({"prompt": [[1, 2]], "response": [[3, 4, 5]], "advantage": [0.5],
                      "loss_mask": pa.array([[True, False, True]], pa.list_(pa.bool_()))})
    pq.write_table(table, tmp_path / "r.parquet")
    src = ParquetSource(tmp_path / "r.parquet", lambda row, where: check_sample(row, where, 40))
    assert src.get_many([0])[0].loss_mask.tolist() == [True, False, True]


def test_files_reject_nan_log_probs(tmp_path):
    from longmoe.data.validate import parse_sample
    line = json.dumps({**ROW, "loss_mask": [1, 1, 0]}).replace("-0.5", "NaN")
    _expect(lambda: parse_sample(line, "r.jsonl:1", 40), r"^r.jsonl:1: old_logprobs\[2\]: nan is "
                                                         r"not a finite")
