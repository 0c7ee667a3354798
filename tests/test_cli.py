"""The `longmoe` command end to end, always through a subprocess (what a user types).

Bad input: one `error:` line naming the field or row, exit 2, no traceback, no rank started.
Good input: the shipped CPU demo trains (2 gloo ranks, EP=2, FSDP2, full recompute, chunked
linear CE, 2 EP chunks) and its loss falls; a JSONL data run packs exactly the tokens it should;
a rank started by torchrun trains too; doctor and the paired harness answer in JSON.

The short commands are independent, so one module fixture starts them together (the machine has
2 cores and most of each command is importing torch); each test then reads its own result.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _seed import seed_for

TIMEOUT_S = 300
SMALL = ["--set", "data.seq_len=64", "--set", "data.prompt_len=16"]
VOCAB = 512  # tiny preset
# Pinned so a GPU machine runs the same CPU/gloo job; the recipe itself is used as shipped.
CPU_ENV = {**os.environ, "LONGMOE_BACKEND": "cpu"}


def longmoe(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "longmoe", *args], cwd=cwd, env=env or CPU_ENV,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`longmoe train` as one rank that torchrun started (the launcher's join-the-ranks path)."""
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "1", "-m", "longmoe", *args], cwd=cwd,
                          env=CPU_ENV, capture_output=True, text=True, timeout=TIMEOUT_S)


def error_lines(p: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# ---- input files ----------------------------------------------------------------------------

def _row(prompt, response, advantage, **extra) -> str:
    return json.dumps({"prompt": prompt, "response": response, "advantage": advantage, **extra})


# Rows 0-3 form step 1's batch (batch_size=4) and carry no old_logprobs, so step 1 is
# on-policy: every ratio is exactly 1 and the loss is -(sum of trained advantages) / their count,
# whatever the weights. Rows 4-5 (step 2) bring rollout log-probs. Row 2 overflows seq_len: the
# run truncates it (data.overlong=truncate); by default it is an error.
JSONL_SEQ_LEN = 24
JSONL_ROWS = [
    {"prompt": [5, 17, 300], "response": [9, 9, 42, 7, 100], "advantage": 0.75},
    {"prompt": [1], "response": [2, 3, 4, 5], "advantage": [0.5, -1.0, 2.0, 0.25],
     "loss_mask": [1, 0, 1, 1]},
    {"prompt": list(range(10, 30)), "response": list(range(200, 212)), "advantage": -0.5},
    {"prompt": [511, 0], "response": [8, 6, 4], "advantage": [1.5, -0.5, 0.125],
     "loss_mask": [0, 1, 1]},
    {"prompt": [3, 3], "response": [7, 8, 9], "advantage": 1.0,
     "old_logprobs": [-6.2, -6.3, -6.1]},
    {"prompt": [4], "response": [11, 12], "advantage": [-1.0, 0.5],
     "old_logprobs": [-6.0, -6.5], "loss_mask": [1, 1]},
]


def trained_advantages(row: dict, seq_len: int) -> list[float]:
    """The advantages of the response tokens that get a label: position len(prompt)+j-1 predicts
    response token j, and it must lie in [0, seq_len)."""
    out = []
    for j in range(len(row["response"])):
        t = len(row["prompt"]) + j - 1
        if not 0 <= t < seq_len or (row.get("loss_mask") and not row["loss_mask"][j]):
            continue
        a = row["advantage"]
        out.append(a[j] if isinstance(a, list) else a)
    return out


def write_inputs(d: Path):
    (d / "unknown_field.yaml").write_text("model: {preset: tiny}\nparallel: {foo: 1}\n")
    good = _row([1, 2], [3, 4], 1.0)
    (d / "bad_token.jsonl").write_text(good + "\n" + _row([1, 2], [3, VOCAB], 1.0) + "\n")
    (d / "malformed.jsonl").write_text(good + "\n\n" + '{"prompt": [1, 2], "response": [3\n')
    (d / "good.jsonl").write_text("\n".join(json.dumps(r) for r in JSONL_ROWS) + "\n")
    (d / "nan_advantage.jsonl").write_text(good + "\n" + good.replace("1.0", "NaN") + "\n")
    # Left by an earlier run: a run without --resume starts these files afresh.
    for name in ("jsonl_metrics.jsonl", "torchrun_metrics.jsonl"):
        (d / name).write_text(json.dumps({"step": 99, "loss": 1.0}) + "\n")


# ---- the short commands, started together ----------------------------------------------------

# id -> (argv, substrings the error line must contain)
BAD_INPUT = {
    "unknown_field": (["train", "--config", "unknown_field.yaml"], ["parallel.foo"]),
    "world_not_divisible_by_ep": (["train", "--config", "cpu_demo", "--nproc", "3"],
                                  ["parallel.ep", "3"]),
    "ep_exceeds_experts": (["train", "--config", "cpu_demo", "--set", "parallel.ep=16",
                            "--nproc", "16"], ["parallel.ep", "16", "num_experts"]),
    "ep_not_dividing_experts": (["train", "--config", "cpu_demo", "--set", "parallel.ep=3",
                                 "--nproc", "3"], ["parallel.ep", "num_experts", "divide"]),
    "token_out_of_vocab": (["train", "--config", "cpu_demo", "--set", "data.source=jsonl",
                            "--set", "data.path=bad_token.jsonl"],
                           ["bad_token.jsonl:2", str(VOCAB)]),
    "missing_data_file": (["train", "--config", "cpu_demo", "--set", "data.source=jsonl",
                           "--set", "data.path=no_such.jsonl"], ["data.path", "no_such.jsonl"]),
    "malformed_jsonl": (["train", "--config", "cpu_demo", "--set", "data.source=jsonl",
                         "--set", "data.path=malformed.jsonl"], ["malformed.jsonl:3", "JSON"]),
    "negative_steps": (["train", "--config", "cpu_demo", "--steps", "-1"], ["--steps"]),
    "resume_without_dir": (["train", "--config", "cpu_demo", "--resume"],
                           ["--resume", "--checkpoint-dir"]),
    "unknown_recipe": (["train", "--config", "no_such_recipe"], ["--config", "no_such_recipe"]),
    # a global batch of 8 on 2 ranks: 4 x 64 = 256 tokens per rank per layer
    "chunks_exceed_tokens": (["train", "--config", "cpu_demo", *SMALL, "--set", "data.batch_size=8",
                              "--set", "parallel.chunks=257"], ["parallel.chunks", "257", "256"]),
    "batch_not_divisible": (["train", "--config", "cpu_demo", "--set", "data.batch_size=33"],
                            ["data.batch_size", "33", "2 data ranks", "--nproc 2", "parallel.cp 1"]),
    "overlong_row": (["train", "--config", "cpu_demo", "--nproc", "1", "--set", "parallel.ep=1",
                      "--set", "data.source=jsonl", "--set", "data.path=good.jsonl",
                      "--set", f"data.seq_len={JSONL_SEQ_LEN}"],
                     ["good.jsonl:3: response", "data.seq_len=24", "data.overlong"]),
    "nan_advantage": (["train", "--config", "cpu_demo", "--set", "data.source=jsonl",
                       "--set", "data.path=nan_advantage.jsonl"],
                      ["nan_advantage.jsonl:2: advantage", "not a finite"]),
    "lr_nan": (["train", "--config", "cpu_demo", "--set", "optim.lr=.nan"], ["optim.lr", "finite"]),
    "checkpoint_every_negative": (["train", "--config", "cpu_demo", "--set",
                                   "train.checkpoint_every=-1"], ["train.checkpoint_every"]),
    # a named implementation this device cannot run (CPU runs compute in fp32 here)
    "impl_cannot_run": (["train", "--config", "cpu_demo", "--set", "impl.router_matmul=mixed"],
                        ["impl.router_matmul", "mixed", "bf16"]),
    "impl_needs_gpu": (["train", "--config", "cpu_demo", "--set", "impl.moe_rows=triton"],
                       ["impl.moe_rows", "triton", "GPU"]),
    "set_without_equals": (["train", "--config", "cpu_demo", "--set", "parallel.chunks"],
                           ["--set", "parallel.chunks"]),
    "paired_unknown_primitive": (["paired", "nope"], ["nope"]),
    "paired_unknown_impl": (["paired", "linear_ce", "--impl", "nope"], ["--impl", "nope"]),
    "bench_delta_precision": (["bench", "gated-delta", "--smoke", "--variants", "chunked@tf16"],
                              ["--variants", "chunked@tf16"]),
    "bench_delta_preset": (["bench", "gated-delta", "--preset", "qwen9"], ["model.preset", "qwen9"]),
}

# Every case is a process importing torch (seconds on 2 cores) and they share one path (UserError:
# one line, exit 2), so the fast tier launches one case of each kind of check; the slow tier the
# rest.
FAST_BAD_INPUT = {"unknown_field", "world_not_divisible_by_ep", "token_out_of_vocab",
                  "malformed_jsonl", "negative_steps", "chunks_exceed_tokens", "overlong_row",
                  "impl_cannot_run", "paired_unknown_primitive", "bench_delta_precision"}
SLOW = pytest.mark.slow

GOOD = {
    "doctor": ["doctor", "--json"],
    "paired_linear_ce": ["paired", "linear_ce", "--json", "--seed", str(seed_for("linear_ce"))],
    "paired_recompute": ["paired", "recompute", "--json", "--seed", str(seed_for("recompute"))],
    "paired_gated_delta": ["paired", "gated_delta", "--json", "--seed",
                           str(seed_for("gated_delta"))],
    "jsonl_run": ["train", "--config", "cpu_demo", "--nproc", "1", "--set", "parallel.ep=1",
                  "--set", "data.source=jsonl", "--set", "data.path=good.jsonl",
                  "--set", "data.batch_size=4", "--set", f"data.seq_len={JSONL_SEQ_LEN}",
                  "--set", "data.overlong=truncate", "--steps", "2",
                  "--metrics-out", "jsonl_metrics.jsonl"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    write_inputs(d)
    return d


def _selected(request, test: str, param: str) -> set:
    """The values of `param` among this run's selected cases of `test`."""
    return {item.callspec.params[param] for item in request.session.items
            if getattr(item, "originalname", None) == test and hasattr(item, "callspec")}


@pytest.fixture(scope="module")
def quick(workdir, request):
    """id -> Future of the CompletedProcess, for the commands of the selected tests. Doctor runs
    in the caller's environment (it reports what auto-detection sees); everything else is pinned
    to the CPU backend."""
    paired = {f"paired_{p}" for p in _selected(request, "test_paired_json_ok", "primitive")}
    bad = _selected(request, "test_bad_input_is_one_error_line", "case")
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {"doctor": pool.submit(longmoe, *GOOD["doctor"], cwd=workdir, env=dict(os.environ))}
    for name, argv in GOOD.items():
        if name != "doctor" and (not name.startswith("paired_") or name in paired):
            futures[name] = pool.submit(longmoe, *argv, cwd=workdir)
    for name, (argv, _) in BAD_INPUT.items():
        if name in bad:
            futures[name] = pool.submit(longmoe, *argv, cwd=workdir)
    futures["torchrun"] = pool.submit(
        torchrun, "train", "--config", "cpu_demo", *SMALL, "--set", "data.batch_size=4",
        "--set", "parallel.ep=1",
        "--steps", "1", "--metrics-out", "torchrun_metrics.jsonl", cwd=workdir)
    yield futures
    pool.shutdown(wait=True)


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [c if c in FAST_BAD_INPUT else pytest.param(c, marks=SLOW)
                                  for c in BAD_INPUT])
def test_bad_input_is_one_error_line(quick, case):
    _, must_name = BAD_INPUT[case]
    p = quick[case].result()
    errors = error_lines(p)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    assert len(errors) == 1, p.stderr
    for s in must_name:
        assert s in errors[0], f"{s!r} not in {errors[0]!r}"
    # Rejected before any rank started: no training banner, no rank being terminated.
    assert "rank(s) on" not in p.stdout
    assert "Terminating process" not in p.stderr


# ---- doctor and paired -----------------------------------------------------------------------

def test_doctor_json(quick):
    import torch
    p = quick["doctor"].result()
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    # metadata gives the release ("2.11.0"), torch.__version__ may add a local tag ("+cu130")
    assert report["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert report["backend_error"] is None
    assert report["backend"] in report["backends"]
    if not torch.cuda.is_available():  # ROCm torch reports through torch.cuda too
        assert report["backend"] == "cpu"
        assert report["dist_backend"] == "gloo"


@pytest.mark.parametrize("primitive", ["linear_ce", pytest.param("recompute", marks=SLOW),
                                       pytest.param("gated_delta", marks=SLOW)])
def test_paired_json_ok(quick, primitive):
    p = quick[f"paired_{primitive}"].result()
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout)
    assert res["primitive"] == primitive
    assert res["ok"] is True, res
    assert res["errors"] and all(math.isfinite(v) for v in res["errors"].values())
    assert res["max_error"] <= res["tolerance"]
    # stderr: the seed first (to rerun it), the one-line verdict last
    err = p.stderr.strip().splitlines()
    assert f"seed {seed_for(primitive)}" in err[0] and err[-1].endswith("PASS"), p.stderr


# ---- a JSONL data run ------------------------------------------------------------------------

def test_jsonl_run_packs_the_rows(quick, workdir):
    p = quick["jsonl_run"].result()
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(workdir / "jsonl_metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "grad_norm", "tokens_per_s"))
        assert r["tokens"] == 4 * JSONL_SEQ_LEN
    # Step 1 reads rows 0-3, step 2 rows 4, 5, 0, 1 (the source wraps around).
    picks = [[0, 1, 2, 3], [4, 5, 0, 1]]
    adv = [[a for i in pick for a in trained_advantages(JSONL_ROWS[i], JSONL_SEQ_LEN)]
           for pick in picks]
    assert [r["trained_tokens"] for r in rows] == [len(a) for a in adv]
    assert [r["truncated_samples"] for r in rows] == [1, 0]  # row 2, in step 1
    # stdout is a pipe here: every line whole, however long (no fold at the console's width)
    steps = [ln for ln in p.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2 and "imbalance" in steps[1], p.stdout
    assert steps[0].rstrip().endswith("data.overlong: 0 dropped, 1 truncated") and \
        len(steps[0]) > 160, p.stdout
    assert any("1 truncated (line 3)" in ln for ln in p.stdout.splitlines()), p.stdout
    # On-policy step: ratio 1, the clipped surrogate is -mean(advantage) over trained tokens.
    assert rows[0]["loss"] == pytest.approx(-sum(adv[0]) / len(adv[0]), rel=1e-5, abs=1e-6)


def test_under_torchrun(quick, workdir):
    p = quick["torchrun"].result()
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(workdir / "torchrun_metrics.jsonl")
    assert [r["step"] for r in rows] == [1]  # the stale row is gone
    assert math.isfinite(rows[0]["loss"]) and rows[0]["tokens"] == 4 * 64
    assert "1 rank(s) on cpu, ep=1" in p.stdout


# ---- the shipped CPU demo --------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(workdir):
    out = workdir / "demo_metrics.jsonl"
    p = longmoe("train", "--config", "cpu_demo", "--metrics-out", str(out), cwd=workdir)
    return p, (read_metrics(out) if out.exists() else [])


def test_demo_runs_and_logs_every_step(demo):
    p, rows = demo
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert [r["step"] for r in rows] == list(range(1, 41))  # recipe: train.steps=40
    for r in rows:
        for k in ("loss", "grad_norm", "tokens_per_s", "peak_mem_bytes"):
            assert isinstance(r[k], (int, float)) and math.isfinite(r[k]), (k, r)
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0
        # 2 ranks x 16 sequences x 128 tokens
        assert r["tokens"] == 2 * 16 * 128


def test_demo_loss_falls(demo):
    # Seen here: the first five steps average about -0.012, the last five about -0.054 (the
    # surrogate starts at 0: ratio 1, advantages that sum to zero per group).
    _, rows = demo
    losses = [r["loss"] for r in rows]
    assert len(losses) >= 10
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert abs(losses[0]) < 0.02, losses[:5]
    assert last < first - 0.02, (first, last)


def test_demo_prints_summary(demo):
    p, rows = demo
    assert "longmoe train: summary" in p.stdout
    for label in ("first_loss", "last_loss", "mean_tokens_per_s", "peak memory", "world"):
        assert label in p.stdout, label
    assert "2 rank(s) on cpu, ep=2, cp=1, fsdp=True, recompute=full, linear_ce=chunked" in p.stdout
    assert "chunked EP: chunks=2 (config), all-to-all process_group" in p.stdout


@pytest.mark.parametrize("variants,msg", [("chunked,foo", "'foo': unknown core"),
                                          ("sdpa:fa3", "SDPA backend must be one of"),
                                          ("chunked@low", "precision must be")])
def test_bench_gated_delta_rejects_bad_variants(capsys, variants, msg):
    from longmoe.cli import main
    assert main(["bench", "gated-delta", "--smoke", "--variants", variants]) == 2
    err = capsys.readouterr().err
    assert "--variants" in err and msg in err


@pytest.mark.parametrize("argv,flag,msg", [
    (["moe-layer", "--smoke", "--device", "cpu", "--rows-impl", "cuda"], "--rows-impl", "'cuda'"),
    (["moe-layer", "--smoke", "--device", "cpu", "--wgrad", "late"], "--wgrad", "'late'"),
    (["moe-layer", "--smoke", "--device", "cpu", "--wgrad", "auto,delayed,auto"], "--wgrad",
     "twice"),
    (["moe-layer", "--smoke", "--device", "cpu", "--nproc", "2", "--experts", "7"], "--experts",
     "multiple of --nproc (2)"),
    (["moe-layer", "--smoke", "--device", "cpu", "--fp32-matmul", "tf32"], "--fp32-matmul",
     "'tf32'"),
    (["moe-rows", "--configs", '{"BLOCK_H": 64}'], "--configs", "JSON list"),
    (["grouped-mm", "--impls", "torch,cublas"], "--impls", "'cublas'"),
    (["grouped-mm", "--configs", "[1]"], "--configs", "JSON list"),
])
def test_bench_rejects_bad_flags(capsys, argv, flag, msg):
    from longmoe.cli import main
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and msg in err and len(err.strip().splitlines()) == 1, err


def test_bench_moe_rows_and_grouped_mm_run_on_cpu(tmp_path):
    # No Triton on a plain CPU: the reference rows and GEMM run, the rest is reported skipped.
    import json
    from longmoe.cli import main
    out = tmp_path / "rows.json"
    assert main(["bench", "moe-rows", "--tokens", "8", "--top-k", "2", "--hidden", "24",
                 "--ffn", "8", "--iters", "1", "--device", "cpu", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert {r["impl"] for r in rep["rows"]} == {"reference"} and rep["triton_skipped"]
    assert {r["op"] for r in rep["rows"]} == {"combine", "combine_bwd", "dispatch_bwd", "swiglu",
                                              "swiglu_bwd+dot"}
    out = tmp_path / "gmm.json"
    assert main(["bench", "grouped-mm", "--tokens", "8", "--experts", "3", "--hidden", "16",
                 "--ffn", "8", "--impls", "reference,torch", "--iters", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert {r["impl"] for r in rep["rows"]} == {"reference"} and "torch" in rep["skipped"]
    assert len(rep["rows"]) == 6 and all(r["ms"] > 0 for r in rep["rows"])


# ---- kernels compile -------------------------------------------------------------------------

def test_kernels_compile_shows_progress_and_one_summary_line(capsys):
    from longmoe.cli import main
    argv = ["kernels", "compile", "--target", "sm_90", "--only", "ce_row_stats+entropy"]
    assert main([*argv, "--json"]) == 0
    cap = capsys.readouterr()
    reports = json.loads(cap.out)
    n = len(reports)
    assert n > 0 and all(r["ok"] for r in reports)
    summary = f"{n} configs compiled for 1 target: {n} ok, 0 spills, 0 failed"
    assert cap.err.strip().splitlines()[-1] == summary
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert cap.out.strip().splitlines() == [summary]  # no table without --verbose
    progress = [ln for ln in cap.err.splitlines() if ln.startswith("sm_90: ")]
    assert progress and progress[-1].startswith(f"sm_90: {n} configs: {n} ok")
    assert main([*argv, "--verbose"]) == 0
    cap = capsys.readouterr()
    assert "longmoe kernels compile" in cap.out and cap.out.strip().endswith(summary)


def test_kernels_compile_counts_spills_and_failures():
    from longmoe.ops.kernels.aot import CompileReport
    from longmoe.ops.kernels.aot_cli import outcome, summary_line
    ok = CompileReport("k", "v", "sm_90", {}, ok=True, regs=40, spills=0, shared=0)
    spill = CompileReport("k", "v", "sm_90", {}, ok=False, regs=255, spills=96, shared=0)
    broken = CompileReport("k", "v", "gfx942", {}, ok=False, error="CompilationError: x")
    over = CompileReport("k", "v", "gfx942", {}, ok=False, regs=600, spills=0, shared=0)
    assert [outcome(r) for r in (ok, spill, broken, over)] == ["ok", "spills", "failed", "failed"]
    assert summary_line([ok, spill, broken, over], ["sm_90", "gfx942"]) == \
        "4 configs compiled for 2 targets: 1 ok, 1 spills, 2 failed"


def test_kernels_compile_bad_flags_are_one_line(capsys):
    from longmoe.cli import main
    for argv, flag in ((["--target", "sm_42"], "--target"),
                       (["--target", "sm_90", "--only", "no_such_kernel"], "--only")):
        assert main(["kernels", "compile", *argv]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and flag in err[0], err


def test_paired_help_lists_every_primitive():
    from longmoe.paired.cli import PRIMITIVES
    p = subprocess.run([sys.executable, "-m", "longmoe", "paired", "--help"],
                       capture_output=True, text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0
    for name, what in PRIMITIVES.items():
        assert any(ln.split()[:1] == [name] and what in ln for ln in p.stdout.splitlines()), name
