"""Token-budget training through `longmoe train`: data.overlong drop | truncate end to end with the
per-step counts in --metrics-out, and the bad inputs the launcher rejects before any process group
starts (a sample over the budget under data.overlong=error, a budget below the longest prompt or
not dividing into the CP zigzag pieces, a Parquet file missing a field), each as one line naming
the sample, field or setting: through the command (exit 2) and through its validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from longmoe.errors import UserError
from longmoe.train.config import from_dict
from longmoe.train.launch import validate

ENV = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
BUDGET = 24


def _rows():
    ok = {"prompt": [1, 2, 3], "response": [5, 6, 7, 8, 9], "advantage": 0.5}
    long = {"prompt": [4, 5, 6], "response": list(range(10, 40)), "advantage": -0.5}  # 33 tokens
    return [ok, long, {**ok, "advantage": -1.0}, {**ok, "response": [7] * 12}, long, ok]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _train(cwd, *extra):
    cmd = [sys.executable, "-m", "longmoe", "train", "--config", "cpu_demo", "--nproc", "1",
           "--set", "parallel.ep=1", "--set", "data.source=jsonl", "--set", "data.path=d.jsonl",
           "--set", "data.batch_size=3", "--set", f"data.max_tokens_per_micro_batch={BUDGET}",
           "--steps", "2", *extra]
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=300)


def test_overlong_policies_end_to_end(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", _rows())
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {p: pool.submit(_train, tmp_path, "--set", f"data.overlong={p}",
                               "--metrics-out", f"{p}.jsonl") for p in ("drop", "truncate")}
        runs = {p: f.result() for p, f in runs.items()}
    for policy, p in runs.items():
        assert p.returncode == 0, p.stderr[-2000:]
        rows = [json.loads(ln) for ln in (tmp_path / f"{policy}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        # Each step's three rows hold one 33-token sample (lines 2 and 5).
        kept = [8 + 8, 15 + 8]
        for r, useful in zip(rows, kept):
            if policy == "drop":
                assert (r["dropped_samples"], r["truncated_samples"]) == (1, 0), r
                assert r["useful_tokens"] == useful
            else:
                assert (r["dropped_samples"], r["truncated_samples"]) == (0, 1), r
                assert r["truncated_tokens"] == 33 - BUDGET
                assert r["useful_tokens"] == useful + BUDGET
            assert r["micro_batches"] >= 1 and 0 <= r["padding_share"] < 1
        out = " ".join(p.stdout.split())
        assert ("1 dropped, 0 truncated" if policy == "drop" else "0 dropped, 1 truncated") in out


def _write_bad_inputs(d):
    import pyarrow as pa
    import pyarrow.parquet as pq
    _write_jsonl(d / "d.jsonl", _rows())
    _write_jsonl(d / "p.jsonl", _rows() + [{"prompt": [1] * 30, "response": [2], "advantage": 0}])
    pq.write_table(pa.table({"prompt": [[1, 2]], "response": [[3, 4]]}), d / "m.parquet")


# id -> (arguments after _train's, substrings the one error line must hold)
BAD_CLI = {
    # the default data.overlong=error: line 2 holds 33 tokens
    "sample_over_budget": ([], ["d.jsonl:2", "33 tokens",
                                f"data.max_tokens_per_micro_batch={BUDGET}"]),
    # a prompt no budget row can hold, even when long samples may be cut
    "budget_below_longest_prompt": (["--set", "data.path=p.jsonl",
                                     "--set", "data.overlong=truncate"],
                                    [f"data.max_tokens_per_micro_batch: {BUDGET}",
                                     "longest prompt (30 tokens, p.jsonl:"]),
    # rows of 30 tokens cannot split into the 4 zigzag pieces of CP 2
    "budget_not_in_zigzag_pieces": (["--nproc", "2", "--set", "parallel.cp=2",
                                     "--set", "data.max_tokens_per_micro_batch=30"],
                                    ["data.max_tokens_per_micro_batch: 30", "2*cp=4"]),
    "parquet_missing_field": (["--set", "data.source=parquet", "--set", "data.path=m.parquet",
                               "--set", "data.batch_size=1"], ["m.parquet", "'advantage'"]),
}


@pytest.fixture(scope="module")
def bad_cli(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    _write_bad_inputs(d)
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {k: pool.submit(_train, d, *argv) for k, (argv, _) in BAD_CLI.items()}


@pytest.mark.parametrize("case", list(BAD_CLI))
def test_bad_input_through_the_cli(bad_cli, case):
    p = bad_cli[case].result()
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    for s in BAD_CLI[case][1]:
        assert s in lines[0], f"{s!r} not in {lines[0]!r}"
    # Rejected before any rank started: no training banner, no step.
    assert "rank(s) on" not in p.stdout and "step" not in p.stdout, p.stdout


def _run(**data):
    base = {"model": {"preset": "tiny"}, "parallel": {"ep": 1, "fsdp": False},
            "data": {"batch_size": 4, "seq_len": 32, "prompt_len": 8, **data},
            "train": {"device": "cpu"}}
    cp = data.pop("cp", None)
    if cp:
        base["parallel"]["cp"] = cp
        base["data"].pop("cp", None)
    return from_dict(base)


def _rejects(run, nproc, *needles):
    with pytest.raises(UserError) as e:
        validate(run, nproc)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg
    return msg


def test_bad_input_is_one_line_before_any_process_group(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = _rows()
    _write_jsonl(tmp_path / "d.jsonl", rows)
    j = str(tmp_path / "d.jsonl")
    # A sample longer than the budget under data.overlong=error: named by file and line.
    _rejects(_run(source="jsonl", path=j, max_tokens_per_micro_batch=BUDGET), 1,
             "d.jsonl:2", "33 tokens", f"data.max_tokens_per_micro_batch={BUDGET}")
    # A budget smaller than the longest prompt (even with drop: every prompt must fit the row).
    _write_jsonl(tmp_path / "p.jsonl",
                 rows + [{"prompt": [1] * 30, "response": [2], "advantage": 0}])
    _rejects(_run(source="jsonl", path=str(tmp_path / "p.jsonl"), max_tokens_per_micro_batch=BUDGET,
                  overlong="truncate"), 1, "data.max_tokens_per_micro_batch", "longest prompt (30")
    _rejects(_run(prompt_len=40, response_len="fixed:4", max_tokens_per_micro_batch=BUDGET), 1,
             "data.max_tokens_per_micro_batch", "longest prompt (40")
    # A budget that does not divide into the 2*cp zigzag pieces.
    _rejects(_run(response_len="uniform:1:8", max_tokens_per_micro_batch=30, cp=2), 2,
             "data.max_tokens_per_micro_batch", "2*cp=4")
    _rejects(_run(response_len="uniform:1:8", max_tokens_per_micro_batch=32, row_multiple=12), 1,
             "data.row_multiple")
    # A synthetic distribution that can draw samples longer than the budget.
    _rejects(_run(response_len="lognormal:10:100", max_tokens_per_micro_batch=64), 1,
             "data.response_len", "108 tokens", "data.max_tokens_per_micro_batch=64")
    # A Parquet file missing a field.
    table = pa.table({"prompt": [[1, 2]], "response": [[3, 4]]})
    pq.write_table(table, tmp_path / "m.parquet")
    _rejects(_run(source="parquet", path=str(tmp_path / "m.parquet"),
                  max_tokens_per_micro_batch=BUDGET), 1, "m.parquet", "'advantage'")
    # Padded rows of a data source: the limit is data.seq_len.
    full = pa.table({"prompt": [[1, 2, 3], [4]], "response": [[5] * 4, [6] * 40],
                     "advantage": [0.5, -0.5]})
    pq.write_table(full, tmp_path / "f.parquet")
    _rejects(_run(source="parquet", path=str(tmp_path / "f.parquet")), 1,
             "f.parquet:row 1", "41 tokens", "data.seq_len=32")
    # What is fine passes.
    validate(_run(source="parquet", path=str(tmp_path / "f.parquet"),
                  max_tokens_per_micro_batch=48), 1)
    validate(_run(source="jsonl", path=j, max_tokens_per_micro_batch=BUDGET, overlong="drop"), 1)


def test_budget_config_errors():
    from longmoe.errors import ConfigError
    for data, field in (({"max_tokens_per_micro_batch": 0}, "data.max_tokens_per_micro_batch"),
                        ({"max_tokens_per_micro_batch": 1.5}, "data.max_tokens_per_micro_batch"),
                        ({"response_len": "gamma:3"}, "data.response_len"),
                        ({"response_len": "fixed:0"}, "data.response_len"),
                        ({"source": "parquet"}, "data.path"),
                        ({"source": "csv"}, "data.source"),
                        ({"packing": "yes"}, "data.packing"),
                        ({"row_multiple": 0}, "data.row_multiple"),
                        ({"num_samples": 0, "response_len": 8}, "data.num_samples"),
                        ({"num_samples": 4}, "data.num_samples")):
        with pytest.raises(ConfigError) as e:
            from_dict({"data": data})
        assert str(e.value).startswith(field), (data, str(e.value))


def test_objective_terms_in_the_step_log_and_metrics(tmp_path):
    """The KL, truncated-IS and dual-clip statistics appear in the step log and --metrics-out
    when the objective has those terms (the synthetic samples carry ref and rollout
    log-probs)."""
    cmd = [sys.executable, "-m", "longmoe", "train", "--config", "cpu_demo", "--nproc", "1",
           "--set", "parallel.ep=1", "--set", "data.batch_size=4", "--set", "data.seq_len=32",
           "--set", "data.prompt_len=8", "--set", "data.response_len=uniform:4:20",
           "--set", f"data.max_tokens_per_micro_batch={BUDGET + 8}", "--set", "loss.kl_coef=0.1",
           "--set", "loss.tis_cap=1.2", "--set", "loss.dual_clip_c=3", "--steps", "2",
           "--metrics-out", "m.jsonl"]
    p = subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    from longmoe.ops.kernels.compile_watch import CompileWatch
    probe = CompileWatch().start()
    watching = probe.active
    probe.stop()
    for r in rows:
        for k in ("ratio", "kl", "tis_weight", "tis_clip_frac", "dual_clip_frac"):
            assert isinstance(r[k], float), (k, r)
        assert 0 < r["tis_weight"] <= 1.2 and 0 <= r["tis_clip_frac"] <= 1
        assert r["kl"] >= 0  # k3 is never negative
        assert r["ratio"] > 0
        # The step's kernel compiles (longmoe.ops.kernels.compile_watch): the CPU path
        # launches no compiled Triton kernel, so none; absent where Triton has no listener.
        if watching:
            assert (r["kernel_compiles"], r["kernel_compile_s"], r["kernel_cache_loads"]) == \
                (0, 0.0, 0), r
        else:
            assert "kernel_compiles" not in r
    out = " ".join(p.stdout.split())
    assert "kl " in out and "tis " in out and "dual-clip " in out, out
