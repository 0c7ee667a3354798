"""A closed GRPO loop on CPU: longmoe trains, Hugging Face transformers generates.

    python examples/rl_loop.py --nproc 2              # spawns 2 gloo ranks
    torchrun --nproc-per-node 2 examples/rl_loop.py   # or joins the ranks torchrun started

Every iteration:
  1. hand-off   the policy's weights go from the longmoe ranks into a transformers
                Qwen3_5MoeForCausalLM on rank 0 (PolicyTrainer.named_weights_for_rollout with
                senders="rank0", then longmoe.rl.weights.load_into_hf_model);
  2. rollouts   transformers samples G responses per prompt (temperature 1, no top-k/top-p) for a
                verifiable toy task; rollout_logprobs come from the generation's logits;
  3. reward     the fraction of response positions that are correct; GRPO advantages normalise
                each prompt's group;
  4. samples    broadcast from rank 0 to every rank (the same global list on each);
  5. old        PolicyTrainer.compute_logprobs gives pi_old; transformers' teacher-forced
                log-probs of the same tokens must equal them (printed as |hf - ours|), so the
                truncated-IS weight exp(old - rollout) corrects sampling numerics only;
  6. update     PPO mini-batches: PolicyTrainer.forward_backward + optim_step per mini-batch.

The task (--task): prompts are --length digits from 0..--digits-1 followed by a separator token;
the answer is the digits sorted, reversed or copied. The vocabulary is the digits and the
separator, so a freshly initialised model already hits 1/(digits+1) of the positions and GRPO has
signal from the first iteration.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

TASKS = ("sort", "reverse", "copy")


# ---- the toy task --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    name: str
    digits: int
    length: int

    @property
    def sep(self) -> int:
        return self.digits

    @property
    def vocab_size(self) -> int:
        return self.digits + 1

    def prompts(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, length + 1]: digits, then the separator the answer follows."""
        x = torch.randint(0, self.digits, (n, self.length), generator=gen)
        return torch.cat([x, torch.full((n, 1), self.sep)], 1)

    def answers(self, prompts: torch.Tensor) -> torch.Tensor:
        x = prompts[:, :self.length]
        if self.name == "sort":
            return x.sort(1).values
        if self.name == "reverse":
            return x.flip(1)
        return x

    def rewards(self, prompts: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """Fraction of the response's positions that hold the right digit, per response."""
        return (responses == self.answers(prompts)).float().mean(1)


def grpo_advantages(rewards_PG: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each prompt's G rewards minus their mean over their standard deviation: a group whose
    responses all scored alike has nothing to teach and gets 0."""
    mean = rewards_PG.mean(1, keepdim=True)
    std = rewards_PG.std(1, keepdim=True, unbiased=False)
    return (rewards_PG - mean) / (std + eps)


# ---- the rollout engine (rank 0) -----------------------------------------------------------------

def build_engine(run):
    """A transformers Qwen3.5-MoE built from longmoe's config (no hub, no weights yet), fp32 so
    that its log-probs can be held to longmoe's."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    from longmoe.model.hf import hf_config
    conf = {k: v for k, v in hf_config(run.model, "float32").items()
            if k not in ("model_type", "architectures")}
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**conf)).eval()


def hand_off(pt, engine, bucket_bytes: int) -> float:
    """Every rank drains the iterator (its gathers are collectives); rank 0 receives all."""
    from longmoe.rl.weights import load_into_hf_model
    t0 = time.perf_counter()
    buckets = pt.named_weights_for_rollout(bucket_bytes, senders="rank0")
    if engine is not None:
        load_into_hf_model(engine, buckets, pt.run)  # checks the engine's config first
    else:
        for _ in buckets:  # rank 0 gathers the experts this rank holds
            pass
    return time.perf_counter() - t0


@torch.no_grad()
def generate(engine, prompts: torch.Tensor, length: int, seed: int):
    """(responses [N, length], their log-probs under the sampling distribution [N, length])."""
    torch.manual_seed(seed)  # transformers samples from the global generator
    out = engine.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=length,
                          min_new_tokens=length, eos_token_id=None, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    responses = out.sequences[:, prompts.shape[1]:]
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)
    return responses, logp.gather(-1, responses[..., None])[..., 0]


@torch.no_grad()
def teacher_forced_logprobs(engine, prompts: torch.Tensor, responses: torch.Tensor):
    """log p(response tokens) from one forward over prompt + response [N, length]."""
    ids = torch.cat([prompts, responses], 1)
    logp = torch.log_softmax(engine(ids).logits.float(), -1)[:, prompts.shape[1] - 1:-1]
    return logp.gather(-1, responses[..., None])[..., 0]


# ---- one iteration -------------------------------------------------------------------------------

def make_samples(prompts, responses, rollout_lp, advantages, iteration: int):
    from longmoe.data.sample import Sample
    return [Sample(prompt=prompts[i].clone(), response=responses[i].clone(),
                   advantage=float(advantages[i]), rollout_logprobs=rollout_lp[i].clone(),
                   index=i, where=f"iteration {iteration} rollout {i}")
            for i in range(prompts.shape[0])]


def rollout_phase(args, task, engine, iteration: int):
    """On rank 0: the samples of one iteration and what to log about them."""
    gen = torch.Generator().manual_seed(args.seed * 100003 + iteration)
    prompts = task.prompts(args.prompts, gen).repeat_interleave(args.group, 0)
    responses, rollout_lp = generate(engine, prompts, task.length, args.seed + iteration)
    rewards = task.rewards(prompts, responses)
    adv = grpo_advantages(rewards.view(args.prompts, args.group)).reshape(-1)
    hf_tf = teacher_forced_logprobs(engine, prompts, responses)
    samples = make_samples(prompts, responses, rollout_lp, adv, iteration)
    return samples, {"reward": float(rewards.mean()),
                     "solved": float((rewards == 1).float().mean())}, hf_tf


def mean_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return sum(vals) / len(vals) if vals else float("nan")


def iteration(args, task, pt, engine, it: int, rank: int) -> dict:
    t0 = time.perf_counter()
    handoff_s = hand_off(pt, engine, args.bucket_bytes)
    box = [None]
    if rank == 0:
        box[0] = rollout_phase(args, task, engine, it)
    t1 = time.perf_counter()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    samples, row, hf_tf = box[0]

    old = pt.compute_logprobs(samples)
    # The hand-off check: transformers' own forward on the weights it was just given against
    # longmoe's forward-only log-probs of the same tokens.
    ours = torch.stack([o.float() for o in old])
    row["hf_vs_ours"] = float((hf_tf - ours).abs().max())
    rollout = torch.stack([s.rollout_logprobs for s in samples])
    row["rollout_vs_ours"] = float((rollout - ours).abs().max())
    samples = [replace(s, old_logprobs=o.float()) for s, o in zip(samples, old)]
    t2 = time.perf_counter()

    per_mb = math.ceil(len(samples) / args.mini_batches)
    stats, infos = [], []
    for _ in range(args.epochs):
        # Seeded alike on every rank: each mini-batch must be the same global list everywhere.
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(it))
        for j in range(args.mini_batches):
            mb = [samples[i] for i in order[j * per_mb:(j + 1) * per_mb].tolist()]
            stats.append(pt.forward_backward(mb))
            infos.append(pt.optim_step())
    # How far the updates moved the policy on this iteration's tokens (k3 estimate of
    # KL(pi_old || pi_new)).
    new = torch.stack([n.float() for n in pt.compute_logprobs(samples)])
    d = ours - new
    row["kl_old_new"] = float((torch.expm1(-d) + d).mean())
    t3 = time.perf_counter()
    for k in stats[0]:
        if isinstance(stats[0][k], (int, float)):
            row[k] = mean_of(stats, k)
    row["grad_norm"] = mean_of(infos, "grad_norm")
    row["skipped_steps"] = sum(bool(i.get("skipped")) for i in infos)
    row.update(iteration=it + 1, handoff_s=handoff_s, rollout_s=t1 - t0 - handoff_s,
               logprob_s=t2 - t1, update_s=t3 - t2, time_s=t3 - t0)
    return row


def fmt(row: dict) -> str:
    def g(k, spec):
        return format(row[k], spec) if k in row else "-"
    return (f"iter {row['iteration']:3d}  reward {row['reward']:.3f}  solved {row['solved']:.3f}  "
            f"loss {g('loss', '+.4f')}  clip {g('clip_frac', '.3f')}  "
            f"kl {row['kl_old_new']:.2e}  tis {g('tis_weight', '.6f')}  "
            f"|hf-ours| {row['hf_vs_ours']:.1e}  |rollout-ours| {row['rollout_vs_ours']:.1e}  "
            f"{row['time_s']:.1f}s")


# ---- ranks ---------------------------------------------------------------------------------------

def run_config(args):
    from longmoe.train.config import load_run_config
    task = Task(args.task, args.digits, args.length)
    return load_run_config(None, [
        "model.preset=tiny-hybrid", f"model.vocab_size={task.vocab_size}", "train.device=cpu",
        # Plain-torch Gated DeltaNet core on CPU (no Triton interpreter in the loop).
        "impl.gated_delta=chunked",
        f"optim.lr={args.lr}", "optim.grad_clip=1.0", "loss.type=grpo",
        # TIS on: with the hand-off exact its weights stay at 1 (what the loop checks).
        "loss.tis_cap=2.0", f"train.seed={args.seed}", *args.set])


def loop(rank: int, world: int, args) -> list[dict]:
    from longmoe.api import PolicyTrainer
    torch.manual_seed(args.seed)
    run = run_config(args)
    task = Task(args.task, args.digits, args.length)
    pt = PolicyTrainer(run)
    engine = build_engine(run) if rank == 0 else None
    rows = []
    out = open(args.metrics_out, "w") if (args.metrics_out and rank == 0) else None
    try:
        for it in range(args.iterations):
            row = iteration(args, task, pt, engine, it, rank)
            rows.append(row)
            if rank == 0:
                print(fmt(row), flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out:
            out.close()
    if rank == 0:
        k = min(3, len(rows))
        print(f"mean reward: first {k} iterations {mean_of(rows[:k], 'reward'):.3f}, last {k} "
              f"{mean_of(rows[-k:], 'reward'):.3f}; max |hf - ours| "
              f"{max(r['hf_vs_ours'] for r in rows):.1e}; "
              f"{sum(r['time_s'] for r in rows):.0f} s", flush=True)
    return rows


def _spawned(rank: int, world: int, backend, args):
    return loop(rank, world, args)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks to spawn (not under torchrun)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    p.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    p.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per epoch")
    p.add_argument("--epochs", type=int, default=1, help="passes over each iteration's samples")
    p.add_argument("--task", default="sort")
    p.add_argument("--digits", type=int, default=6)
    p.add_argument("--length", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-bytes", type=int, default=1 << 20)
    p.add_argument("--metrics-out", default="", help="one JSON line per iteration (rank 0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="run-config override, e.g. --set loss.clip_high=0.2")
    args = p.parse_args(argv)
    check(args)
    return args


def check(args):
    """Everything a rank would trip over, before any rank starts: one line naming the flag."""
    from longmoe.errors import UserError
    if args.task not in TASKS:
        raise UserError(f"--task: must be one of {', '.join(TASKS)}, got {args.task!r}")
    for name, low in (("nproc", 1), ("iterations", 1), ("prompts", 1), ("group", 2),
                      ("mini_batches", 1), ("epochs", 1), ("digits", 2), ("length", 1),
                      ("bucket_bytes", 1)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')}: must be >= {low}, got "
                            f"{getattr(args, name)}")
    if args.mini_batches > args.prompts * args.group:
        raise UserError(f"--mini-batches: {args.mini_batches} exceeds the "
                        f"{args.prompts * args.group} samples of an iteration")
    run_config(args)  # the run config's own checks name their field


def main(argv=None) -> int:
    from longmoe.errors import UserError
    try:
        args = parse(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        from longmoe.train.trainer import leave_together
        dist.init_process_group("gloo")
        try:
            loop(dist.get_rank(), dist.get_world_size(), args)
            leave_together()
        finally:
            dist.destroy_process_group()
        return 0
    from longmoe.api import run_local
    run_local(_spawned, args.nproc, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
