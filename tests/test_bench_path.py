"""`longmoe bench train-path` end to end on 2 CPU ranks: every stage runs as its own training
process and is summarised; a bad stage name is one line naming the flag."""

import json
import subprocess
import sys

import pytest


@pytest.mark.slow  # the slow tier: a training run per stage
def test_train_path_runs_every_stage(tmp_path):
    out = tmp_path / "path.json"
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "train-path", "--config",
                        "cpu_demo", "--nproc", "2", "--tokens", "96", "--steps", "2",
                        "--set", "data.prompt_len=16", "--out", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert [r["stage"] for r in rep["runs"]] == ["baseline", "+linear CE", "+FSDP2", "+chunked EP"]
    for r in rep["runs"]:
        assert r["status"] == "ok", r
        assert r["steps"] == 2 and r["peak_mem_gib"] > 0 and r["hw_tflops_per_gpu"] > 0
    assert "parallel.linear_ce" not in rep["runs"][0]["cmd"]
    assert "impl.linear_ce=reference" in rep["runs"][0]["cmd"]
    assert "parallel.chunks=auto" in rep["runs"][3]["cmd"]
    # cpu_demo is EP=2: the last stage chunks its all-to-alls and says how many chunks it used
    assert "note" not in rep["runs"][3] and rep["runs"][3]["ep_chunks"] >= 1
    assert rep["runs"][3]["a2a_transport"] == "process_group"
    assert all(r["seq_len"] == 96 and r["tokens_per_gpu"] == 96 for r in rep["runs"])


def test_stage_note_reads_the_overrides():
    from longmoe.bench.train_path import stage_note
    assert stage_note("cpu_demo", "+chunked EP", {"parallel.recompute": "full"}) is None
    one = stage_note("gpu_smoke", "+chunked EP", {"parallel.recompute": "full"})
    assert one.startswith("EP=1")
    assert stage_note("gpu_smoke", "+chunked EP", {"parallel.ep": 2}) is None
    assert stage_note("cpu_demo", "+chunked EP", {"parallel.ep": 1}).startswith("EP=1")


def test_unknown_stage_is_named(tmp_path):
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "train-path", "--config",
                        "cpu_demo", "--stages", "turbo"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode != 0 and "--stages: unknown stage 'turbo'" in p.stderr


def test_context_parallel_rows_count_tokens_per_gpu(tmp_path):
    # CP 2 splits each sequence over two ranks: the row says both the length and the share
    out = tmp_path / "cp.json"
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "train-path", "--config",
                        "cpu_demo", "--nproc", "2", "--tokens", "128", "--steps", "1",
                        "--stages", "+chunked EP", "--set", "parallel.cp=2",
                        "--set", "data.prompt_len=16", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = json.loads(out.read_text())["runs"]
    assert row["status"] == "ok" and row["seq_len"] == 128 and row["tokens_per_gpu"] == 64
