"""verl drives longmoe: unmodified verl (its TrainingWorker and ActorRolloutRefWorker, the calls
its trainer makes on them, its ppo_loss, padding and micro-batching helpers) runs a tiny random
longmoe model through longmoe.integrations.verl in one process, against PolicyTrainer called
directly on the same samples. The harness is tests/_verl.py; several gloo ranks are in
test_verl_ranks.py.
"""

import json
import re
import shutil
import sys

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

from _verl import (PRESETS, _train_inputs, overrides, ppo_config, ragged, reference,  # noqa: E402,F401
                   train_mini_batch, verl_env, verl_logprobs, worker)
from tensordict import TensorDict  # noqa: E402
from test_verl_syncs import audit_paths, counts, table  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.engine import EngineRegistry  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from longmoe.api import PolicyTrainer  # noqa: E402
from longmoe.integrations.verl import (LongMoEActorConfig, LongMoEEngine,  # noqa: E402
                                       LongMoEEngineConfig)


def test_registered_and_found_through_verl(verl_env):
    """verl loads every `verl.plugins` entry point when it is imported; ours is the module that
    registers the engine, for the devices verl asks about."""
    import importlib
    import tomllib
    from pathlib import Path
    # The declaration, not the installed metadata: an in-tree egg-info from an older build can
    # shadow the install's entry points when the tests run from the repository root.
    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    ours = meta["project"]["entry-points"]["verl.plugins"]
    assert ours == {"longmoe": "longmoe.integrations.verl"}
    assert importlib.import_module(ours["longmoe"]).LongMoEEngine is LongMoEEngine
    assert EngineRegistry.get_engine_cls("language_model", "longmoe") is LongMoEEngine
    assert set(EngineRegistry._engines["language_model"]["longmoe"]) == {"cuda", "cpu"}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("prompt_side", ["left", "right"])
def test_infer_matches_compute_logprobs(verl_env, preset, prompt_side):
    pt, path = reference(preset, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, prompt_side)
    want_lp, want_ent = pt.compute_logprobs(samples, with_entropy=True)
    got = []
    w = worker(path, preset)
    for budget in (16, 40, 200):  # one sequence per micro-batch .. all in one
        lp, ent, _ = verl_logprobs(w, td, budget)
        for i, s in enumerate(samples):
            R = s.response.numel()
            assert torch.allclose(lp[i, :R], want_lp[i], atol=1e-5, rtol=0), (budget, i)
            assert torch.allclose(ent[i, :R], want_ent[i], atol=1e-5, rtol=0), (budget, i)
        got.append(lp)
    assert all(torch.allclose(g, got[0], atol=1e-5, rtol=0) for g in got[1:])


@pytest.mark.parametrize("preset", PRESETS)
def test_train_step_matches_forward_backward(verl_env, preset):
    pt, path = reference(preset, verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=1)
    td, with_old = _train_inputs(pt, td, samples)
    want = pt.forward_backward(with_old)
    want_step = pt.optim_step()

    w = worker(path, preset, max_tokens=24, mini_batch=4, epochs=1)
    out = train_mini_batch(w, td, 4)
    engine = w.engine
    assert engine.trainer.step == 1
    assert out["actor/ppo_kl"] == [pytest.approx(0.0, abs=1e-6)] * len(out["actor/ppo_kl"])
    assert sum(out["actor/pg_clipfrac"]) == 0.0
    # verl's loss metric is its policy loss; the MoE balance loss is in the gradient only.
    assert out["loss"][0] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert out["grad_norm"][0] == pytest.approx(want_step["grad_norm"], rel=1e-5)


def test_mini_batches_times_epochs_optimizer_steps(verl_env):
    pt, path = reference("tiny", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=6, seed=2)
    td, _ = _train_inputs(pt, td, samples)
    w = worker(path, "tiny", max_tokens=32, mini_batch=2, epochs=2)
    out = train_mini_batch(w, td, 2, epochs=2)
    assert w.engine.trainer.step == 3 * 2
    assert len(out["grad_norm"]) == 6


def _fsdp_optim(**kw):
    from verl.workers.config import FSDPOptimizerConfig
    return FSDPOptimizerConfig(**{"lr": 1e-2, "weight_decay": 0.01, "betas": (0.9, 0.95),
                                  "clip_grad": 1.0, **kw})


def test_schedule_is_verls_once_an_iteration(verl_env):
    """verl's cosine schedule with warmup (actor.optim, verl's fsdp group), stepped once per
    train_mini_batch (an iteration of 2 mini-batches, so 2 optimizer steps at one rate): the
    rates applied are those of verl's own scheduler stepped per iteration, verl's `lr` metric
    is the next one, and a checkpoint keeps the schedule's position."""
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup
    pt, path = reference("tiny", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=11)
    td, _ = _train_inputs(pt, td, samples)
    optim = _fsdp_optim(lr_scheduler_type="cosine", lr_warmup_steps=2, total_training_steps=6,
                        min_lr_ratio=0.1)
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    ref = get_cosine_schedule_with_warmup(holder, 2, 6, min_lr_ratio=0.1)
    want = []
    for _ in range(4):
        want.append(ref.get_last_lr()[0])
        holder.step()
        ref.step()

    def run(w, iterations):
        applied, metrics = [], []
        opt = w.engine.trainer.optim
        step = opt.step

        def recorded(*a, **k):
            applied.append(opt.param_groups[0]["lr"])
            return step(*a, **k)
        opt.step = recorded
        for _ in range(iterations):
            metrics.append(train_mini_batch(w, td, 2))
        return applied, metrics

    w = worker(path, "tiny", optim=optim, mini_batch=2)
    applied, metrics = run(w, 2)
    assert applied == pytest.approx([want[0]] * 2 + [want[1]] * 2, rel=1e-12)
    assert applied[0] == 0.0  # verl's warmup starts from a zero rate
    assert [m["lr"][0] for m in metrics] == pytest.approx(want[1:3], rel=1e-12)
    ck = verl_env / "ckpt-schedule"
    w.save_checkpoint(str(ck))
    assert json.loads((ck / "verl_lr_schedule.json").read_text())["lr_scheduler_steps"] == 2
    after, m_after = run(w, 1)
    w2 = worker(path, "tiny", optim=optim, mini_batch=2)
    w2.load_checkpoint(str(ck))
    resumed, m_resumed = run(w2, 1)
    assert after == resumed == pytest.approx([want[2]] * 2, rel=1e-12)
    assert m_after[0]["grad_norm"] == m_resumed[0]["grad_norm"]


@pytest.mark.parametrize("kw, field", [
    ({"optimizer": "AdamW8bit", "optimizer_impl": "bitsandbytes.optim"}, "actor.optim.optimizer"),
    ({"override_optimizer_config": {"eps": 1e-6}}, "actor.optim.override_optimizer_config"),
    ({"_warm": True}, "optim.warmup_steps"),
])
def test_optimizer_settings_the_engine_would_not_honour_are_refused(verl_env, kw, field):
    from longmoe.errors import ConfigError
    pt, path = reference("tiny", verl_env)
    extra = ["optim.warmup_steps=3"] if kw.pop("_warm", False) else []
    with pytest.raises(ConfigError, match=re.escape(field)):
        worker(path, "tiny", optim=_fsdp_optim(**kw), extra=extra)


def test_per_tensor_param_matches_rollout_weights(verl_env):
    pt, path = reference("tiny-hybrid", verl_env)
    w = worker(path, "tiny-hybrid")
    gen, peft = w.engine.get_per_tensor_param()
    got = dict(gen)
    want = {n: t for bucket in pt.named_weights_for_rollout(1 << 20, senders="rank0")
            for n, t in bucket}
    assert peft is None and list(got) == list(want)
    for n, t in want.items():
        assert got[n].shape == t.shape and torch.equal(got[n], t), n


def test_checkpoint_round_trip(verl_env):
    pt, path = reference("tiny", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=3)
    td, _ = _train_inputs(pt, td, samples)
    a = worker(path, "tiny")
    train_mini_batch(a, td, 4)
    a.save_checkpoint(str(verl_env / "ckpt"))
    want = train_mini_batch(a, td, 4)
    b = worker(path, "tiny")
    b.load_checkpoint(str(verl_env / "ckpt"))
    got = train_mini_batch(b, td, 4)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


def test_checkpoint_max_ckpt_to_keep(verl_env):
    """verl saves each global step into global_step_N/actor and asks for the newest
    max_ckpt_to_keep: a directory the engine created goes whole once it is beyond them, its lock
    given up; in one that existed before, only what the engine wrote goes."""
    from longmoe.checkpoint.directory import claim
    from longmoe.errors import UserError

    def held(d):
        """Whether this process holds d's lock (a claim of it is then shared)."""
        existed = d.exists()
        lock = claim(d)
        lock.release()
        if not existed:
            shutil.rmtree(d)                           # the claim made it
        return lock.shared
    _, path = reference("tiny", verl_env)
    w = worker(path, "tiny")
    run = verl_env / "ckpt-keep"
    actor = [run / f"global_step_{n}" / "actor" for n in range(1, 7)]
    for bad in (-1, 1.5, True):
        with pytest.raises(UserError, match="max_ckpt_to_keep"):
            w.save_checkpoint(str(actor[0]), None, 1, bad)
    assert not run.exists()                            # refused before anything is written
    for n in (1, 2, 3):
        w.save_checkpoint(str(actor[n - 1]), None, n, max_ckpt_to_keep=2)
    assert not actor[0].exists() and actor[0].parent.is_dir()   # verl's global_step_1 stays
    assert list(actor[0].parent.iterdir()) == []                # no debris
    for a in actor[1:3]:
        assert sorted(q.name for q in a.iterdir()) == [".lock", "latest", "step-00000000",
                                                       "verl_lr_schedule.json"]
    assert held(actor[2]) and not held(actor[0])       # its lock was given up before
    # The same directory saved into again counts once, as the newest.
    w.save_checkpoint(str(actor[1]), None, 2, max_ckpt_to_keep=2)
    assert actor[1].is_dir() and actor[2].is_dir()
    # A directory that existed before keeps what was there; only the engine's files go.
    actor[3].mkdir(parents=True)
    (actor[3] / "notes.txt").write_text("the user's\n")
    w.save_checkpoint(str(actor[3]), None, 4, max_ckpt_to_keep=2)
    assert actor[1].is_dir() and not actor[2].exists()
    for n in (5, 6):
        w.save_checkpoint(str(actor[n - 1]), None, n, max_ckpt_to_keep=2)
    assert not actor[1].exists()
    assert sorted(q.name for q in actor[3].iterdir()) == [".lock", "notes.txt"]
    assert not held(actor[3]) and held(actor[5])
    w2 = worker(path, "tiny")
    w2.load_checkpoint(str(actor[5]))
    # None (verl's default) keeps every directory.
    for n in (7, 8, 9):
        w2.save_checkpoint(str(run / f"global_step_{n}" / "actor"), None, n, None)
    assert all((run / f"global_step_{n}" / "actor" / "latest").is_file() for n in (7, 8, 9))


def test_token_outside_the_vocabulary_is_refused_on_the_host(verl_env):
    pt, path = reference("tiny", verl_env)
    V = pt.run.model.vocab_size
    _, td = ragged(V, "left", n=2)
    td["responses"][1, 0] = V
    td["input_ids"] = torch.cat([td["prompts"], td["responses"]], 1)
    td = left_right_2_no_padding(td)
    tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
    with pytest.raises(ValueError, match=rf"token id {V} .* outside the vocabulary \[0, {V}\)"):
        worker(path, "tiny").infer_batch(td)


def test_hydra_model_engine_longmoe_selects_the_engine_configs(verl_env):
    """verl's ppo_trainer with `model_engine=longmoe` and our config package on hydra's search
    path: the actor and the reference policy become LongMoEActorConfig with strategy longmoe
    (the reference forward only), the critic stays verl's FSDP one."""
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    cfg = ppo_config("actor_rollout_ref.actor.use_dynamic_bsz=true",
                     "actor_rollout_ref.actor.longmoe.overrides=['parallel.ep=2']")
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert isinstance(actor, LongMoEActorConfig) and actor.strategy == "longmoe"
    assert isinstance(actor.engine, LongMoEEngineConfig)
    assert actor.engine.overrides == ["parallel.ep=2"]
    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):  # what ActorRolloutRefWorker.init_model does before converting it
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    ref = omega_conf_to_dataclass(ref)
    assert ref.strategy == "longmoe" and ref.engine.forward_only
    assert ref.engine.overrides == ["parallel.ep=2"]
    assert cfg.critic.strategy == "fsdp"


def _actor_rollout_ref(path, preset, role, budget=64, mini_batch=4):
    """verl's ActorRolloutRefWorker for `role` ("actor" or "ref": no rollout engine), from verl's
    ppo_trainer config with model_engine=longmoe, as verl's trainer builds it."""
    from verl.workers.engine_workers import ActorRolloutRefWorker
    longmoe = ",".join(f"'{o}'" for o in overrides(preset))
    cfg = ppo_config(
        f"actor_rollout_ref.model.path={path}", "+actor_rollout_ref.model.load_tokenizer=false",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={budget}",
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
        f"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu={budget}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.actor.optim.lr=0.01",
        "actor_rollout_ref.actor.optim.weight_decay=0.01",
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]", "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.shuffle=false",
        f"actor_rollout_ref.actor.longmoe.overrides=[{longmoe}]")
    w = ActorRolloutRefWorker(cfg.actor_rollout_ref, role=role)
    w.init_model()
    return w


def _e2e_overrides():
    """bench/verl_e2e.sh's hydra overrides for main_ppo, its shell variables set to examples."""
    import shlex
    from pathlib import Path
    text = (Path(__file__).parents[1] / "bench" / "verl_e2e.sh").read_text()
    call = text[text.index("python3 -m verl.trainer.main_ppo"):text.index("2>&1 | tee")]
    env = {"MODEL": "/models/m", "TRAIN": "/data/train.parquet", "VAL": "/data/val.parquet",
           "GPUS": "8", "ROLLOUT": "vllm", "STEPS": "20", "OUT": "/out",
           "LONGMOE_SET": "['parallel.ep=8']"}
    for k, v in env.items():
        call = call.replace("${%s}" % k, v).replace("$" + k, v)
    return shlex.split(call.replace("\\\n", " "))[3:]


def test_e2e_script_overrides_compose_into_the_engine_configs(verl_env):
    """bench/verl_e2e.sh's overrides compose with verl's ppo_trainer config into the longmoe actor
    and reference configs that ActorRolloutRefWorker.init_model builds, and pass the checks the
    engine makes before any rank starts (optimizer and schedule, dynamic batch sizes agree)."""
    from verl.utils.config import omega_conf_to_dataclass

    from longmoe.integrations.verl.schedule import check_optimizer
    ov = _e2e_overrides()
    assert "model_engine=longmoe" in ov and any(o.startswith("actor_rollout_ref.rollout.name")
                                                for o in ov)
    cfg = ppo_config(*ov, longmoe=False)   # the script names both itself
    arr = cfg.actor_rollout_ref
    actor = omega_conf_to_dataclass(arr.actor)
    assert isinstance(actor, LongMoEActorConfig) and actor.engine.overrides == ["parallel.ep=8"]
    assert arr.actor.use_dynamic_bsz == arr.rollout.log_prob_use_dynamic_bsz  # init_model asserts
    check_optimizer(actor.optim)
    assert actor.loss_agg_mode == "token-mean" and not actor.use_kl_loss  # the fused path's terms
    assert cfg.actor_rollout_ref.rollout.temperature == 1.0


def test_actor_rollout_ref_worker_compute_log_prob_and_update_actor(verl_env):
    """verl's ActorRolloutRefWorker itself (roles "actor" and "ref", built from verl's hydra
    config; the rollout engine is left out), called as verl's trainer calls it: its
    compute_log_prob and compute_ref_log_prob equal PolicyTrainer.compute_logprobs, and
    update_actor's first on-policy step equals forward_backward + optim_step."""
    pt, path = reference("tiny", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=12)
    want_lp = pt.compute_logprobs(samples)
    actor = _actor_rollout_ref(path, "tiny", "actor")
    ref = _actor_rollout_ref(path, "tiny", "ref")
    assert isinstance(actor.actor.engine, LongMoEEngine) and isinstance(ref.ref.engine, LongMoEEngine)
    assert ref.ref.engine.trainer.forward_only and not actor.actor.engine.trainer.forward_only
    batch = left_right_2_no_padding(td.clone())  # the trainer's _compute_old_log_prob
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False)
    out = actor.compute_log_prob(batch)
    lp = no_padding_2_padding(tu.get(out, "log_probs"), batch)
    rbatch = left_right_2_no_padding(td.clone())  # _compute_ref_log_prob
    tu.assign_non_tensor(rbatch, calculate_entropy=False, compute_loss=False)
    rlp = no_padding_2_padding(tu.get(ref.compute_ref_log_prob(rbatch), "log_probs"), rbatch)
    for i, s in enumerate(samples):
        R = s.response.numel()
        assert torch.allclose(lp[i, :R], want_lp[i], atol=1e-5, rtol=0), i
        assert torch.allclose(rlp[i, :R], want_lp[i], atol=1e-5, rtol=0), i
    td, with_old = _train_inputs(pt, td, samples)
    want = pt.forward_backward(with_old)
    want_step = pt.optim_step()
    batch = left_right_2_no_padding(td.clone())  # the trainer's _update_actor
    tu.assign_non_tensor(batch, temperature=1.0, calculate_entropy=False,
                         distillation_use_topk=False, distillation_only=False,
                         global_batch_size=4, mini_batch_size=4, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    m = tu.get(actor.update_actor(batch), "metrics")
    assert actor.actor.engine.trainer.step == 1 and actor.actor.engine.fused_last
    assert m["actor/ppo_kl"] == [pytest.approx(0.0, abs=1e-6)] * len(m["actor/ppo_kl"])
    assert m["loss"][0] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"][0] == pytest.approx(want_step["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("preset", ["tiny-hybrid", "qwen3-moe"])
def test_rollout_weights_in_transformers_give_the_same_logprobs(verl_env, preset):
    """get_per_tensor_param's tensors loaded into transformers' Qwen3.5-MoE or Qwen3-MoE (as
    the export names it): its teacher-forced log-probs equal verl's infer_batch through the
    engine."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3MoeConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    from longmoe.model.hf import hf_config
    from longmoe.rl.weights import load_into_hf_model
    pt, path = reference(preset, verl_env)
    w = worker(path, preset)
    conf = hf_config(pt.run.model, "float32")
    classes = {"qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
               "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
    assert conf["model_type"] == ("qwen3_moe" if preset == "qwen3-moe" else "qwen3_5_moe_text")
    Conf, Model = classes[conf["model_type"]]
    hf = Model(Conf(**{k: v for k, v in conf.items()
                       if k not in ("model_type", "architectures")})).eval()
    gen, _ = w.engine.get_per_tensor_param()
    load_into_hf_model(hf, [list(gen)], pt.run)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=3, seed=4)
    lp, _, _ = verl_logprobs(w, td, 64, entropy=False)
    for i, s in enumerate(samples):
        ids = torch.cat([s.prompt, s.response])[None]
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
        P, R = s.prompt_len, s.response.numel()
        want = torch.log_softmax(logits, -1)[P - 1:P + R - 1].gather(-1, s.response[:, None])[:, 0]
        assert torch.allclose(lp[i, :R], want, atol=1e-4, rtol=0), i


def _example():
    """examples/rl_loop.py (its toy task, transformers rollout engine and GRPO advantages)."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "rl_loop_example", Path(__file__).parents[1] / "examples" / "rl_loop.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def grpo_through_verl(tmp, lr, iterations, prompts=16, group=8, seed=0):
    """A GRPO loop through verl's worker API: weights to a transformers rollout engine from
    get_per_tensor_param, generation, rewards and group advantages, old log-probs from
    infer_batch, then train_mini_batch (2 mini-batches). Returns the mean reward per
    iteration."""
    from longmoe.rl.weights import load_into_hf_model
    ex = _example()
    task = ex.Task("sort", 6, 4)
    sets = ["model.preset=tiny-hybrid", f"model.vocab_size={task.vocab_size}",
            "impl.gated_delta=chunked", "train.device=cpu", "loss.kl_coef=0.0",
            f"train.seed={seed}"]
    pt = PolicyTrainer.from_config(None, sets)
    path = tmp / "hf-grpo"
    if not (path / "config.json").exists():
        pt.export_hf(path, dtype=torch.float32)
    w = worker(path, "tiny-hybrid", max_tokens=256, lr=lr, mini_batch=prompts * group // 2,
               extra=sets[1:])
    hf = ex.build_engine(pt.run)
    gen, rewards = torch.Generator().manual_seed(seed), []
    for it in range(iterations):
        load_into_hf_model(hf, [list(w.engine.get_per_tensor_param()[0])], pt.run)
        p = task.prompts(prompts, gen).repeat_interleave(group, 0)
        r, _ = ex.generate(hf, p, task.length, seed + it)
        reward = task.rewards(p, r)
        adv = ex.grpo_advantages(reward.view(prompts, group)).reshape(-1)
        ones = torch.ones(p.shape[0], p.shape[1] + r.shape[1], dtype=torch.long)
        td = TensorDict({"prompts": p, "responses": r, "input_ids": torch.cat([p, r], 1),
                         "attention_mask": ones,
                         "position_ids": compute_position_id_with_mask(ones),
                         "response_mask": torch.ones_like(r),
                         "advantages": adv[:, None].expand_as(r).contiguous()},
                        batch_size=[p.shape[0]])
        old, _, _ = verl_logprobs(w, td, 256, entropy=False)
        td["old_log_probs"] = old
        batch = left_right_2_no_padding(td)
        n = p.shape[0]
        tu.assign_non_tensor(batch, global_batch_size=n // 2, mini_batch_size=n // 2, epochs=1,
                             seed=seed, dataloader_kwargs={"shuffle": True},
                             calculate_entropy=False, temperature=1.0)
        w.train_mini_batch(batch)
        rewards.append(float(reward.mean()))
    return rewards


@pytest.mark.slow
def test_grpo_loop_through_verl_raises_the_reward(verl_env):
    """The toy sort task of examples/rl_loop.py: the mean reward of the last 3 iterations beats
    the first 3's; a control at lr 0 (same prompts and seeds) stays where it started."""
    got = grpo_through_verl(verl_env, 5e-3, 10, prompts=8)
    ctl = grpo_through_verl(verl_env, 0.0, 10, prompts=8)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print("GRPO rewards", [round(x, 3) for x in got], "control", [round(x, 3) for x in ctl])
    rise, drift = mean(got[-3:]) - mean(got[:3]), mean(ctl[-3:]) - mean(ctl[:3])
    assert ctl[0] == got[0]  # the same prompts, seeds and first policy
    # measured: rise 0.096 (0.142 -> 0.238), control drift 0.026 (0.136 -> 0.162)
    assert rise > 0.05 and rise > drift + 0.05 and abs(drift) < 0.05


def test_fused_ppo_loss_equals_verl_ppo_loss(verl_env):
    """verl's ppo_loss run fused into our LM head and run as verl's own code on our log-probs:
    the same loss, gradient norm and clip statistics on an off-policy step where the clip and
    verl's dual clip (c = 3) are active, the mini-batch split into several micro-batches."""
    pt, path = reference("tiny-hybrid", verl_env)
    samples, td = ragged(pt.run.model.vocab_size, "left", n=6, seed=6)
    td, _ = _train_inputs(pt, td, samples)
    g = torch.Generator().manual_seed(7)
    mask = td["response_mask"].float()
    td["old_log_probs"] = (td["old_log_probs"] + 0.6 * torch.randn(mask.shape, generator=g)) * mask
    td["advantages"] = 3 * torch.randn(mask.shape, generator=g) * mask
    got = {}
    for fused in (True, False):
        w = worker(path, "tiny-hybrid", max_tokens=24, mini_batch=6, fused=fused)
        got[fused] = train_mini_batch(w, td, 6)
        assert w.engine.fused_last == fused
    a, b = got[True], got[False]
    assert b["actor/pg_clipfrac"][0] > 0 and b["actor/pg_clipfrac_lower"][0] > 0
    assert a["loss"][0] == pytest.approx(b["loss"][0], rel=1e-5)
    assert a["grad_norm"][0] == pytest.approx(b["grad_norm"][0], rel=1e-5)
    for k in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss"):
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k


def test_cp_without_the_fused_loss_is_refused(verl_env):
    pt, path = reference("tiny", verl_env)
    with pytest.raises(ValueError, match="parallel.cp: context parallelism trains through"):
        worker(path, "tiny", extra=["parallel.cp=2"], fused=False)


@pytest.mark.parametrize("budget", [24, 200])  # three micro-batches, one
def test_verl_infer_syncs_no_more_than_direct(verl_env, budget):
    """Outside the model's forward, verl's infer_batch through the engine synchronises the host
    with the device no more often than compute_logprobs on the same samples (in all, and once
    device work is queued), launches no more device ops per micro-batch, and copies each
    micro-batch to the device without blocking."""
    v, d = audit_paths(verl_env, budget)
    cv, cd = counts(v), counts(d)
    report = (f"verl {cv}, direct {cd}\nverl syncs:\n{table(v, 'sync')}\ndirect syncs:\n"
              f"{table(d, 'sync')}\nverl device ops:\n{table(v, 'device')}\ndirect device "
              f"ops:\n{table(d, 'device')}")
    assert cv["forwards"] == (3 if budget == 24 else 1) and cd["forwards"] == 1, report
    # the audit follows both paths' tensors onto the trainer's device (it tracks the device
    # object itself: a copy made with another one would drop out of every count below)
    assert cv["device_ops"] > 0 and cd["device_ops"] > 0, report
    assert cv["syncs_after"] <= cd["syncs_after"], report
    assert cv["syncs_before"] + cv["syncs_after"] <= cd["syncs_before"] + cd["syncs_after"], report
    assert cv["device_ops"] / cv["forwards"] <= cd["device_ops"] / cd["forwards"], report
    assert cv["blocking_h2d"] == 0, report


def test_kernel_manifest_is_checked_and_each_call_watched(verl_env, tmp_path):
    # train.kernel_manifest under verl: a bad one is one line naming the field before the
    # model is built; a good one runs every call through the run's manifest watch (on a CPU
    # nothing compiles, so the file stays as it was).
    from longmoe.ops.kernels import precompile
    pt, path = reference("tiny", verl_env)
    with pytest.raises(ValueError, match=r"^train.kernel_manifest: .* its directory does not "
                                         r"exist$"):
        worker(path, "tiny", extra=[f"train.kernel_manifest={tmp_path / 'no' / 'k.json'}"])
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="^train.kernel_manifest: .*not a readable kernel"):
        worker(path, "tiny", extra=[f"train.kernel_manifest={bad}"])
    good = tmp_path / "k.json"
    precompile.merge(good, [])
    before = good.read_text()
    samples, td = ragged(pt.run.model.vocab_size, "left", n=4, seed=1)
    td, _ = _train_inputs(pt, td, samples)
    w = worker(path, "tiny", max_tokens=24, extra=[f"train.kernel_manifest={good}"])
    train_mini_batch(w, td, 4)
    assert w.engine.manifest.done >= 1 and w.engine.manifest.pre is None
    assert good.read_text() == before
