"""Checkpoints written by an earlier longmoe still resume: tests/data/ckpt_v1/ holds one written by
`longmoe train` (2 gloo ranks, EP 2 x FSDP2) and one by `PolicyTrainer.save` (one process, a
Gated DeltaNet and an attention layer), with what the longmoe that wrote them computed after
loading them (tests/data/make_ckpt_fixture.py says how they were made and how to rewrite them).

Each is verified (`longmoe checkpoint verify`), loaded through the public path, compared tensor
by tensor with what the files hold (weights and AdamW moments, bit for bit), and continued: the
losses and gradient norms of the next steps are those recorded when the fixture was written.
Those match bit for bit on the machine that wrote them (the generator checks each twice); LOSS_TOL
leaves room for another CPU rounding fp32 matmuls differently; a lost AdamW state or schedule
moves the second step's numbers far more (both fixtures train at lr 0.02). The CLI resume runs 2
ranks for 2 steps: the slow tier, with the other CLI checkpoint runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).resolve().parent / "data"
FIXTURE = DATA / "ckpt_v1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
LOSS_TOL = {"rel": 1e-6, "abs": 1e-9}
EXPERT = "/expert"


def _generator():
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_ckpt_fixture",
                                                  DATA / "make_ckpt_fixture.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def one_thread():
    """The fixture's numbers were computed with one intra-op thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def copy_of(kind: str, tmp_path: Path) -> Path:
    dst = tmp_path / kind
    shutil.copytree(FIXTURE / kind / "ck", dst)
    return dst


def stored(step_dir: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    """What the files hold, read by DCP itself (no longmoe code): "param:<name>" and
    "<moment>:<name>", expert stacks reassembled from their per-expert keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp_path / "stored.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    sd = torch.load(out, weights_only=True)
    flat = {f"param:{k}": v for k, v in sd["model"].items()}
    for k, state in sd["optim"]["state"].items():
        for moment in ("exp_avg", "exp_avg_sq"):
            flat[f"{moment}:{k}"] = state[moment]
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for k in [k for k in flat if EXPERT in k]:
        name, index = k.split(EXPERT)
        stacks.setdefault(name, {})[int(index)] = flat.pop(k)
    for name, rows in stacks.items():
        assert sorted(rows) == list(range(len(rows))), name
        flat[name] = torch.stack([rows[i] for i in range(len(rows))])
    return flat


def live(pt) -> dict[str, torch.Tensor]:
    """The trainer's weights (buffers included) and AdamW moments under the same names (one
    process: plain tensors; the recompute wrapper's `block.` level is not part of a name)."""
    out = {f"param:{k.replace('.block.', '.')}": v for k, v in pt.model.state_dict().items()}
    for name, p in pt.model.named_parameters():
        name = name.replace(".block.", ".")
        for moment in ("exp_avg", "exp_avg_sq"):
            out[f"{moment}:{name}"] = pt.optim.state[p][moment]
    return out


def assert_same_tensors(got: dict, want: dict):
    assert got.keys() == want.keys()
    assert len(want) > 40  # weights and both moments of every parameter
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"loaded tensors differ from the checkpoint's: {differ[:5]}"


@pytest.mark.parametrize("kind", ["cli", "api"])
def test_fixture_verifies(kind, tmp_path, capsys):
    from longmoe.cli import main
    assert main(["checkpoint", "verify", str(copy_of(kind, tmp_path)), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["latest"] == "step-00000002"
    assert [c["step"] for c in report["checkpoints"]] == [2]


def test_policy_trainer_save_resumes(tmp_path, one_thread):
    from longmoe.api import PolicyTrainer
    from longmoe.train.config import from_dict
    gen, exp = _generator(), EXPECTED["api"]
    ck = copy_of("api", tmp_path)
    pt = PolicyTrainer(from_dict(exp["run"]))
    try:
        assert Path(pt.load(ck)).name == "step-00000002"
        assert pt.step == exp["saved_step"]
        assert_same_tensors(live(pt), stored(ck / "step-00000002", tmp_path))
        stats = pt.forward_backward(gen.samples(exp["batches"][2]))
        info = pt.optim_step()
        nxt = pt.forward_backward(gen.samples(exp["batches"][3]))
    finally:
        pt.close()
    want = exp["after_load"]
    assert (pt.step, info["lr"]) == (want["step"], want["lr"])
    assert stats["loss"] == pytest.approx(want["loss"], **LOSS_TOL)
    assert info["grad_norm"] == pytest.approx(want["grad_norm"], **LOSS_TOL)
    assert nxt["loss"] == pytest.approx(want["next_loss"], **LOSS_TOL)


def cli_run(args: list[str], **changes):
    """The RunConfig of `longmoe train ARGS` with `changes` set on top."""
    from longmoe.train.config import load_run_config
    config = args[args.index("--config") + 1]
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    return load_run_config(config, sets + [f"{k}={v}" for k, v in changes.items()])


def test_cli_checkpoint_loads_into_one_process(tmp_path, one_thread):
    """The 2-rank EP 2 x FSDP2 checkpoint into one process with every expert (resharding)."""
    from longmoe.api import PolicyTrainer
    ck = copy_of("cli", tmp_path)
    pt = PolicyTrainer(cli_run(EXPECTED["cli"]["args"], **{"parallel.ep": 1,
                                                           "parallel.fsdp": "false"}))
    try:
        pt.load(ck)
        assert pt.step == EXPECTED["cli"]["saved_step"]
        assert_same_tensors(live(pt), stored(ck / "step-00000002", tmp_path))
    finally:
        pt.close()


@pytest.mark.slow
def test_cli_resume_continues_as_written(tmp_path):
    exp = EXPECTED["cli"]
    copy_of("cli", tmp_path)
    env = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "longmoe", "train", *exp["args"], "--steps",
                        str(exp["steps"]), "--checkpoint-dir", "cli", "--resume",
                        "--metrics-out", "m.jsonl"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout + p.stderr
    rows = [json.loads(ln) for ln in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [r["step"] for r in exp["resumed"]] == [3, 4]
    for got, want in zip(rows, exp["resumed"]):
        assert got["lr"] == want["lr"]
        assert got["loss"] == pytest.approx(want["loss"], **LOSS_TOL)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], **LOSS_TOL)
