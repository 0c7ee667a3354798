"""What verl's own trainer (`python -m verl.trainer.main_ppo`) lacks on a CPU-only machine, for
test_verl_main_ppo.py: a host platform and a rollout engine. Nothing of verl's is changed.

verl imports the modules named in VERL_USE_EXTERNAL_MODULES whenever it is imported, so with
this directory on PYTHONPATH, `VERL_USE_EXTERNAL_MODULES=_verl_e2e` and `VERL_PLATFORM=host`,
every process of the run (the driver, verl's TaskRunner, its worker, agent-loop and reward
actors) registers:

- the host platform under "host": tests/_verl.py's HostPlatform (device "cpu", gloo), which
  also starts a Ray worker's gloo group (verl's own start fails for device "cpu") and answers
  verl's device-memory query with the host's;
- a rollout named "hf_standin" in verl's two rollout registries: `StandInReplica` (a
  RolloutReplica whose one server is a ray actor generating with transformers' model of the
  same Hugging Face directory, token in, token out, with log-probs) and `StandInRollout` (the
  BaseRollout in the trainer worker: verl's update_weights hands it the engine's full tensors,
  which it forwards to that server). It stands in for vLLM/SGLang; it is not a fast generator.

The server appends the digest of the weights of each sync to the file LONGMOE_STANDIN_RECORD
names; `directory_digest` computes the same digest for a Hugging Face directory's tensors.
LONGMOE_STANDIN_FREEZE=1 makes the server keep its first weights, as a broken weight sync would:
the tests' checks of the sync must then fail.
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.modules.setdefault("fla", None)  # transformers' Gated DeltaNet on its torch path on CPU

import ray  # noqa: E402
import torch  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import PlatformRegistry  # noqa: E402
from verl.workers.rollout import base as rollout_base  # noqa: E402
from verl.workers.rollout.replica import (RolloutReplica, RolloutReplicaRegistry,  # noqa: E402
                                          TokenOutput)

ROLLOUT = "hf_standin"
PLATFORM = "host"
SERVER_PREFIX = "hf_standin_server_"
RECORD = "LONGMOE_STANDIN_RECORD"  # a file: the server appends one JSON line per weight sync
FREEZE = "LONGMOE_STANDIN_FREEZE"  # "1": the server keeps its first weights (a broken sync)


def _host_platform():
    from _verl import HostPlatform, _HostDevice  # the verl tests' host platform

    class RayHostDevice(_HostDevice):
        """_HostDevice, plus the free/total query verl's update_weights logs (host memory)."""

        @staticmethod
        def mem_get_info(*_):
            page = os.sysconf("SC_PAGE_SIZE")
            return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    class RayHostPlatform(HostPlatform):
        """verl's Ray workers start their process group with the backend string
        f"cpu:gloo,{device}:{communication_backend_name()}" (verl/utils/distributed.py,
        initialize_global_process_group_ray), which torch rejects for device "cpu" (cpu twice).
        Asked for the backend in a worker process whose group is not started yet (verl's worker
        group has set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), this starts it with gloo
        from those, and verl's is_initialized() check then skips its own."""

        device_module = RayHostDevice()

        def communication_backend_name(self):
            import torch.distributed as dist
            env = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            if dist.is_available() and not dist.is_initialized() and all(k in os.environ
                                                                           for k in env):
                dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                        world_size=int(os.environ["WORLD_SIZE"]))
            return "gloo"

    return RayHostPlatform


class HostPlatformEntry(PlatformBase):
    """PlatformRegistry wants a PlatformBase subclass at registration; tests/_verl.py imports
    verl's workers, which cannot be imported while verl itself is being imported (this module
    is imported from verl/__init__): the platform is built from it on first use."""

    def __new__(cls, *args, **kwargs):
        return _host_platform()(*args, **kwargs)


PlatformRegistry.register(platform=PLATFORM)(HostPlatformEntry)


def weight_digest(named):
    """sha256 over (name, dtype, shape, bytes) of (name, tensor) pairs, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda kv: kv[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def directory_digest(path):
    """weight_digest of every tensor of a Hugging Face directory's safetensors files."""
    from safetensors.torch import load_file
    named = []
    for f in sorted(Path(path).glob("*.safetensors")):
        named += list(load_file(str(f)).items())
    return weight_digest(named)


def _load(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


class StandInServer:
    """One rollout server: transformers' model, a full forward per generated token (no cache).
    `generate` is what verl's LLMServerClient calls on a vLLM server."""

    def __init__(self, model_path, response_length, seed):
        self.model_path = str(model_path)
        self.response_length = int(response_length)
        self.model = _load(self.model_path)
        self.rng = torch.Generator().manual_seed(int(seed))
        self.syncs = []  # (global_steps, digest) per weight sync
        self.global_steps = None  # the weights' version, in every output (as vLLM's server)
        self.requests = 0
        self.awake = True

    def update_weights(self, named, global_steps):
        """The engine's tensors (Hugging Face checkpoint names), loaded through transformers'
        own checkpoint loader: written as a safetensors file beside the directory's config."""
        from safetensors.torch import save_file
        digest = weight_digest(named.items())
        frozen = bool(self.syncs) and os.environ.get(FREEZE) == "1"
        self.syncs.append((global_steps, digest))
        if global_steps is not None:
            self.global_steps = global_steps
        record = os.environ.get(RECORD)
        if record:
            with open(record, "a") as f:
                f.write(json.dumps({"global_steps": global_steps, "digest": digest,
                                    "requests": self.requests, "loaded": not frozen}) + "\n")
        if frozen:
            return digest
        with tempfile.TemporaryDirectory() as tmp:
            for f in ("config.json", "generation_config.json"):
                if (Path(self.model_path) / f).exists():
                    shutil.copy(Path(self.model_path) / f, tmp)
            save_file({k: v.contiguous() for k, v in named.items()},
                      os.path.join(tmp, "model.safetensors"))
            self.model = _load(tmp)
        return digest

    def stats(self):
        return {"syncs": list(self.syncs), "requests": self.requests}

    @torch.no_grad()
    def generate(self, prompt_ids, sampling_params, request_id=None, image_data=None,
                 video_data=None, **kwargs):
        if image_data or video_data:
            raise NotImplementedError("the stand-in rollout is text only")
        self.requests += 1
        params = dict(sampling_params)
        max_tokens = int(params.get("max_tokens", params.get("max_new_tokens",
                                                              self.response_length)))
        max_tokens = max(1, min(max_tokens, self.response_length))
        temperature = float(params.get("temperature", 1.0))
        eos = self.model.config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        ids = list(prompt_ids)
        out, logps = [], []
        for _ in range(max_tokens):
            logits = self.model(torch.tensor([ids]), use_cache=False).logits[0, -1].float()
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=self.rng))
            else:
                logp = torch.log_softmax(logits, -1)
                tok = int(logits.argmax())
            out.append(tok)
            logps.append(float(logp[tok]))
            ids.append(tok)
            if tok in eos:
                break
        stop = "completed" if out[-1] in eos else "length"
        return TokenOutput(token_ids=out, log_probs=logps if params.get("logprobs") else None,
                           stop_reason=stop, extra_fields={"global_steps": self.global_steps})

    # verl's replica control calls: nothing to free on a host.
    def wake_up(self):
        self.awake = True

    def sleep(self):
        self.awake = False

    def clear_kv_cache(self):
        pass

    def release_kv_cache(self):
        pass

    def resume_kv_cache(self):
        pass

    def abort_all_requests(self, reject_request=False):
        pass

    def resume_generation(self):
        pass

    def start_profile(self, **kwargs):
        pass

    def stop_profile(self):
        pass


class StandInReplica(RolloutReplica):
    """verl's RolloutReplica for the stand-in: one server actor per replica, named so that the
    trainer worker's StandInRollout finds it."""

    def rollout_worker_use_gpu(self):
        return False

    async def launch_servers(self):
        name = f"{SERVER_PREFIX}{self.replica_rank}"
        server = ray.remote(StandInServer).options(
            name=name, num_cpus=0, max_concurrency=1).remote(
            self.model_config.path, self.config.response_length, self.config.seed)
        await server.stats.remote()  # constructed
        self.servers = [server]
        self._server_handle = server
        self._server_address = name


class StandInRollout(rollout_base.BaseRollout):
    """The rollout in verl's ActorRolloutRefWorker (hybrid engine): update_weights receives the
    engine's per-tensor generator and forwards rank 0's tensors to its replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, **kwargs):
        super().__init__(config, model_config, device_mesh, *args, **kwargs)
        import torch.distributed as dist
        rank = dist.get_rank() if dist.is_initialized() else 0
        tp = self.config.tensor_model_parallel_size * self.config.data_parallel_size
        self.replica_rank, self.leader = rank // tp, rank % tp == 0

    async def resume(self, tags):
        pass

    async def release(self):
        pass

    async def update_weights(self, weights, wire_format="named_tensors", global_steps=None,
                             **kwargs):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the stand-in rollout takes full tensors, not {wire_format}")
        named = {name: t.detach().to("cpu", copy=True) for name, t in weights}  # drains every rank
        if self.leader:
            server = ray.get_actor(f"{SERVER_PREFIX}{self.replica_rank}")
            await server.update_weights.remote(named, global_steps)


RolloutReplicaRegistry.register(ROLLOUT, lambda: StandInReplica)
# by this module's import name: verl also loads this file by path for compute_score
rollout_base._ROLLOUT_REGISTRY[(ROLLOUT, "async")] = "_verl_e2e.StandInRollout"


# --- the toy task: a tokenizer, the model directory, the data and the reward ---------------

WORDS = 500  # w0 .. w499 are ids 8 .. 507; 0 .. 7 the specials, newline and the roles
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n" \
       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def write_tokenizer(path):
    """A word-level tokenizer of 512 ids (the tiny presets' vocabulary) with a ChatML template;
    <|im_end|> ends a response."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + ["\n", "system", "user", "assistant"])}
    vocab.update({f"w{i}": len(vocab) + i for i in range(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken("\n", normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>")
    fast.chat_template = CHAT
    fast.save_pretrained(str(path))
    return fast


def write_model(path, overrides):
    """A random longmoe model (PolicyTrainer over `overrides`) exported as a Hugging Face
    directory in float32, with the tokenizer; eos = <|im_end|>."""
    from longmoe.api import PolicyTrainer
    pt = PolicyTrainer.from_config(None, list(overrides))
    pt.export_hf(path, dtype=torch.float32)
    fast = write_tokenizer(path)
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg.update(eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    (Path(path) / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


TARGET = 250  # reward: the share of response words w0 .. w249


def write_data(path, n, seed=0, words=6):
    """verl's RL parquet: chat prompts of random words; the reward's data_source, ground truth."""
    import random

    import pandas as pd
    rnd = random.Random(seed)
    rows = [{"data_source": "longmoe_toy",
             "prompt": [{"role": "user",
                         "content": " ".join(f"w{rnd.randrange(WORDS)}" for _ in range(words))}],
             "ability": "toy", "reward_model": {"style": "rule", "ground_truth": str(TARGET)},
             "extra_info": {"index": i}} for i in range(n)]
    pd.DataFrame(rows).to_parquet(path)
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """The share of response words w<i> with i < ground_truth (verl's custom_reward_function)."""
    words = solution_str.split()
    if not words:
        return 0.0
    limit = int(ground_truth)
    hits = sum(1 for w in words if w.startswith("w") and w[1:].isdigit() and int(w[1:]) < limit)
    return hits / len(words)


# --- verl's main_ppo on this machine ---------------------------------------------------------

HERE = Path(__file__).resolve().parent
TINY = ["model.preset=tiny", "train.device=cpu", "model.init_std=0.2"]
PROMPTS, N, RESPONSE = 4, 2, 8  # prompts per step, responses per prompt, response tokens


def main_ppo_overrides(hf, train, val, out, steps, save_freq=-1, v1=False):
    """main_ppo's hydra overrides: bench/verl_e2e.sh's GRPO run (model_engine=longmoe, the fused
    ppo_loss settings), cut to tiny batches and the stand-in rollout. `v1`: verl's default
    trainer (needs TransferQueue), else its legacy one (main_ppo_v0, RayPPOTrainer)."""
    return [
        "hydra.searchpath=[pkg://longmoe.integrations.verl.configs]",
        "model_engine=longmoe",
        "actor_rollout_ref.actor.longmoe.overrides=['train.device=cpu']",
        "actor_rollout_ref.actor.longmoe.dtype=float32",
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false",
        f"data.train_files={train}", f"data.val_files={val}",
        f"data.train_batch_size={PROMPTS}", "data.max_prompt_length=32",
        f"data.max_response_length={RESPONSE}", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={hf}",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.rollout.name={ROLLOUT}", f"actor_rollout_ref.rollout.n={N}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=64",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={HERE / '_verl_e2e.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        f"trainer.total_training_steps={steps}", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.save_freq={save_freq}",
        "trainer.logger=[console]", f"trainer.default_local_dir={Path(out) / 'checkpoints'}",
        f"trainer.use_v1={str(v1).lower()}",
        # one TransferQueue storage actor (v1) instead of 8, each of which takes a Ray CPU
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        # Ray's resources are logical: one "GPU" for verl's placement bundle, CPUs for its actors
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=16",
    ]


def main_ppo_env(record=None, freeze=False):
    """What every process of the run needs: this directory importable, this module imported by
    verl, the host platform; and the stand-in's sync record."""
    env = {"PYTHONPATH": os.pathsep.join([str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                         if p]),
           "VERL_USE_EXTERNAL_MODULES": "_verl_e2e", "VERL_PLATFORM": PLATFORM,
           "TOKENIZERS_PARALLELISM": "false", FREEZE: "1" if freeze else "0"}
    if record:
        env[RECORD] = str(record)
    return env


def prepare(out, steps=3, v1=False):
    """The model directory and data under `out`; (environment, main_ppo's argv)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    hf = write_model(out / "hf", TINY)
    train = write_data(out / "train.parquet", 4 * PROMPTS, seed=0)
    val = write_data(out / "val.parquet", PROMPTS, seed=1)
    argv = [sys.executable, "-m", "verl.trainer.main_ppo",
            *main_ppo_overrides(hf, train, val, out, steps, v1=v1)]
    return main_ppo_env(out / "syncs.jsonl"), argv


if __name__ == "__main__":
    # python tests/_verl_e2e.py OUT [STEPS] [v1]: writes OUT/hf and the parquet, prints the
    # command (verl's legacy trainer; "v1": its default one)
    import shlex
    env, argv = prepare(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3,
                        v1=len(sys.argv) > 3 and sys.argv[3] == "v1")
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv))
