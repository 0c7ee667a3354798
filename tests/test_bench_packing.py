"""`longmoe bench packing --smoke` runs its three arms on CPU and writes the JSON and table."""

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # the slow tier: every arm of the benchmark
def test_bench_packing_smoke(tmp_path):
    out = tmp_path / "packing.json"
    env = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "packing", "--smoke",
                        "--padded-samples", "2", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (tmp_path / "packing.md").exists()
    arms = {a["arm"]: a for a in report["arms"]}
    assert set(arms) == {"full rows", "packed", "padded"}
    assert all(a["status"] == "ok" for a in arms.values()), report
    assert arms["full rows"]["padding_share"] == 0.0
    # one sample per budget-long row wastes most of it; packing only rounds
    assert arms["padded"]["padding_share"] > 0.3
    assert arms["packed"]["padding_share"] < arms["padded"]["padding_share"]
    assert arms["packed"]["samples"] == 8 and arms["packed"]["micro_batches"] >= 1
    assert arms["padded"]["micro_batches"] == 2
    for k in ("packed_tokens_per_s_over_full_rows", "padded_tokens_per_s_over_full_rows",
              "packed_peak_over_full_rows"):
        assert report["ratios"][k] > 0
    assert report["commit"] is None or isinstance(report["commit"], str)
    assert "useful tok/s" in p.stdout


def test_bench_packing_bad_flags_are_one_line():
    env = {**os.environ, "LONGMOE_BACKEND": "cpu"}
    for args, needle in ((["--budget", "1024", "--max-len", "2048"], "--budget"),
                         (["--mean", "0"], "--mean"), (["--max-len", "512"], "--max-len"),
                         (["--arms", "packed,static"], "--arms")):
        p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "packing", *args],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and needle in lines[0], p.stderr


def test_bench_packing_runs_the_configs_nproc(tmp_path, monkeypatch):
    # cpu_demo is written for 2 ranks (EP 2, train.nproc 2): every arm starts 2 ranks unless
    # --nproc says otherwise; --smoke runs its one-rank layout. The training runs themselves are
    # replaced by a recorder: what is checked here is the command each arm is given.
    from longmoe.bench import packing
    from longmoe.cli import main
    started = []

    def record(config, nproc, overrides, steps, metrics, timeout, profile=None, env=None):
        started.append((config, nproc, overrides.get("parallel.ep")))
        return {"status": "failed", "cmd": "", "error": "not run"}
    monkeypatch.setattr(packing, "_run", record)
    small = ["--max-len", "96", "--budget", "128", "--prompt-len", "8", "--mean", "24",
             "--out", str(tmp_path / "p.json")]
    main(["bench", "packing", "--config", "cpu_demo"] + small)
    assert [s[:2] for s in started] == [("cpu_demo", 2)] * 3
    assert json.loads((tmp_path / "p.json").read_text())["nproc"] == 2
    started.clear()
    main(["bench", "packing", "--config", "cpu_demo", "--set", "train.nproc=4"] + small)
    assert {s[1] for s in started} == {4}
    started.clear()
    main(["bench", "packing", "--config", "cpu_demo", "--nproc", "1", "--set", "parallel.ep=1"]
         + small)
    assert {s[1] for s in started} == {1}
    started.clear()
    main(["bench", "packing", "--smoke", "--out", str(tmp_path / "s.json")])
    assert {s[1:] for s in started} == {(1, 1)}


@pytest.fixture
def arm_runs(monkeypatch):
    """The (overrides, env) each arm's training run is given, in order; the runs themselves are
    replaced by this recorder (each reads as failed)."""
    from longmoe.bench import packing
    started = []

    def record(config, nproc, overrides, steps, metrics, timeout, profile=None, env=None):
        started.append((overrides, env))
        return {"status": "failed", "cmd": "", "error": "not run"}
    monkeypatch.setattr(packing, "_run", record)
    return started


def test_bench_packing_arms_and_the_static_shapes_twin(tmp_path, arm_runs):
    # --arms picks arms and keeps their fixed order; the static-shapes arm is the packed arm's
    # command with LONGMOE_COMPILE_SHAPES=static in its environment.
    from longmoe.cli import main
    started = arm_runs
    out = tmp_path / "p.json"
    main(["bench", "packing", "--smoke", "--arms", "packed-static,full-rows,packed",
          "--out", str(out)])
    assert json.loads(out.read_text())["arms_run"] == ["full rows", "packed",
                                                      "packed, static shapes"]
    (full, full_env), (packed, packed_env), (static, static_env) = started
    assert packed == static and full != packed
    assert full_env is None and packed_env is None
    assert static_env == {"LONGMOE_COMPILE_SHAPES": "static"}


def _step_row(t: float, **extra) -> dict:
    """A step log row of `t` seconds (the fields _summary reads), plus `extra`."""
    return {"tokens_per_s": 10.0, "step_time_s": t, "padding_share": 0.1, "micro_batches": 2,
            "useful_tokens": 100, "tokens": 110, "rank_cost_imbalance": 1.0,
            "hw_tflops_per_gpu": 1.0, "peak_mem_bytes": 2**30, **extra}


def test_bench_packing_reports_the_first_step_apart():
    from longmoe.bench.packing import _summary, markdown_table, ratios
    rows = [_step_row(t) for t in (9.0, 3.0, 5.0)]
    s = _summary(rows)
    assert s["first_step_s"] == 9.0 and s["step_time_s"] == 4.0 and s["first_over_steady"] == 2.25
    arms = [{"arm": "packed", "samples": 8, "status": "ok", **s},
            {"arm": "packed, static shapes", "samples": 8, "status": "ok", **s,
             "first_step_s": 18.0}]
    r = ratios(arms)
    assert r == {"packed_first_step_over_static_shapes": 0.5, "packed_step_over_static_shapes": 1.0}
    table = markdown_table({"samples": 8, "prompt_len": 8, "response_len": "x", "budget": 128,
                            "row_multiple": 1, "steps": 3, "arms": arms, "ratios": r})
    assert "| packed | 8 | 10 | 4.00 | 9.00 (2.25x) | not recorded |" in table


def test_bench_packing_records_the_compile_caches_it_starts_from(tmp_path, monkeypatch):
    # A first step is "from cold" only with empty caches: the report says which directories the
    # arms share and how full they were, and the table says so too.
    from longmoe.bench.packing import compile_caches, markdown_table
    tri, ind = tmp_path / "triton", tmp_path / "inductor"
    tri.mkdir()
    (tri / "abc").mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tri))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(ind))  # not made yet
    caches = compile_caches()
    assert caches == {"triton": {"dir": str(tri), "entries_at_start": 1},
                      "inductor": {"dir": str(ind), "entries_at_start": 0}}
    report = {"samples": 8, "prompt_len": 8, "response_len": "x", "budget": 128,
              "row_multiple": 1, "steps": 2, "arms": [], "compile_caches": caches}
    table = markdown_table(report)
    assert f"triton {tri} (1 entries); inductor {ind} (0 entries)." in table
    assert "both empty" not in table
    (tri / "abc").rmdir()
    report["compile_caches"] = compile_caches()
    assert "(0 entries) (both empty)." in markdown_table(report)
    del report["compile_caches"]  # reports from before the field: no line
    assert "Compile caches" not in markdown_table(report)


def test_bench_packing_reports_the_first_steps_kernel_compiles():
    from longmoe.bench.packing import _summary, markdown_table
    rows = [_step_row(t, kernel_compiles=n, kernel_compile_s=s, kernel_cache_loads=0)
            for t, n, s in ((30.0, 26, 15.45), (20.0, 0, 0.0), (20.0, 1, 0.5))]
    r = _summary(rows)
    assert (r["first_step_kernel_compiles"], r["first_step_kernel_compile_s"],
            r["later_kernel_compiles"]) == (26, 15.45, 1)
    table = markdown_table({"samples": 8, "prompt_len": 8, "response_len": "x", "budget": 128,
                            "row_multiple": 1, "steps": 3,
                            "arms": [{"arm": "packed", "samples": 8, "status": "ok", **r}]})
    assert "| 30.00 (1.50x) | 26 (15.45) |" in table
    for row in rows:  # a log without the fields (no listener): not recorded, not zero
        for k in ("kernel_compiles", "kernel_compile_s", "kernel_cache_loads"):
            del row[k]
    r = _summary(rows)
    assert r["first_step_kernel_compiles"] is None and r["later_kernel_compiles"] is None


def test_bench_packing_says_what_was_precompiled_and_waited_for():
    from longmoe.bench.packing import _summary, markdown_table
    rows = [_step_row(t, kernel_compiles=0, kernel_compile_s=0.0, kernel_cache_loads=26)
            for t in (24.0, 20.0)]
    rows[0].update(kernel_precompiled=26, kernel_precompile_s=9.0,
                   kernel_precompile_wait_after_s=1.5)
    r = _summary(rows)
    assert (r["precompiled"], r["precompile_s"], r["precompile_wait_after_s"]) == (26, 9.0, 1.5)
    table = markdown_table({"samples": 8, "prompt_len": 8, "response_len": "x", "budget": 128,
                            "row_multiple": 1, "steps": 2,
                            "arms": [{"arm": "packed", "samples": 8, "status": "ok", **r}]})
    assert "| 0 (0.00); 26 precompiled in 9.0 s, 1.5 s waited for after the step |" in table
    # a report from when the trainer waited for the pool before the first step
    legacy = {k: v for k, v in r.items() if k != "precompile_wait_after_s"}
    legacy["precompile_wait_s"] = 9.4
    table = markdown_table({"samples": 8, "prompt_len": 8, "response_len": "x", "budget": 128,
                            "row_multiple": 1, "steps": 2,
                            "arms": [{"arm": "packed", "samples": 8, "status": "ok", **legacy}]})
    assert "| 0 (0.00); 26 precompiled, 9.4 s waited for before the step |" in table


def test_bench_packing_manifest_arms_run_from_empty_caches_of_their_own(tmp_path, arm_runs):
    # --arms packed-manifest: the packed arm twice, each with its own (fresh) cache directories
    # and the same train.kernel_manifest in the run's temporary directory, the first recording
    # it, the second compiling it ahead; the report gives the second's first step over the first.
    from longmoe.cli import main
    started = arm_runs
    out = tmp_path / "p.json"
    main(["bench", "packing", "--smoke", "--arms", "packed-manifest,packed", "--out", str(out)])
    rep = json.loads(out.read_text())
    assert rep["arms_run"] == ["packed", "packed, empty caches",
                               "packed, empty caches, kernel manifest"]
    (packed, packed_env), (cold, cold_env), (pre, pre_env) = started
    assert packed_env is None and "train.kernel_manifest" not in packed
    assert cold["train.kernel_manifest"] == pre["train.kernel_manifest"]
    assert {k: v for k, v in cold.items() if k != "train.kernel_manifest"} == \
        {k: v for k, v in packed.items()}
    dirs = [cold_env["TRITON_CACHE_DIR"], cold_env["TORCHINDUCTOR_CACHE_DIR"],
            pre_env["TRITON_CACHE_DIR"], pre_env["TORCHINDUCTOR_CACHE_DIR"]]
    assert len(set(dirs)) == 4
    assert rep["arms"][1]["caches"] == cold_env
    from longmoe.bench.packing import ratios
    ok = [{"arm": a, "status": "ok", "first_step_s": t}
          for a, t in (("packed, empty caches", 40.0), ("packed, empty caches, kernel manifest",
                                                        30.0))]
    assert ratios(ok) == {"manifest_first_step_over_empty_caches": 0.75}
