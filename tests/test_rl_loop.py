"""The closed RL loop of examples/rl_loop.py on 2 gloo ranks in real processes: longmoe's
PolicyTrainer hands its weights to a transformers Qwen3.5-MoE every iteration, transformers
samples the sort task, GRPO updates through forward_backward / optim_step.

  - the mean reward rises clearly, and the same loop at learning rate 0 (AdamW then leaves every
    weight unchanged) shows no rise: the rise is learning, not the
    prompts or the sampler;
  - after every hand-off transformers' teacher-forced log-probs of the rollouts equal
    compute_logprobs within HF_TOL (fp32), while the policy moved between hand-offs by far
    more than that (a stale or partial hand-off would show); so the TIS weights
    exp(old - rollout) are 1 to fp32 rounding: they correct sampling numerics only.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _seed import seed_for

pytest.importorskip("transformers")  # the rollout engine (longmoe[dev])

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "rl_loop.py"
# Largest gap seen over 4 seeds x 20 iterations: 4.5e-6 (the gap grows as the policy sharpens).
HF_TOL = 2e-5
ITERATIONS = 16
K = 3  # iterations averaged at each end of the curve


def _loop(tmp_path, name, *flags):
    out = tmp_path / f"{name}.jsonl"
    cmd = [sys.executable, str(EXAMPLE), "--nproc", "2", "--metrics-out", str(out), *flags]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def _mean(rows, key="reward"):
    return sum(r[key] for r in rows) / len(rows)


def _check_hand_offs(rows):
    for r in rows:
        it = r["iteration"]
        assert r["hf_vs_ours"] <= HF_TOL, (it, r["hf_vs_ours"])
        assert r["rollout_vs_ours"] <= HF_TOL, (it, r["rollout_vs_ours"])
        assert abs(r["tis_weight"] - 1) <= 1e-5 and r["tis_clip_frac"] == 0, (it, r)
        assert r["skipped_steps"] == 0, it


@pytest.mark.slow  # the slow tier: the example's whole RL loop
def test_reward_rises_and_every_hand_off_matches_transformers(tmp_path):
    seed = str(seed_for("rl_loop") % 1000)
    learn = _loop(tmp_path, "learn", "--iterations", str(ITERATIONS), "--lr", "2e-3",
                  "--seed", seed)
    assert [r["iteration"] for r in learn] == list(range(1, ITERATIONS + 1))
    _check_hand_offs(learn)
    # Every iteration's updates moved the policy by far more than HF_TOL on its own tokens, so
    # the next hand-off's match is not the engine keeping old weights.
    assert min(r["kl_old_new"] for r in learn) > 1e-3, [r["kl_old_new"] for r in learn]
    first, last = _mean(learn[:K]), _mean(learn[-K:])

    # The control: the same loop at lr 0, whose steps leave every weight unchanged. Its policy is
    # stationary, so its curve's ends differ by sampling noise at any length: a short run costs
    # less and tests the same thing.
    control = _loop(tmp_path, "control", "--iterations", str(2 * K), "--lr", "0",
                    "--seed", seed)
    _check_hand_offs(control)
    assert max(r["kl_old_new"] for r in control) < 1e-9
    c_first, c_last = _mean(control[:K]), _mean(control[-K:])
    assert control[0]["reward"] == learn[0]["reward"]  # same prompts, sampler, first policy
    assert abs(c_last - c_first) < 0.05, (c_first, c_last)
    assert last - first > 0.1, (first, last)
    assert last > c_last + 0.1, (last, c_last)


def _example():
    """The example as a module."""
    spec = importlib.util.spec_from_file_location("rl_loop_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module's namespace through it
    spec.loader.exec_module(mod)
    return mod


def test_task_rewards_and_group_advantages():
    ex = _example()
    prompts = torch.tensor([[3, 1, 2, 1, 4], [0, 2, 3, 3, 4]])
    want = {"sort": [[1, 1, 2, 3], [0, 2, 3, 3]], "reverse": [[1, 2, 1, 3], [3, 3, 2, 0]],
            "copy": [[3, 1, 2, 1], [0, 2, 3, 3]]}
    for name, answers in want.items():
        task = ex.Task(name, digits=4, length=4)
        assert task.sep == 4 and task.vocab_size == 5
        assert task.answers(prompts).tolist() == answers
        wrong_two = torch.tensor(answers)
        wrong_two[0, :2] = (wrong_two[0, :2] + 1) % 4
        assert task.rewards(prompts, wrong_two).tolist() == [0.5, 1.0]
    gen = torch.Generator().manual_seed(seed_for("rl_loop task"))
    p = ex.Task("sort", 5, 3).prompts(7, gen)
    assert p.shape == (7, 4) and (p[:, -1] == 5).all() and (p[:, :3] < 5).all()

    r = torch.rand(5, 6, generator=gen, dtype=torch.float64)
    r[2] = 0.25  # a group that scored alike teaches nothing
    a = ex.grpo_advantages(r)
    torch.testing.assert_close(a.mean(1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(a[[0, 1, 3, 4]].std(1, unbiased=False),
                               torch.ones(4, dtype=torch.float64), atol=1e-4, rtol=0)
    assert (a[2] == 0).all()
    assert (a.argsort(1) == r.argsort(1))[[0, 1, 3, 4]].all()


def test_bad_flags_are_one_line_before_any_rank_starts():
    for flags, field in ((["--task", "shuffle"], "--task"), (["--lr", "-1"], "optim.lr"),
                         (["--set", "loss.clip_low=1.5"], "loss.clip_low")):
        p = subprocess.run([sys.executable, str(EXAMPLE), *flags], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2, (flags, p.stderr[-2000:])
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), (flags, p.stderr)
        assert p.stdout == ""
