"""Steps that must not change the weights, through `longmoe train` on 2 gloo ranks (the cpu_demo
layout scaled down), and the one all-reduced flag behind them on real process groups.

- A huge learning rate makes step 2 onwards non-finite: those steps apply nothing, the run stops
  after train.max_bad_steps of them with exit code 3 and one line, nothing is saved at the stop,
  `latest` holds the step-1 weights (finite), and the metrics file is strict JSON (null for NaN).
  Resumed, it rewrites the metrics rows after the resumed step instead of appending duplicates.
- JSONL data: a row whose float32-finite 1e38 advantage gives an infinite gradient norm (on one
  rank only), a step whose rows are all masked (no trained token) and a truncated row. Checkpoints
  after every step show the skipped steps left weights, AdamW moments and step counts, and the
  router's expert bias exactly as they were, while the learning-rate schedule advanced.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

TIMEOUT_S = 300
SMALL = ["--config", "cpu_demo", "--set", "data.batch_size=8", "--set", "data.seq_len=64",
         "--set", "data.prompt_len=16"]
# 1e20: step 1's update leaves finite weights of that size, whose step-2 logits overflow.
NAN_RUN = [*SMALL, "--set", "optim.lr=1e20", "--set", "train.checkpoint_every=1", "--steps", "8",
           "--set", "train.max_bad_steps=2", "--checkpoint-dir", "ckN", "--metrics-out", "mN.jsonl"]
ENV = {**os.environ, "LONGMOE_BACKEND": "cpu", "OMP_NUM_THREADS": "1"}

JSONL_SEQ_LEN = 16
R = list(range(30, 44))  # a 14-token response: prompt 3 + 14 > seq_len + 1 is cut to 14 tokens


def _rows():
    ok = {"prompt": [1, 2, 3], "response": [5, 6, 7, 8], "advantage": [0.5, -0.5, 1.0, -1.0]}
    return [
        ok, {"prompt": [4, 5, 6], "response": R + [50, 51], "advantage": 0.25},  # step 1
        ok, {"prompt": [7], "response": [9, 10, 11], "advantage": 1e38},        # step 2
        {**ok, "loss_mask": [0, 0, 0, 0]},                                        # step 3
        {"prompt": [2], "response": [3, 4], "advantage": -1.0, "loss_mask": [0, 0]},
        {"prompt": [9, 9], "response": [12, 13, 14], "advantage": [1.0, -2.0, 0.5],
         "old_logprobs": [-6.0, -6.2, -5.9]}, ok,                                 # step 4
    ]


JSONL_RUN = ["--config", "cpu_demo", "--set", "data.source=jsonl", "--set", "data.path=d.jsonl",
             "--set", "data.batch_size=2", "--set", f"data.seq_len={JSONL_SEQ_LEN}",
             "--set", "data.overlong=truncate", "--set", "optim.warmup_steps=8",
             "--set", "model.expert_bias_rate=0.01", "--set", "train.checkpoint_every=1",
             "--steps", "4", "--checkpoint-dir", "ckJ", "--metrics-out", "mJ.jsonl"]


def longmoe(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longmoe", "train", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _no_constants(name):
    raise ValueError(f"{name} is not JSON")


def strict_rows(path: Path) -> list[dict]:
    """Parsed with a reader that, like strict JSON readers, rejects NaN and Infinity."""
    return [json.loads(ln, parse_constant=_no_constants)
            for ln in path.read_text().splitlines() if ln.strip()]


def state(step_dir: Path, tmp: Path) -> dict:
    """A checkpoint's model and optimizer state, read back as one torch file."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = tmp / f"{step_dir.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(str(step_dir), str(out))
    return torch.load(out, weights_only=True)


def tensors(sd: dict, prefix=()):
    """(key path, tensor) for every tensor of the model and the optimizer's per-parameter state
    (param_groups hold the learning rate, which is meant to move)."""
    for k, v in sd.items():
        if k == "param_groups":
            continue
        if isinstance(v, dict):
            yield from tensors(v, prefix + (k,))
        elif torch.is_tensor(v):
            yield prefix + (k,), v


def same(a: dict, b: dict) -> bool:
    ta, tb = dict(tensors(a)), dict(tensors(b))
    assert ta.keys() == tb.keys() and len(ta) > 50
    return all(torch.equal(ta[k], tb[k]) for k in ta)


def error_lines(p) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("guard")
    (d / "d.jsonl").write_text("\n".join(json.dumps(r) for r in _rows()) + "\n")
    with ThreadPoolExecutor(max_workers=2) as pool:
        nan, jsonl = pool.submit(longmoe, d, *NAN_RUN), pool.submit(longmoe, d, *JSONL_RUN)
        out = {"dir": d, "nan": nan.result(), "jsonl": jsonl.result()}
    out["nan_metrics"] = (d / "mN.jsonl").read_text()
    out["nan_dirs"] = sorted(p.name for p in (d / "ckN").iterdir() if p.name != ".lock")
    out["nan_latest"] = (d / "ckN" / "latest").read_text().strip()
    out["s1"], out["s2"] = (state(d / "ckN" / f"step-0000000{s}", d) for s in (1, 2))
    out["resumed"] = longmoe(d, *NAN_RUN, "--resume")
    return out


def test_nonfinite_run_stops_with_exit_3_and_one_line(runs):
    p = runs["nan"]
    assert p.returncode == 3, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = error_lines(p)
    assert len(errors) == 1, p.stderr
    assert "steps 2-3 had a non-finite loss or gradient norm and applied no update" in errors[0]
    assert "train.max_bad_steps=2" in errors[0] and "ckN/step-00000002" in errors[0], errors[0]


def test_nonfinite_steps_are_logged_as_strict_json(runs):
    rows = [json.loads(ln, parse_constant=_no_constants)
            for ln in runs["nan_metrics"].splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["skipped"] is None and rows[0]["bad_steps"] == 0
    assert math.isfinite(rows[0]["loss"]) and math.isfinite(rows[0]["grad_norm"])
    assert [r["skipped"] for r in rows[1:]] == ["nonfinite"] * 2
    assert [r["bad_steps"] for r in rows[1:]] == [1, 2]
    assert all(r["grad_norm"] is None for r in rows[1:])  # NaN, written as null
    out = " ".join(runs["nan"].stdout.split())
    assert "gnorm nan" in out and "SKIPPED: non-finite loss or gradient norm (2 in a row)" in out


def test_good_checkpoint_stays_latest(runs):
    d = runs["dir"] / "ckN"
    # Saved after steps 1 and 2 (step 2 skipped: the step-1 state), nothing at the stop (step 3).
    assert runs["nan_dirs"] == ["latest", "step-00000001", "step-00000002"]
    assert runs["nan_latest"] == "step-00000002"
    assert json.loads((d / "step-00000002" / "meta.json").read_text())["step"] == 2
    s1, s2 = runs["s1"], runs["s2"]
    assert all(torch.isfinite(t).all() for _, t in tensors(s2))
    assert same(s1, s2)  # the skipped step changed no weight and no AdamW state
    big = max(float(t.abs().max()) for k, t in tensors(s1) if k[0] == "model")
    assert big > 1e15  # lr 1e20 really moved the weights: the later NaN is not a fluke of data


def test_resume_rewrites_metrics_after_the_resumed_step(runs):
    p = runs["resumed"]
    assert p.returncode == 3, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "at step 2" in p.stdout, p.stdout
    rows = strict_rows(runs["dir"] / "mN.jsonl")
    # Steps 1-2 from the first run, 3-4 from this one (step 3 again, not twice).
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    first = json.loads(runs["nan_metrics"].splitlines()[0], parse_constant=_no_constants)
    assert rows[0] == first
    # Step 3 (skipped again, so the step-1 weights) was saved; the stop at step 4 saved nothing.
    assert (runs["dir"] / "ckN" / "latest").read_text().strip() == "step-00000003"
    assert not (runs["dir"] / "ckN" / "step-00000004").exists()


def test_skipped_steps_change_nothing_but_the_schedule(runs, tmp_path):
    p = runs["jsonl"]
    assert p.returncode == 0, p.stderr[-3000:]
    d = runs["dir"]
    rows = strict_rows(d / "mJ.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["skipped"] for r in rows] == [None, "nonfinite", "no_tokens", None]
    assert [r["bad_steps"] for r in rows] == [0, 1, 1, 0]  # a step without tokens is not bad
    assert rows[2]["trained_tokens"] == 0 and rows[2]["masked_samples"] == 2
    assert [r["truncated_samples"] for r in rows] == [1, 0, 0, 0]
    assert rows[1]["grad_norm"] is None or rows[1]["loss"] is None  # non-finite: null
    lrs = [r["lr"] for r in rows]
    assert lrs == sorted(lrs) and len(set(lrs)) == 4  # warmup went on through the skipped steps
    out = " ".join(p.stdout.split())  # the console wraps long lines
    assert "SKIPPED: no trained tokens, no update" in out
    assert "data.overlong=truncate: 0 dropped, 1 truncated (line 2)" in out, out
    assert "2 with no trained token (loss_mask all 0; line 5, 6)" in out
    ck = [state(d / "ckJ" / f"step-{s:08d}", tmp_path) for s in (1, 2, 3, 4)]
    assert same(ck[0], ck[1]) and same(ck[1], ck[2])
    assert not same(ck[2], ck[3])  # the comparison can fail: step 4 did update
    bias = [dict(tensors(c))[("model", "layers.0.moe.router.expert_bias")] for c in ck]
    assert torch.equal(bias[0], bias[2]) and not torch.equal(bias[2], bias[3])


# ---- the flag itself, on 2 gloo ranks --------------------------------------------------------

def _flag_rank(rank, world, backend):
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.setup import all_finite, clip_grad_norm
    layout = build_layout("cpu", 1)
    lin = torch.nn.Linear(3, 2)
    g = torch.Generator().manual_seed(rank)
    for p in lin.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    grads = [p.grad.clone() for p in lin.parameters()]
    local_sq = sum(float((x.double() ** 2).sum()) for x in grads)
    out = {"local_sq": local_sq}
    # finite everywhere: the norm over both ranks (replicated grads count 1/world), clipped
    out["ok"] = clip_grad_norm(lin, 0.1, layout, loss=torch.tensor(1.5))
    out["clipped"] = [p.grad.clone() for p in lin.parameters()]
    for p, x in zip(lin.parameters(), grads):
        p.grad = x.clone()
    # a NaN loss on rank 1 only: both ranks skip, gradients left as they were
    out["nan_loss"] = clip_grad_norm(lin, 0.1, layout,
                                     loss=torch.tensor(float("nan") if rank == 1 else 0.5))
    out["unclipped"] = all(torch.equal(p.grad, x) for p, x in zip(lin.parameters(), grads))
    lin.weight.grad[0, 0] = float("inf") if rank == 0 else lin.weight.grad[0, 0]
    out["inf_grad"] = clip_grad_norm(lin, 0.0, layout, loss=torch.tensor(0.5))
    w = [torch.ones(4), torch.ones(2, 2)]
    out["finite_params"] = all_finite(w, layout, torch.device("cpu"))
    if rank == 1:
        w[1][1, 0] = float("nan")
    out["nan_params"] = all_finite(w, layout, torch.device("cpu"))
    return out


def test_one_flag_for_all_ranks():
    from longmoe.paired.spawn import run_ranks
    r0, r1 = run_ranks(_flag_rank, 2)
    want = math.sqrt((r0["local_sq"] + r1["local_sq"]) / 2)
    for r in (r0, r1):
        norm, finite = r["ok"]
        assert finite and norm == pytest.approx(want, rel=1e-6)
        assert norm > 0.1  # so the clip scaled
        assert r["nan_loss"][1] is False and r["unclipped"]
        assert math.isfinite(r["nan_loss"][0])  # the norm itself was fine: the loss decided
        assert r["inf_grad"][1] is False and not math.isfinite(r["inf_grad"][0])
        assert r["finite_params"] is True and r["nan_params"] is False
    clipped_sq = sum(float((c.double() ** 2).sum()) for r in (r0, r1) for c in r["clipped"])
    assert math.sqrt(clipped_sq / 2) == pytest.approx(0.1, rel=1e-4)


def test_clip_norm_over_mixed_dtypes_matches_fp64():
    """One fused norm per (device, copies) group: bf16 and fp32 gradients of odd shapes, an
    empty one and a parameter without a gradient, against the fp64 sum of squares; the clip
    scales every gradient by the same factor."""
    from longmoe.parallel.mesh import build_layout
    from longmoe.train.setup import clip_grad_norm
    g = torch.Generator().manual_seed(random.randrange(2**31))
    shapes = [((7, 13), torch.bfloat16), ((1,), torch.float32), ((0, 5), torch.float32),
              ((3, 5, 11), torch.bfloat16), ((257,), torch.float32), ((4,), torch.float32)]
    m = torch.nn.Module()
    for i, (s, dt) in enumerate(shapes):
        p = torch.nn.Parameter(torch.zeros(s, dtype=dt))
        if i != len(shapes) - 1:
            p.grad = (torch.randn(s, generator=g) * 3).to(dt)
        m.register_parameter(f"p{i}", p)
    before = [p.grad.clone() for p in m.parameters() if p.grad is not None]
    want = math.sqrt(sum(float((x.double() ** 2).sum()) for x in before))
    norm, finite = clip_grad_norm(m, want / 4, build_layout("cpu", 1))
    assert finite and norm == pytest.approx(want, rel=1e-6)
    after = [p.grad for p in m.parameters() if p.grad is not None]
    for b, a in zip(before, after):
        tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(a.double(), b.double() / 4, rtol=tol, atol=0)
