"""Router replay from files: a JSONL line's or Parquet row's `routed_experts` ([tokens][layers]
[top_k] integers, -1 rows left to the router) becomes the sample's int16 routes, checked when the
file is opened (one line naming the file, the row and the field), and `longmoe train`'s data path
replays them: its step's loss is PolicyTrainer.forward_backward's on the same samples with the
same routes, and not the loss without them."""

from __future__ import annotations

import dataclasses
import json
import re
from types import SimpleNamespace

import pytest
import torch

from longmoe.data.sample import Sample
from longmoe.data.sources import JsonlSource, ParquetSource
from longmoe.data.validate import check_sample
from longmoe.errors import UserError

from _api_samples import make_samples, run_dict
from test_router_replay import foreign_routes

DIMS = (2, 2, 8)      # run_dict's tiny model: MoE layers, top_k, experts
V = 512


def _trainer(d):
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    return PolicyTrainer(from_dict(d))


def _row(s: Sample, routes: bool = True) -> dict:
    row = {"prompt": s.prompt.tolist(), "response": s.response.tolist(),
           "advantage": s.advantage.tolist() if isinstance(s.advantage, torch.Tensor)
           else s.advantage}
    for f in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "loss_mask"):
        if getattr(s, f) is not None:
            row[f] = getattr(s, f).tolist()
    if routes and s.routed_experts is not None:
        row["routed_experts"] = s.routed_experts.tolist()
    return row


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path, rows, row_group_size=3, width=None):
    import pyarrow as pa
    import pyarrow.parquet as pq
    keys = ["prompt", "response", "advantage", "old_logprobs", "ref_logprobs",
            "rollout_logprobs", "loss_mask", "routed_experts"]
    cols = {k: [r.get(k) for r in rows] for k in keys if any(k in r for r in rows)}
    types = {"routed_experts": pa.list_(pa.list_(pa.list_(width or pa.int16())))}
    adv = cols.pop("advantage")   # a number or a list per row: one column type, as a list
    table = pa.table({**{k: pa.array(v, type=types.get(k)) for k, v in cols.items()},
                      "advantage": pa.array([a if isinstance(a, list) else [a] * len(r["response"])
                                             for a, r in zip(adv, rows)])})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def _samples(n=6, seed=11):
    """make_samples with another router's experts for every token, and a few tokens left to the
    trainer's router (-1 rows)."""
    L, K, E = DIMS
    pt = SimpleNamespace(run=SimpleNamespace(model=SimpleNamespace(num_layers=L, top_k=K,
                                                                   num_experts=E)))
    out = []
    for i, s in enumerate(make_samples(seed, n)):
        r = foreign_routes(pt, s, 100 + i)
        r[::5] = -1
        out.append(dataclasses.replace(s, routed_experts=r))
    return out


def _check(row, where):
    check_sample(row, where, V, None, DIMS)


def test_jsonl_and_parquet_give_the_same_samples(tmp_path):
    samples = _samples()
    rows = [_row(s, routes=i != 2) for i, s in enumerate(samples)]   # row 2: no routes
    js = JsonlSource(_write_jsonl(tmp_path / "r.jsonl", rows), _check)
    pq_src = ParquetSource(_write_parquet(tmp_path / "r.parquet", rows), _check)
    order = [4, 0, 5, 2, 1, 3]
    for a, b, i in zip(js.get_many(order), pq_src.get_many(order), order):
        if i == 2:
            assert a.routed_experts is None and b.routed_experts is None
            continue
        assert a.routed_experts.dtype == b.routed_experts.dtype == torch.int16
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert torch.equal(a.routed_experts.long(), samples[i].routed_experts)
        for f in ("prompt", "response", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    # truncation keeps the routes of the tokens kept
    s = js.get(0)
    assert torch.equal(s.truncated(len(s) - 1).routed_experts, s.routed_experts[:-1])


def _feed_loss(pt, d, path, source):
    """The loss of step 0 as `longmoe train` computes it (longmoe.train.trainer.train): its Feed
    (the file opened and checked as the launcher does) hands the step's micro-batches to
    PolicyTrainer.forward_backward. Losses only: pt's parameters never change."""
    from longmoe.train.config import from_dict
    from longmoe.train.feed import Feed, check_data
    d = {**d, "data": {**d["data"], "source": source, "path": str(path)}}
    run = from_dict(d)
    check_data(run)
    return pt.forward_backward(Feed(run, 0, 1).step(0))["loss"]


@pytest.mark.parametrize("source,budget", [("jsonl", 32), ("parquet", 32), ("jsonl", None)])
def test_train_data_path_replays_file_routes(tmp_path, source, budget):
    """One step through the CLI trainer's data path (token-budget micro-batches, or full rows of
    data.seq_len for JSONL without a budget) on a file with another router's routes: the loss
    of forward_backward on the same samples with the same routes; without them, another."""
    samples = _samples()
    d = run_dict(4, budget=budget)
    d["data"].update({"batch_size": len(samples), "seq_len": 32, "prompt_len": 4,
                      "shuffle": False})
    write = _write_jsonl if source == "jsonl" else _write_parquet
    with_routes = write(tmp_path / f"r.{source}", [_row(s) for s in samples])
    without = write(tmp_path / f"n.{source}", [_row(s, routes=False) for s in samples])
    pt = _trainer(d)
    got = _feed_loss(pt, d, with_routes, source)
    plain = _feed_loss(pt, d, without, source)
    want = pt.forward_backward(samples)["loss"]
    want_plain = pt.forward_backward(
        [dataclasses.replace(s, routed_experts=None) for s in samples])["loss"]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert plain == pytest.approx(want_plain, rel=1e-5, abs=1e-7)
    assert abs(got - plain) > 1e-4 * max(1.0, abs(plain))   # the routes changed the forward


def _bad(rows, k, fn):
    rows = [dict(r) for r in rows]
    rows[k]["routed_experts"] = fn(torch.tensor(rows[k]["routed_experts"])).tolist()
    return rows


BAD = {  # id -> (change to row 3's routes, what the one line says after "routed_experts")
    "one_token_short": (lambda r: r[:-1], r": shape \[\d+, 2, 2\] is not \[\d+, 2, 2\]"),
    "layers": (lambda r: r[:, :1], r": shape \[\d+, 1, 2\] is not"),
    "top_k": (lambda r: r[..., :1], r": shape \[\d+, 2, 1\] is not"),
    "expert_out_of_range": (lambda r: r.index_fill(0, torch.tensor([1]), 8),
                            r"\[1, 0, 0\]: 8 is not an expert id in \[0, 8\) or -1"),
    "below_minus_one": (lambda r: r.index_fill(0, torch.tensor([2]), -2),
                        r"\[2, 0, 0\]: -2 is not an expert id"),
    "beyond_int16": (lambda r: r.index_fill(0, torch.tensor([1]), 70000),
                     r"\[1, 0, 0\]: 70000 is not an expert id"),
    "half_minus_one": (lambda r: torch.cat([r[..., :1], torch.full_like(r[..., :1], -1)], -1),
                       r"\[0, 0\]: a token's experts are all ids or all -1"),
    "repeated_expert": (lambda r: r[..., :1].expand(-1, -1, 2).clamp(min=0),
                        r"\[0, 0\]: \[\d, \d\] repeats an expert"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_routes_in_row_k_are_refused_naming_row_k(tmp_path, case):
    """The launcher's checks (before any process group) name the file, the row and the field."""
    from longmoe.train.config import from_dict
    from longmoe.train.launch import validate
    fn, msg = BAD[case]
    samples = _samples()
    for i in range(len(samples)):
        r = samples[i].routed_experts
        r[r[..., 0] < 0] = torch.arange(DIMS[1])   # no -1 rows: every token's change shows
    rows = _bad([_row(s) for s in samples], 3, fn)
    import pyarrow as pa
    for source, where in (("jsonl", "r.jsonl:4"), ("parquet", "r.parquet:row 3")):
        path = (_write_jsonl(tmp_path / "r.jsonl", rows) if source == "jsonl" else
                _write_parquet(tmp_path / "r.parquet", rows, width=pa.int32()))
        d = run_dict(4)
        d["data"].update({"batch_size": 2, "source": source, "path": str(path)})
        with pytest.raises(UserError) as e:
            validate(from_dict(d), 1)
        line = str(e.value)
        assert "\n" not in line
        assert line.startswith(f"{tmp_path / where}: routed_experts"), line
        assert re.search(r"routed_experts" + msg, line), line


@pytest.mark.parametrize("value,match", [
    ([[[1, 2]], [[3]]], r"must be nested lists \[tokens\]\[layers\]\[top_k\]"),   # ragged
    ([[1, 2], [3, 4]], r"got 2-D values"),
    ([[[1.0, 2.0]], [[3.0, 4.0]]], r"got float64 values"),
    ("1,2", r"got str"),
    ([[[1, True]], [[3, 4]]], r"holds true/false"),         # numpy alone reads it as 1
    ([[[False, 2]], [[3, 4]]], r"holds true/false"),
])
def test_malformed_routes_are_refused_by_name(value, match):
    row = {"prompt": [1], "response": [2], "advantage": 0.0, "routed_experts": value}
    with pytest.raises(UserError, match=r"^f\.jsonl:3: routed_experts .*" + match):
        check_sample(row, "f.jsonl:3", V, None, (1, 2, 8))


def test_parquet_routes_of_other_shapes_are_refused_by_name(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    base = {"prompt": [[1], [1]], "response": [[2], [2]], "advantage": [0.0, 0.0]}
    cases = {
        "ragged": (pa.array([[[[0, 1]], [[2, 3]]], [[[0, 1]], [[2]]]]), "ragged.parquet:row 1"),
        "floats": (pa.array([None, [[[0.0, 1.0]], [[2.0, 3.0]]]]), "double values"),
        "depth": (pa.array([[[0, 1], [2, 3]], None]), "got a column of list<"),
        "null_id": (pa.array([[[[0, 1]], [[2, None]]], None]), "holds a null"),
    }
    for name, (col, needle) in cases.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({**base, "routed_experts": col}), path)
        with pytest.raises(UserError) as e:
            ParquetSource(path, lambda row, where: check_sample(row, where, V, None, (1, 2, 8)))
        assert "routed_experts" in str(e.value) and needle in str(e.value), (name, str(e.value))


def test_a_run_without_route_dims_refuses_routes_by_name():
    row = {"prompt": [1], "response": [2], "advantage": 0.0, "routed_experts": [[[0]], [[1]]]}
    with pytest.raises(UserError, match=r"^f\.jsonl:3: routed_experts: this run does not replay"):
        check_sample(row, "f.jsonl:3", V)
    check_sample({**row, "routed_experts": None}, "f.jsonl:3", V)   # null: no routes


def test_parquet_routes_are_not_python_objects(tmp_path, monkeypatch):
    """A 2K-token sample at 40 layers x 8: its 655K ids go through Arrow and numpy, not
    to_pylist (a 32K-token sample holds 10M)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    T, L, K = 2048, 40, 8
    ids = np.random.default_rng(0).random((T, L, 64)).argsort(-1)[..., :K].astype(np.int16)
    typ = pa.list_(pa.list_(pa.list_(pa.int16())))
    flat = pa.array(ids.reshape(-1))
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, T * L * K + 1, K, dtype=np.int32)),
                                     flat)
    mid = pa.ListArray.from_arrays(pa.array(np.arange(0, T * L + 1, L, dtype=np.int32)), inner)
    col = pa.ListArray.from_arrays(pa.array(np.array([0, T], dtype=np.int32)), mid).cast(typ)
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({"prompt": [[1] * 48], "response": [[2] * (T - 48)],
                             "advantage": [0.5], "routed_experts": col}), path)
    import longmoe.data.sources as sources
    seen = []
    plain = sources._drop_nulls

    def spy(row):    # every row Arrow turned into Python objects passes here
        seen.append(sorted(row))
        return plain(row)
    monkeypatch.setattr(sources, "_drop_nulls", spy)
    src = ParquetSource(path, lambda row, where: check_sample(row, where, V, None, (L, K, 64)))
    s = src.get(0)
    assert s.routed_experts.dtype == torch.int16
    assert torch.equal(s.routed_experts, torch.from_numpy(ids))
    assert seen and all("routed_experts" not in keys for keys in seen), seen


def _cli(cwd, *extra, nproc=1):
    import os
    import subprocess
    import sys
    env = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "longmoe", "train", "--config", "cpu_demo", "--nproc",
           str(nproc), "--set", "data.source=jsonl", "--set", "data.path=d.jsonl",
           "--set", "data.batch_size=4", "--steps", "1", *extra]
    if nproc == 1:
        cmd += ["--set", "parallel.ep=1"]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_longmoe_train_refuses_a_file_with_routes_of_another_model(tmp_path):
    """Routes for 3 MoE layers on the 2-layer demo model: one line naming line 2 and the field,
    before any rank starts."""
    rows = [_row(s) for s in _samples(4)]
    rows[1]["routed_experts"] = [r + [r[0]] for r in rows[1]["routed_experts"]]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    p = _cli(tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "d.jsonl:2: routed_experts: shape [" in lines[0], p.stderr
    assert ", 3, 2] is not [" in lines[0] and "rank(s) on" not in p.stdout, lines[0]


@pytest.mark.slow
def test_longmoe_train_on_two_ranks_replays_file_routes(tmp_path):
    """`longmoe train` itself (the demo's EP 2 x FSDP2 on 2 gloo ranks, full rows of seq_len):
    step 1's loss on a file with routes is forward_backward's on the samples with those routes in
    one process, and differs from the loss on the file without them."""
    from longmoe.api import PolicyTrainer
    samples = _samples(4)
    losses = {}
    for name, keep in (("routes", True), ("plain", False)):
        d = tmp_path / name
        d.mkdir()
        _write_jsonl(d / "d.jsonl", [_row(s, routes=keep) for s in samples])
        p = _cli(d, "--metrics-out", "m.jsonl", nproc=2)
        assert p.returncode == 0, p.stderr[-3000:]
        losses[name] = json.loads((d / "m.jsonl").read_text().splitlines()[0])["loss"]
    pt = PolicyTrainer.from_config("cpu_demo", ["parallel.ep=1", "parallel.fsdp=false",
                                                "train.nproc=1", "train.device=cpu"])
    want = pt.forward_backward(samples)["loss"]
    want_plain = pt.forward_backward(
        [dataclasses.replace(s, routed_experts=None) for s in samples])["loss"]
    assert losses["routes"] == pytest.approx(want, rel=1e-4, abs=1e-6), (losses, want)
    assert losses["plain"] == pytest.approx(want_plain, rel=1e-4, abs=1e-6), (losses, want_plain)
    assert abs(losses["routes"] - losses["plain"]) > 1e-3 * max(1.0, abs(want_plain))
