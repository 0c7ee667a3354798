"""The harness of the verl tests (test_verl_engine.py, test_verl_ranks.py): verl's worker over
the longmoe engine on CPU, tiny random models, and batches built as verl's trainer builds them.

verl has no CPU platform and its worker expects a process group: `verl_env` registers a host
platform with verl's PlatformRegistry and starts a one-rank gloo group (what verl's Ray launcher
does on a GPU node); verl's own files are not touched. Import it only after
pytest.importorskip("verl").
"""

import os
import sys
from functools import partial

import pytest
import torch

# verl pins transformers < 5.11, whose Gated DeltaNet binds fla whenever it imports (a CPU
# forward then fails): its torch path here. Set only where verl is installed, so the other
# test files of a session keep fla.
sys.modules.setdefault("fla", None)  # transformers' Gated DeltaNet on its torch path on CPU

import torch.distributed as dist  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from verl.plugin.platform import platform_manager  # noqa: E402
from verl.plugin.platform.platform_cuda import PlatformCUDA  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.model import compute_position_id_with_mask  # noqa: E402
from verl.workers.config import HFModelConfig, OptimizerConfig, TrainingWorkerConfig  # noqa: E402
from verl.workers.engine_workers import TrainingWorker  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from longmoe.api import PolicyTrainer  # noqa: E402
from longmoe.data.sample import Sample  # noqa: E402
from longmoe.integrations.verl import LongMoEActorConfig, LongMoEEngineConfig  # noqa: E402


class _HostDevice:
    """torch.cpu, plus the memory queries verl's worker logs after each call."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def max_memory_allocated(*_):
        return 0

    @staticmethod
    def max_memory_reserved(*_):
        return 0

    @staticmethod
    def memory_allocated(*_):
        return 0

    @staticmethod
    def memory_reserved(*_):
        return 0

    @staticmethod
    def empty_cache():
        pass

    @staticmethod
    def get_device_name(*_):
        return "CPU"


class HostPlatform(PlatformCUDA):
    """verl's platform for a machine with no accelerator: device "cpu", gloo."""

    device_name = "cpu"
    vendor_name = "host"
    device_module = _HostDevice()

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def empty_cache(self):
        pass

    def communication_backend_name(self):
        return "gloo"


# name -> the longmoe model settings. tiny and tiny-hybrid export as Qwen3.5-MoE (tiny-hybrid with
# Gated DeltaNet layers); qwen3-moe is the Qwen3-30B-A3B preset cut to tiny sizes, exported as
# Qwen3-MoE (no attention gate, no shared expert, full rotary, plain w norms). Its balance loss
# is off: the balance loss is a statistic of each micro-batch, verl's micro-batches are not the
# direct call's, and without a shared expert the split moves the gradient norm by 1.4e-5
# (relative) against the 1e-5 the comparisons hold; the tiny models keep theirs on.
MODELS = {
    "tiny": ["model.preset=tiny"],
    "tiny-hybrid": ["model.preset=tiny-hybrid"],
    "qwen3-moe": ["model.preset=qwen3-30b-a3b", "model.num_layers=2", "model.hidden_size=64",
                  "model.vocab_size=512", "model.num_heads=4", "model.num_kv_heads=2",
                  "model.head_dim=16", "model.num_experts=8", "model.top_k=2",
                  "model.moe_ffn_size=32", "model.max_seq_len=1024", "model.router_aux_loss_coef=0.0"],
}
PRESETS = tuple(MODELS)


@pytest.fixture(scope="module")
def verl_env(tmp_path_factory):
    """One-rank gloo group and verl's host platform for this module's tests, both undone after."""
    tmp = tmp_path_factory.mktemp("verl")
    env = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved_platform = platform_manager._current_platform
    platform_manager.set_platform(HostPlatform())
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp / "store"), 1), rank=0,
                                world_size=1)
    yield tmp
    if started:
        dist.destroy_process_group()
    platform_manager._current_platform = saved_platform
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def ppo_config(*extra, longmoe=True):
    """verl's ppo_trainer hydra config with `extra` overrides; `longmoe`: our config package on
    hydra's search path and model_engine=longmoe before them."""
    from hydra import compose, initialize_config_module
    head = (["hydra.searchpath=[pkg://longmoe.integrations.verl.configs]", "model_engine=longmoe"]
            if longmoe else [])
    with initialize_config_module("verl.trainer.config", version_base=None):
        return compose("ppo_trainer", overrides=head + list(extra))


def overrides(preset):
    return MODELS[preset] + ["train.device=cpu", "model.init_std=0.2",
            "loss.kl_coef=0.0", "optim.warmup_steps=0"]


def reference(preset, tmp, lr=1e-2):
    """A PolicyTrainer built directly, and an HF directory of its initial weights."""
    pt = PolicyTrainer.from_config(None, overrides(preset) + [f"optim.lr={lr}",
                                                              "optim.weight_decay=0.01"])
    path = tmp / f"hf-{preset}"
    if not (path / "config.json").exists():
        pt.export_hf(path, dtype=torch.float32)
    return pt, path


def worker(path, preset, max_tokens=64, lr=1e-2, mini_batch=4, epochs=1, extra=(), fused=True,
           optim=None, replay="disabled"):
    """verl's TrainingWorker over the longmoe engine, as ActorRolloutRefWorker.init_model
    builds its actor, with verl's ppo_loss as the loss; `extra`: more longmoe overrides;
    `optim`: verl's optimizer config (default: AdamW at `lr`, constant); `replay`: verl's
    router_replay.mode."""
    from verl.workers.config import EngineRouterReplayConfig
    actor = LongMoEActorConfig(
        strategy="longmoe", rollout_n=1, ppo_mini_batch_size=mini_batch, use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=max_tokens, ppo_epochs=epochs, clip_ratio=0.2,
        loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False,
        optim=optim or OptimizerConfig(lr=lr, weight_decay=0.01, betas=(0.9, 0.95), clip_grad=1.0),
        longmoe=LongMoEEngineConfig(strategy="longmoe", overrides=overrides(preset) + list(extra),
                                    dtype="float32", fused_ppo_loss=fused,
                                    router_replay=EngineRouterReplayConfig(mode=replay)))
    model = HFModelConfig(path=str(path), load_tokenizer=False)
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=model,
                               engine_config=actor.engine, optimizer_config=actor.optim,
                               checkpoint_config=actor.checkpoint)
    cfg.engine_config.use_dynamic_bsz = True
    cfg.engine_config.max_token_len_per_gpu = max_tokens
    cfg.engine_config.infer_max_token_len_per_gpu = max_tokens
    w = TrainingWorker(cfg)
    w.reset()
    w.set_loss_fn(partial(ppo_loss, config=actor))
    return w


def ragged(V, prompt_side, n=6, seed=0):
    """(samples, verl's padded batch: prompts padded on `prompt_side`, responses on the right,
    with attention_mask, position_ids and response_mask as verl's rollout makes them)."""
    g = torch.Generator().manual_seed(seed)
    P, R = 7, 9
    samples, prompts, responses, pmask, rmask = [], [], [], [], []
    for i in range(n):
        p = int(torch.randint(1, P + 1, (1,), generator=g))
        r = int(torch.randint(1, R + 1, (1,), generator=g))
        pi, ri = torch.randint(0, V, (p,), generator=g), torch.randint(0, V, (r,), generator=g)
        adv = float(torch.randn((), generator=g))
        samples.append(Sample(pi, ri, advantage=adv, index=i))
        pad_p, pad_r = torch.zeros(P - p, dtype=torch.long), torch.zeros(R - r, dtype=torch.long)
        ones_p, zeros_p = torch.ones(p, dtype=torch.long), torch.zeros(P - p, dtype=torch.long)
        if prompt_side == "left":
            prompts.append(torch.cat([pad_p, pi]))
            pmask.append(torch.cat([zeros_p, ones_p]))
        else:
            prompts.append(torch.cat([pi, pad_p]))
            pmask.append(torch.cat([ones_p, zeros_p]))
        responses.append(torch.cat([ri, pad_r]))
        rmask.append(torch.cat([torch.ones(r, dtype=torch.long),
                                torch.zeros(R - r, dtype=torch.long)]))
    prompts, responses = torch.stack(prompts), torch.stack(responses)
    attention = torch.cat([torch.stack(pmask), torch.stack(rmask)], 1)
    adv = torch.stack([torch.full((R,), s.advantage) for s in samples]) * torch.stack(rmask)
    td = TensorDict({"prompts": prompts, "responses": responses,
                     "input_ids": torch.cat([prompts, responses], 1),
                     "attention_mask": attention,
                     "position_ids": compute_position_id_with_mask(attention),
                     "response_mask": torch.stack(rmask), "advantages": adv},
                    batch_size=[n])
    return samples, td


def verl_logprobs(w, td, budget, entropy=True, temperature=None):
    """The trainer's _compute_old_log_prob: no padding in, verl's padded layout out; `budget`:
    max_token_len_per_gpu (log_prob_max_token_len_per_gpu); `temperature`: verl's setting (a
    number; a per-sequence tensor rides in `td` itself)."""
    td = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(td, calculate_entropy=entropy, compute_loss=False,
                         max_token_len_per_gpu=budget)
    if temperature is not None:
        tu.assign_non_tensor(td, temperature=temperature)
    out = w.infer_batch(td)
    lp = no_padding_2_padding(tu.get(out, "log_probs"), td)
    ent = no_padding_2_padding(tu.get(out, "entropy"), td) if entropy else None
    return lp, ent, out


def _train_inputs(pt, td, samples):
    """The update batch: old log-probs from the policy itself (the first on-policy step)."""
    old = pt.compute_logprobs(samples)
    R = td["responses"].shape[1]
    td = td.clone()
    td["old_log_probs"] = torch.stack([torch.nn.functional.pad(o, (0, R - o.numel()))
                                       for o in old])
    return td, [Sample(s.prompt, s.response, s.advantage, old_logprobs=o,
                       temperature=s.temperature, index=s.index)
                for s, o in zip(samples, old)]


def train_mini_batch(w, td, batch_size, epochs=1, temperature=1.0):
    """verl's update_actor call on the worker: `td` through left_right_2_no_padding into
    mini-batches of `batch_size`, `epochs` passes, no shuffle; the metrics (None on a rank that
    returns no outputs). A fresh batch each call: train_mini_batch pops its settings."""
    batch = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(batch, global_batch_size=batch_size, mini_batch_size=batch_size,
                         epochs=epochs, seed=0, dataloader_kwargs={"shuffle": False},
                         calculate_entropy=False)
    if "temperature" not in batch.keys():  # a per-sequence tensor rides in `td` itself
        tu.assign_non_tensor(batch, temperature=temperature)
    out = w.train_mini_batch(batch)
    return None if out is None else tu.get(out, "metrics")
