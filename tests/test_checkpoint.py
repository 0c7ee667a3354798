"""DCP checkpoints through the CLI on 2 real gloo ranks (the cpu_demo layout: EP=2, FSDP2, full
recompute, chunked linear CE, 2 EP chunks; scaled down to 4 x 64 tokens per rank).

Run A trains 4 steps straight; run B trains 2, stops, and resumes to 4. B's resume also meets the
debris of a crashed save (a step-N.tmp-* directory that looks complete, a latest.tmp-* pointer at
it), which it must neither load nor leave behind. Runs are expensive on 2 cores, so one module
fixture does them all (independent ones side by side) and each test checks its own part; the
slow tier.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 300
# Warmup makes the learning rate differ per step, so a resume must also restore the schedule.
SMALL = ["--config", "cpu_demo", "--set", "data.batch_size=8", "--set", "data.seq_len=64",
         "--set", "data.prompt_len=16", "--set", "optim.warmup_steps=8"]
# CPU backend pinned so a GPU machine runs the same gloo job. One intra-op thread per rank: two
# 2-rank runs share 2 cores here, and both runs of a comparison use the same setting.
ENV = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
JUNK = "step-00000009.tmp-dead"


def longmoe(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longmoe", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def train(cwd: Path, steps: int, ckpt: str, *extra: str) -> subprocess.CompletedProcess:
    return longmoe("train", *SMALL, "--steps", str(steps), "--checkpoint-dir", ckpt, *extra,
                   cwd=cwd)


def plant_crash_debris(ckpt: Path):
    """What a save killed mid-way leaves: a tmp step directory (here even with a meta.json, so
    only its name marks it unfinished) and a latest.tmp-* pointer that was never renamed."""
    junk = ckpt / JUNK
    junk.mkdir()
    (junk / "meta.json").write_text(json.dumps({"step": 9, "ep": 2}))
    (junk / ".metadata").write_bytes(b"\x00not a dcp metadata file")
    (junk / "__0_0.distcp").write_bytes(os.urandom(64))
    (ckpt / "latest.tmp-dead").write_text(JUNK)


def plant_incomplete(ckpt: Path):
    """`latest` names a step directory whose save never finished (no meta.json)."""
    step = ckpt / "step-00000003"
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(os.urandom(64))
    (ckpt / "latest").write_text("step-00000003\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    plant_incomplete(d / "ckI")
    r = {"dir": d}
    with ThreadPoolExecutor(max_workers=3) as pool:
        a = pool.submit(train, d, 4, "ckA", "--metrics-out", "mA.jsonl")
        b1 = pool.submit(train, d, 2, "ckB", "--metrics-out", "mB.jsonl")
        inc = pool.submit(train, d, 4, "ckI", "--resume")
        r["A"], r["B1"], r["incomplete"] = a.result(), b1.result(), inc.result()
        for name in ("A", "B1"):
            assert r[name].returncode == 0, f"run {name} failed:\n{r[name].stderr[-3000:]}"
        r["ckA_before"] = sorted(p.name for p in (d / "ckA").iterdir())
        plant_crash_debris(d / "ckB")
        # --metrics-out with --resume appends: mB.jsonl ends up with steps 1-4.
        b2 = pool.submit(train, d, 4, "ckB", "--resume", "--metrics-out", "mB.jsonl")
        layers = pool.submit(train, d, 6, "ckA", "--resume", "--set", "model.num_layers=1")
        r["B2"], r["num_layers"] = b2.result(), layers.result()
        # Resharding: the same global batch (8 sequences) on 4 ranks (EP2 x FSDP2 over experts)
        # saved at step 2, resumed on 2 ranks with EP2, and with EP1.
        four = ("--nproc", "4", "--set", "data.batch_size=8")
        r4 = pool.submit(train, d, 2, "ckR", *four, "--metrics-out", "mR.jsonl")
        ref4 = pool.submit(train, d, 4, "ckQ", *four, "--metrics-out", "mQ.jsonl")
        r["R1"], r["Q"] = r4.result(), ref4.result()
        assert r["R1"].returncode == 0 and r["Q"].returncode == 0, r["R1"].stderr[-2000:]
        shutil.copytree(d / "ckR", d / "ckR1")
        shutil.copytree(d / "ckR", d / "ckR3")
        ep2 = pool.submit(train, d, 4, "ckR", "--resume", "--metrics-out", "mR.jsonl")
        ep1 = pool.submit(train, d, 3, "ckR1", "--resume", "--set", "parallel.ep=1",
                          "--metrics-out", "mR1.jsonl")
        # Saved with full recompute (its wrapper adds a module level), resumed without it.
        rc = pool.submit(train, d, 3, "ckR3", "--resume", "--set", "parallel.recompute=none",
                         "--metrics-out", "mR3.jsonl")
        r["R2"], r["R_ep1"], r["R_rc"] = ep2.result(), ep1.result(), rc.result()
    return r


def metrics(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def tmp_entries(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.glob("*.tmp-*"))


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """Rejected before any rank started: exit 2, one `error:` line, no traceback, no training."""
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert len(errors) == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert "rank(s) on" not in p.stdout and "step " not in p.stdout, p.stdout
    return errors[0]


def test_resume_matches_uninterrupted_run(runs):
    b2 = runs["B2"]
    assert b2.returncode == 0, b2.stderr[-3000:]
    a = metrics(runs["dir"] / "mA.jsonl")
    b = metrics(runs["dir"] / "mB.jsonl")
    assert [m["step"] for m in a] == [1, 2, 3, 4]
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for ma, mb in zip(a, b):
        # Steps 3-4 start from the loaded weights, AdamW moments, scheduler and data position.
        assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-6), (ma["step"], ma, mb)
        assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-5, abs=1e-6), ma["step"]
        assert mb["lr"] == ma["lr"], ma["step"]
    assert a[0]["lr"] < a[3]["lr"]  # still warming up
    # The comparison can fail: training moved the loss between the steps being compared.
    assert len({round(m["loss"], 6) for m in a}) > 1


def test_checkpoint_layout(runs):
    ck = runs["dir"] / "ckA"
    assert (ck / "latest").read_text().strip() == "step-00000004"
    step = ck / "step-00000004"
    names = {p.name for p in step.iterdir()}
    assert {"manifest.json", "meta.json", ".metadata", "rng-rank0.pt", "rng-rank1.pt"} <= names, names
    assert any(n.endswith(".distcp") for n in names), names
    meta = json.loads((step / "meta.json").read_text())
    assert meta["step"] == 4 and meta["layout"] == {"world": 2, "ep": 2, "cp": 1}
    assert meta["model"]["num_layers"] == 2 and meta["model"]["num_experts"] == 8
    assert tmp_entries(ck) == []


def test_crash_debris_is_ignored_then_removed(runs):
    b2 = runs["B2"]
    assert b2.returncode == 0, b2.stderr[-3000:]
    ck = runs["dir"] / "ckB"
    # Resumed from what `latest` named before the run, not from the newer-looking tmp directory.
    assert "resumed from" in b2.stdout and "step-00000002 at step 2" in b2.stdout, b2.stdout
    assert JUNK not in b2.stdout
    assert [m["step"] for m in metrics(runs["dir"] / "mB.jsonl")][2:] == [3, 4]
    # The step-4 save cleaned the debris and moved `latest`.
    assert tmp_entries(ck) == []
    assert (ck / "latest").read_text().strip() == "step-00000004"
    assert (ck / "step-00000004" / "meta.json").is_file()


def test_incomplete_latest_is_rejected(runs):
    line = one_error_line(runs["incomplete"])
    assert "step-00000003" in line and "incomplete" in line, line


def test_resume_with_other_model_shape_is_rejected(runs):
    line = one_error_line(runs["num_layers"])
    assert "num_layers" in line and "step-00000004" in line, line


def test_resume_on_another_layout_matches_uninterrupted_run(runs):
    d = runs["dir"]
    for name in ("R2", "R_ep1", "R_rc"):
        assert runs[name].returncode == 0, runs[name].stderr[-3000:]
    ref = {m["step"]: m for m in metrics(d / "mQ.jsonl")}
    resumed = [m for m in metrics(d / "mR.jsonl") if m["step"] > 2]
    assert [m["step"] for m in resumed] == [3, 4]
    other_recompute = metrics(d / "mR3.jsonl")
    assert [m["step"] for m in other_recompute] == [3]
    for m in resumed + metrics(d / "mR1.jsonl") + other_recompute:
        assert abs(m["loss"] - ref[m["step"]]["loss"]) < 1e-6, (m["step"], m["loss"])
        assert abs(m["grad_norm"] - ref[m["step"]]["grad_norm"]) < 1e-5 * ref[m["step"]]["grad_norm"]


def test_rejected_resumes_write_nothing(runs):
    assert sorted(p.name for p in (runs["dir"] / "ckA").iterdir()) == runs["ckA_before"]
