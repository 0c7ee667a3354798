"""bench/compare_steps.py (the multi-GPU parity check of bench/h200x2_rl.sh) on real runs: one
step of the same packed batch on one process and on CP 2 over gloo agrees; a run that differs
beyond the tolerance, or in its trained tokens, is flagged and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETS = ["--set", "model.preset=tiny-hybrid", "--set", "train.device=cpu", "--set",
        "data.packing=true", "--set", "data.seq_len=128", "--set", "data.prompt_len=8",
        "--set", "data.max_tokens_per_micro_batch=128", "--set", "data.row_multiple=16",
        "--set", "data.response_len=lognormal:40:100", "--set", "data.batch_size=4",
        "--set", "data.num_samples=8"]
ENV = {**os.environ, "LONGMOE_BACKEND": "cpu"}


def _train(out, *extra):
    p = subprocess.run([sys.executable, "-m", "longmoe", "train", "--config", "gpu_smoke",
                        "--steps", "2", *SETS, "--metrics-out", str(out), *extra],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return [json.loads(line) for line in open(out)]


def _compare(a, b, tmp_path):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "compare_steps.py"), str(a),
                           str(b), "--what", "test", "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=ENV, timeout=120)


@pytest.mark.slow  # the slow tier: three CLI training runs
def test_cp2_matches_one_process_and_a_changed_run_is_flagged(tmp_path):
    one = tmp_path / "one.jsonl"
    cp2 = tmp_path / "cp2.jsonl"
    _train(one)
    _train(cp2, "--nproc", "2", "--set", "parallel.cp=2")
    p = _compare(one, cp2, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["ok"] and len(report["steps"]) == 2
    assert {"loss", "grad_norm", "trained_tokens"} <= set(report["steps"][0])
    for field, change in (("grad_norm", lambda v: v * 1.05), ("trained_tokens", lambda v: v + 1)):
        rows = [json.loads(line) for line in open(cp2)]
        rows[1][field] = change(rows[1][field])
        bad = tmp_path / f"bad_{field}.jsonl"
        bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
        p = _compare(one, bad, tmp_path)
        assert p.returncode == 1 and "NO" in p.stdout, (field, p.stdout)
    p = _compare(one, tmp_path / "missing.jsonl", tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error:")
