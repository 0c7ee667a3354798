"""Sample sources: the JSONL stream keeps only an offset index, Parquet reads the same fields by
row group, synthetic lengths follow their distribution, and the epoch order is resumable."""

import json
import random
import statistics
import tracemalloc

import numpy as np
import pytest
import torch

from longmoe.data.lengths import parse_length
from longmoe.data.order import epoch_order, step_indices
from longmoe.data.pipeline import check_source, open_source, plan_for_step, rank_micro_batches
from longmoe.data.sources import JsonlSource, ParquetSource
from longmoe.data.synthetic import SyntheticSource
from longmoe.errors import ConfigError, UserError

V = 101


def check(row, where):
    """A minimal validator standing in for the full one: ids are in-vocabulary integers."""
    for key in ("prompt", "response"):
        if not all(isinstance(t, int) and 0 <= t < V for t in row[key]):
            raise UserError(f"{where}: {key} has a token id outside [0, {V})")
    if not row["response"]:
        raise UserError(f"{where}: response is empty")


def make_rows(n, rng, max_len=40):
    rows = []
    for _ in range(n):
        P, R = rng.randrange(0, max_len), rng.randrange(1, max_len)
        row = {"prompt": [rng.randrange(V) for _ in range(P)],
               "response": [rng.randrange(V) for _ in range(R)],
               "advantage": [rng.gauss(0, 1) for _ in range(R)],
               "old_logprobs": [-rng.random() for _ in range(R)]}
        if rng.random() < 0.5:
            row["loss_mask"] = [int(rng.random() < 0.8) for _ in range(R)]
        if rng.random() < 0.5:
            row["ref_logprobs"] = [-rng.random() for _ in range(R)]
        rows.append(row)
    return rows


def write_jsonl(path, rows, blank_every=0):
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r) + "\n")
            if blank_every and i % blank_every == 0:
                f.write("\n")


def assert_sample_is_row(s, row):
    assert s.prompt.tolist() == row["prompt"] and s.response.tolist() == row["response"]
    assert torch.allclose(s.advantage, torch.tensor(row["advantage"]))
    assert torch.allclose(s.old_logprobs, torch.tensor(row["old_logprobs"]))
    if "ref_logprobs" in row:
        assert torch.allclose(s.ref_logprobs, torch.tensor(row["ref_logprobs"]))
    else:
        assert s.ref_logprobs is None
    if "loss_mask" in row:
        assert s.loss_mask.tolist() == [bool(v) for v in row["loss_mask"]]
    else:
        assert s.loss_mask is None


# ---- JSONL ---------------------------------------------------------------------------------

def test_jsonl_index_and_random_access(tmp_path):
    rng = random.Random(1)
    rows = make_rows(50, rng)
    path = tmp_path / "r.jsonl"
    write_jsonl(path, rows, blank_every=7)
    src = JsonlSource(path, check)
    assert src.num_samples == 50
    assert src.index_nbytes() == 50 * (8 + 4 + 4 + 4)      # offsets, lines, two lengths
    want = rng.sample(range(50), 20) + [3, 3]
    for i, s in zip(want, src.get_many(want)):
        assert s.index == i and src.sizes(i) == (len(rows[i]["prompt"]), len(rows[i]["response"]))
        assert_sample_is_row(s, rows[i])
    # blank lines count in line numbers: row i sits on line i + 1 + blanks before it
    assert src.where(8) == f"{path}:{8 + 1 + 2}" == src.get(8).where


def test_jsonl_streams_without_holding_the_file(tmp_path):
    rng = random.Random(2)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for _ in range(600):
            f.write(json.dumps(make_rows(1, rng, max_len=800)[0]) + "\n")
    size = path.stat().st_size
    assert size > 4_000_000
    tracemalloc.start()
    src = JsonlSource(path, check)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert src.num_samples == 600
    # One parsed row at a time: a reader holding the text (or its rows) would peak above size.
    assert peak < size / 10, (peak, size)


def test_jsonl_errors_name_the_line(tmp_path):
    rows = make_rows(4, random.Random(3))
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines[2] = lines[2][:-1]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=rf"^{path}:3: not valid JSON"):
        JsonlSource(path, check)
    rows[1]["response"][0] = V
    write_jsonl(path, rows)
    with pytest.raises(UserError, match=rf"^{path}:2: response has a token id outside"):
        JsonlSource(path, check)
    del rows[1]["advantage"]
    write_jsonl(path, rows)
    with pytest.raises(UserError, match=rf"^{path}:2: missing field 'advantage'"):
        JsonlSource(path, check)
    with pytest.raises(UserError, match="does not exist"):
        JsonlSource(tmp_path / "none.jsonl", check)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match="no rows"):
        JsonlSource(tmp_path / "empty.jsonl", check)


def test_jsonl_changed_file_is_caught(tmp_path):
    rows = make_rows(3, random.Random(4))
    path = tmp_path / "r.jsonl"
    write_jsonl(path, rows)
    src = JsonlSource(path, check)
    rows[0]["response"] = rows[0]["response"] + [1]
    write_jsonl(path, rows)
    with pytest.raises(UserError, match="changed since"):
        src.get(0)


# ---- Parquet -------------------------------------------------------------------------------

def write_parquet(path, rows, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq
    keys = ["prompt", "response", "advantage", "old_logprobs", "ref_logprobs", "loss_mask"]
    cols = {k: [r.get(k) for r in rows] for k in keys}
    types = {"prompt": pa.list_(pa.int64()), "response": pa.list_(pa.int64()),
             "loss_mask": pa.list_(pa.int8())}
    table = pa.table({k: pa.array(v, type=types.get(k, pa.list_(pa.float64())))
                      for k, v in cols.items()})
    pq.write_table(table, path, row_group_size=row_group_size)


def test_parquet_round_trip_same_fields(tmp_path):
    rng = random.Random(5)
    rows = make_rows(37, rng)
    write_jsonl(tmp_path / "r.jsonl", rows)
    write_parquet(tmp_path / "r.parquet", rows, row_group_size=5)
    js = JsonlSource(tmp_path / "r.jsonl", check)
    pq_src = ParquetSource(tmp_path / "r.parquet", check)
    assert pq_src.num_samples == js.num_samples == 37
    order = rng.sample(range(37), 37)
    for a, b, i in zip(js.get_many(order), pq_src.get_many(order), order):
        assert a.index == b.index == i and pq_src.sizes(i) == js.sizes(i)
        assert_sample_is_row(b, rows[i])
        for key in ("prompt", "response", "advantage", "old_logprobs", "ref_logprobs", "loss_mask"):
            x, y = getattr(a, key), getattr(b, key)
            assert (x is None and y is None) or torch.equal(x, y), key
    assert pq_src.where(12) == f"{tmp_path / 'r.parquet'}:row 12"


def test_parquet_reads_by_row_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = make_rows(120, random.Random(6), max_len=400)
    path = tmp_path / "r.parquet"
    write_parquet(path, rows, row_group_size=8)
    # The source's reads get a pool of their own, so Arrow memory other code holds or frees
    # (earlier tests, background threads) cannot move the count.
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    src = ParquetSource(path, check, memory_pool=pool)
    whole = pq.read_table(path).nbytes
    group = pq.ParquetFile(path).read_row_group(0).nbytes
    # The scan went through the pool (at least one row group of 8 rows was held at once), and
    # never held more than a third of the table: 15 row groups, read one at a time.
    assert group <= pool.max_memory() < whole / 3, (pool.max_memory(), group, whole)
    src.get_many([3, 100])      # reading samples back also loads single row groups
    assert pool.max_memory() < whole / 3, (pool.max_memory(), whole)


def test_parquet_missing_column_and_bad_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "x.parquet"
    pq.write_table(pa.table({"prompt": [[1, 2]], "response": [[3]]}), path)
    with pytest.raises(UserError, match=rf"^{path}: missing column 'advantage'$"):
        ParquetSource(path, check)
    rows = make_rows(9, random.Random(7))
    rows[6]["prompt"] = [V + 3]
    write_parquet(path, rows, row_group_size=4)
    with pytest.raises(UserError, match=rf"^{path}:row 6: prompt has a token id outside"):
        ParquetSource(path, check)
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="not a readable Parquet file"):
        ParquetSource(tmp_path / "junk.parquet", check)


# ---- synthetic -----------------------------------------------------------------------------

def test_length_distributions():
    u = [random.Random(s).random() for s in range(20000)]
    d = parse_length("lognormal:600:3000", "f")
    xs = [d.draw(x) for x in u]
    assert abs(statistics.mean(xs) - 600) < 0.03 * 600
    assert max(xs) == 3000 and min(xs) >= 1
    assert 0.003 < sum(x == 3000 for x in xs) / len(xs) < 0.03   # the cap is the 99th pct.
    assert statistics.median(xs) < 0.8 * 600                      # long-tailed
    xs = [parse_length("uniform:5:9", "f").draw(x) for x in u]
    assert set(xs) == {5, 6, 7, 8, 9} and abs(statistics.mean(xs) - 7) < 0.1
    assert {parse_length("fixed:17", "f").draw(x) for x in u[:50]} == {17}
    assert parse_length(17, "f") == parse_length("fixed:17", "f")
    for bad in ("lognormal:600", "lognormal:900:600", "uniform:9:5", "gamma:1:2", "fixed:x"):
        with pytest.raises(ConfigError, match="^data.response_len: "):
            parse_length(bad, "data.response_len")


def test_synthetic_sizes_and_content():
    src = SyntheticSource(V, seed=9, prompt_len="uniform:0:6", response_len="lognormal:50:400",
                          group_size=4)
    lens = [src.sizes(i)[1] for i in range(4000)]
    assert abs(statistics.mean(lens) - 50) < 0.05 * 50 and max(lens) <= 400
    samples = src.get_many(range(8))
    for i, s in enumerate(samples):
        assert (s.prompt_len, s.response.numel()) == src.sizes(i) and s.index == i
        assert s.old_logprobs.shape == s.response.shape and s.where == f"synthetic sample {i}"
        assert int(s.response.max()) < V
    # a group shares its prompt, and its advantages are normalised
    assert all(torch.equal(samples[0].prompt, samples[k].prompt) for k in range(4))
    assert abs(sum(s.advantage for s in samples[:4])) < 1e-6
    assert samples[0].response.tolist() != samples[1].response.tolist()
    # each draw depends only on (seed, index): the same after drawing others, or in another source
    again = SyntheticSource(V, 9, "uniform:0:6", "lognormal:50:400", 4).get(5)
    assert torch.equal(again.response, samples[5].response) and again.advantage == samples[5].advantage
    other = SyntheticSource(V, 10, "uniform:0:6", "lognormal:50:400", 4).get(5)
    assert other.response.tolist() != samples[5].response.tolist()


def test_synthetic_global_batch_same_for_any_world_size():
    src = SyntheticSource(V, seed=3, prompt_len=4, response_len="lognormal:40:200", group_size=2)
    seen = {}
    for world in (1, 2, 4):
        batch = plan_for_step(src, step=5, global_batch=16, world=world, budget=256, seed=3)
        got = {}
        for r in range(world):
            for mb in rank_micro_batches(src, batch, r):
                for row_ids, row_idx, row_len in zip(mb.input_ids, mb.sample_index, mb.row_lengths):
                    o = 0
                    for i, n in zip(row_idx, row_len):
                        got[i] = row_ids[o:o + n].tolist()
                        o += n
        assert sorted(got) == list(range(80, 96))
        seen[world] = got
    assert seen[1] == seen[2] == seen[4]


# ---- epochs and resuming -------------------------------------------------------------------

def test_epochs_are_permutations_and_resumable():
    N, G, seed = 23, 5, 17
    seq = [i for s in range(14) for i in step_indices(s, G, N, seed)]
    for e in range(3):
        assert sorted(seq[e * N:(e + 1) * N]) == list(range(N))
    assert seq[:N] != seq[N:2 * N] and seq[:N] != list(range(N))
    assert step_indices(9, G, N, seed) == seq[45:50]            # straddles epochs 1 and 2
    assert step_indices(3, G, N, seed, shuffle=False) == [15, 16, 17, 18, 19]
    assert step_indices(4, G, N, seed, shuffle=False) == [20, 21, 22, 0, 1]
    assert step_indices(2, G, None, seed) == [10, 11, 12, 13, 14]
    assert seq[:N] != [i for s in range(5) for i in step_indices(s, G, N, seed + 1)][:N]
    o = epoch_order(seed, 1, N)
    assert o.dtype == np.int64 and not o.flags.writeable


def test_resumed_step_equals_uninterrupted(tmp_path):
    rows = make_rows(19, random.Random(8))
    write_jsonl(tmp_path / "r.jsonl", rows)

    def packed(src, step):
        b = plan_for_step(src, step, global_batch=6, world=2, budget=128, seed=4, pad_multiple=4)
        return [[(mb.input_ids, mb.labels, mb.advantages.nan_to_num(9.0), mb.sample_ids)
                 for mb in rank_micro_batches(src, b, r)] for r in range(2)]
    running = open_source("jsonl", str(tmp_path / "r.jsonl"), check, V, seed=4)
    for s in range(7):                  # an uninterrupted run reads steps 0..6
        last = packed(running, s)
    fresh = open_source("jsonl", str(tmp_path / "r.jsonl"), check, V, seed=4)
    resumed = packed(fresh, 6)          # a run resumed at step 6 reads only step 6
    assert len(last) == len(resumed) == 2
    for ra, rb in zip(last, resumed):
        assert len(ra) == len(rb)
        for a, b in zip(ra, rb):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ConfigError, match="data.source"):
        open_source("csv", "", check, V, 0)


# ---- startup checks ------------------------------------------------------------------------

def test_check_source_before_training(tmp_path):
    rows = make_rows(6, random.Random(9), max_len=10)
    rows[4] = {"prompt": [1] * 7, "response": [2] * 30, "advantage": 0.5}
    path = tmp_path / "r.jsonl"
    write_jsonl(path, rows, blank_every=2)
    src = JsonlSource(path, check)
    assert src.longest() == (max(len(r["prompt"]) for r in rows), 37)
    with pytest.raises(UserError, match=rf"^{path}:7: sample of 37 tokens is longer than "
                                        r"data.max_tokens_per_micro_batch=32 \("):
        check_source(src, 32)
    check_source(src, 32, overlong="truncate", pad_multiple=4)
    check_source(src, 40, pad_multiple=4)
    lens = [len(r["prompt"]) for r in rows]
    i = lens.index(max(lens))  # the first holding the longest prompt; a blank after every even row
    with pytest.raises(ConfigError, match=rf"longest prompt \({max(lens)} tokens, "
                                          rf"{path}:{i + 1 + (i + 1) // 2}\)"):
        check_source(src, max(lens), overlong="truncate")
    with pytest.raises(ConfigError, match="does not divide"):
        check_source(src, 38, pad_multiple=4)
    syn = SyntheticSource(V, 0, prompt_len=8, response_len="lognormal:20:100")
    check_source(syn, 108)
    with pytest.raises(ConfigError, match=r"^data.response_len: draws samples of up to 108"):
        check_source(syn, 104)
    check_source(syn, 104, overlong="drop")
