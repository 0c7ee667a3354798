"""verl's own trainer end to end on CPU: `python -m verl.trainer.main_ppo` (verl's hydra main, its
Ray TaskRunner, RayPPOTrainer, the hybrid ActorRolloutRefWorker on the longmoe engine, agent-loop
rollouts, the reward loop with a custom reward function, GRPO advantages, update_actor, the
weight sync to the rollout, checkpoints), unmodified, for a few steps of a tiny random model.

vLLM and SGLang do not run here: tests/_verl_e2e.py registers a transformers stand-in rollout
and a host platform with verl's registries in every process of the run (through verl's
VERL_USE_EXTERNAL_MODULES). What the tests read is what verl logs (its console logger) and the
weights the stand-in received at each sync.
"""

import json
import math
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (verl's dependency)")
pytest.importorskip("cachetools", reason="verl's rollout router imports cachetools")

pytestmark = pytest.mark.slow

import _verl_e2e as e2e  # noqa: E402
from _verl_e2e import N, PROMPTS, RESPONSE, TINY  # noqa: E402

_NUM = re.compile(r"^(?:np\.\w+\()?(-?[\d.eE+-]+|nan|inf|-inf)\)?$")


def step_metrics(log):
    """{step: {metric: float}} from verl's console logger lines `step:N - key:value - ...`."""
    steps = {}
    for line in log.splitlines():
        m = re.search(r"step:(\d+) - (.*)$", line)
        if not m:
            continue
        metrics = {}
        for item in m.group(2).split(" - "):
            key, _, value = item.strip().rpartition(":")
            num = _NUM.match(value)
            if key and num:
                metrics[key] = float(num.group(1))
        steps[int(m.group(1))] = metrics
    return steps


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The tiny model as a Hugging Face directory (with the toy tokenizer) and verl's parquet."""
    tmp = tmp_path_factory.mktemp("main_ppo")
    hf = e2e.write_model(tmp / "hf", TINY)
    train = e2e.write_data(tmp / "train.parquet", 4 * PROMPTS, seed=0)
    val = e2e.write_data(tmp / "val.parquet", PROMPTS, seed=1)
    return hf, train, val


def run_main_ppo(inputs, out, steps, extra=(), save_freq=-1, freeze=False, v1=False):
    """verl's main_ppo in a subprocess: (returncode, log, step metrics, weight syncs)."""
    hf, train, val = inputs
    out.mkdir(parents=True, exist_ok=True)
    record = out / "syncs.jsonl"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo",
           *e2e.main_ppo_overrides(hf, train, val, out, steps, save_freq, v1), *extra]
    env = {**os.environ, **e2e.main_ppo_env(record, freeze), "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    (out / "main_ppo.log").write_text(log)
    syncs = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return proc.returncode, log, step_metrics(log), syncs


def _finite(metrics, *keys):
    for k in keys:
        assert k in metrics, (k, sorted(metrics))
        assert math.isfinite(metrics[k]), (k, metrics[k])


def _tail(log, n=60):
    return "\n".join(log.splitlines()[-n:])


@pytest.mark.parametrize("trainer", ["legacy", "v1"])
def test_main_ppo_grpo_steps_sync_the_rollout_and_save(inputs, tmp_path, trainer):
    """Three GRPO steps, the fused ppo_loss path (bench/verl_e2e.sh's settings), a checkpoint at
    the last step, on verl's legacy trainer (main_ppo_v0's RayPPOTrainer) and its default v1
    trainer (over TransferQueue). The rollout's log-probs agree with the engine's old
    log-probs at every step (measured 1e-7 to 2e-7), so the stand-in generated with the weights
    the trainer held (with LONGMOE_STANDIN_FREEZE=1 they differ by 0.2 at the second step,
    legacy trainer); the synced weights start at the model directory's and change after every
    update."""
    if trainer == "v1":
        pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue")
    steps = 3
    rc, log, metrics, syncs = run_main_ppo(inputs, tmp_path, steps, save_freq=steps,
                                           v1=trainer == "v1")
    assert rc == 0, _tail(log)
    assert sorted(metrics) == list(range(1, steps + 1)), _tail(log)
    for step, m in metrics.items():
        assert m["training/global_step"] == step
        _finite(m, "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl",
                "critic/score/mean", "critic/advantages/max")
        assert m["actor/grad_norm"] > 0
        assert m["actor/lr"] == pytest.approx(1e-2)
        assert 0.0 <= m["critic/score/mean"] <= 1.0
        # the stand-in stops at data.max_response_length (no <|im_end|> drawn from 512 words)
        assert m["response_length/mean"] <= RESPONSE
        # the stand-in's sampling log-probs against the engine's recomputation (verl's metric)
        assert m["training/rollout_probs_diff_max"] < 1e-4, (step, m)
    # one sync before the first rollout and one after each update, each after the requests
    # of the rollouts before it
    assert [s["global_steps"] for s in syncs] == list(range(steps + 1)), syncs
    assert [s["requests"] for s in syncs] == [i * PROMPTS * N for i in range(steps + 1)]
    assert syncs[0]["digest"] == e2e.directory_digest(inputs[0])
    digests = [s["digest"] for s in syncs]
    assert len(set(digests)) == len(digests), digests
    # verl's checkpoint: its tracker file, and the engine's save under global_step_<N>/actor
    # (step-<optimizer steps>: one mini-batch per step here)
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(steps)
    saved = ckpt / f"global_step_{steps}" / "actor" / f"step-{steps:08d}"
    assert (saved / "manifest.json").exists(), sorted(ckpt.rglob("*"))


def test_main_ppo_reference_policy_and_kl_loss(inputs, tmp_path):
    """The same run with verl's KL loss: the reference policy on the longmoe engine in the same
    worker (ActorRolloutRef), verl's unfused ppo_loss. At the first step actor and reference are
    the same weights (KL 0); after an update they differ."""
    extra = ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
             "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
             "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=64"]
    rc, log, metrics, syncs = run_main_ppo(inputs, tmp_path, 2, extra)
    assert rc == 0, _tail(log)
    assert sorted(metrics) == [1, 2], _tail(log)
    for m in metrics.values():
        _finite(m, "actor/pg_loss", "actor/kl_loss", "actor/grad_norm")
        assert m["training/rollout_probs_diff_max"] < 1e-4
    assert metrics[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert metrics[2]["actor/kl_loss"] > 1e-6
    assert len(syncs) >= 2 and syncs[0]["digest"] != syncs[1]["digest"]
