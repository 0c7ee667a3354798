"""verl's worker path against PolicyTrainer called directly, on the same batch, one GPU.

Two arms, each in its own process (fresh allocator, same compile cache), on the same samples:

  direct  PolicyTrainer.compute_logprobs (the log-prob pass), then forward_backward + optim_step
          (the update) with those log-probs as old_logprobs
  verl    verl's TrainingWorker over LongMoEEngine, as the actor worker drives it:
          infer_batch (compute_log_prob) on the no-padding batch, then train_mini_batch
          (update_actor: one mini-batch, one epoch, verl's ppo_loss) with those log-probs

Cases: `packed32k`, samples of the log-normal length distribution that fill one 32K token
budget (one micro-batch); `grpo`, --samples samples of prompt 1024 + response
lognormal:6144:31744 in 32K-token micro-batches. Each case: one untimed pass of each kind (compile
and warm-up), then --steps timed passes; the median of each is reported, as useful tokens/s
(the samples' own tokens), with the peak memory over the timed passes.

verl's worker runs in this process, as in verl's own engine tests; under `main_ppo` it is a ray
actor, whose remote-call cost this bench does not include.

    python bench/verl_worker.py --out results/h200/verl_worker.json \
        --config gpu_smoke --set model.num_layers=40 ...
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT, RESP_MEAN, BUDGET = 1024, 6144, 32768
LOSS = ["loss.type=grpo", "loss.kl_coef=0.0", "loss.entropy_coef=0.0", "optim.warmup_steps=0",
        f"data.max_tokens_per_micro_batch={BUDGET}"]
LR, CLIP = 1e-6, 1.0


def lengths(case: str, n: int, seed: int) -> list[int]:
    """Total lengths of the case's samples (prompt + response)."""
    from longmoe.data.lengths import parse_length
    dist = parse_length(f"lognormal:{RESP_MEAN}:{BUDGET - PROMPT}", "response_len")
    g = torch.Generator().manual_seed(seed)
    out = []
    while True:
        L = PROMPT + dist.draw(float(torch.rand((), generator=g)))
        if case == "packed32k":
            if sum(out) + L > BUDGET:
                return out
        elif len(out) == n:
            return out
        out.append(L)


def samples(case: str, n: int, seed: int, vocab: int):
    from longmoe.data.sample import Sample
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for i, L in enumerate(lengths(case, n, seed)):
        ids = torch.randint(0, vocab, (L,), generator=g)
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(Sample(ids[:PROMPT], ids[PROMPT:], advantage=adv, index=i))
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device):
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def verl_batch(ss, old=None):
    """The batch verl's trainer hands the actor: the rollout's padded batch (prompts padded on
    the left, responses on the right, attention/response masks, advantages per response token,
    old log-probs) through verl's left_right_2_no_padding."""
    from tensordict import TensorDict
    from verl.utils.model import compute_position_id_with_mask
    from verl.workers.utils.padding import left_right_2_no_padding
    P = max(s.prompt.numel() for s in ss)
    R = max(s.response.numel() for s in ss)
    pad = torch.nn.functional.pad
    prompts = torch.stack([pad(s.prompt, (P - s.prompt.numel(), 0)) for s in ss])
    responses = torch.stack([pad(s.response, (0, R - s.response.numel())) for s in ss])
    pmask = torch.stack([pad(torch.ones(s.prompt.numel(), dtype=torch.long),
                             (P - s.prompt.numel(), 0)) for s in ss])
    rmask = torch.stack([pad(torch.ones(s.response.numel(), dtype=torch.long),
                             (0, R - s.response.numel())) for s in ss])
    attention = torch.cat([pmask, rmask], 1)
    td = {"prompts": prompts, "responses": responses,
          "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention,
          "position_ids": compute_position_id_with_mask(attention), "response_mask": rmask,
          "advantages": torch.stack([torch.full((R,), float(s.advantage)) for s in ss]) * rmask}
    if old is not None:
        td["old_log_probs"] = torch.stack([pad(o.float().cpu(), (0, R - o.numel())) for o in old])
    return left_right_2_no_padding(TensorDict(td, batch_size=[len(ss)]))


def arm_direct(args, ss, device):
    from longmoe.api import PolicyTrainer
    over = list(args.set) + LOSS + [f"optim.lr={LR}", "optim.weight_decay=0.0",
                                    f"optim.grad_clip={CLIP}"]
    pt = PolicyTrainer.from_config(args.config, over)
    from longmoe.data.sample import Sample

    def logprobs():
        return pt.compute_logprobs(ss)

    def update(old):
        with_old = [Sample(s.prompt, s.response, s.advantage, old_logprobs=o, index=s.index)
                    for s, o in zip(ss, old)]
        out = pt.forward_backward(with_old)
        step = pt.optim_step()
        return {"loss": float(out["loss"]), "grad_norm": float(step["grad_norm"])}
    return pt.run, logprobs, update, {}


def arm_verl(args, ss, device):
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import HFModelConfig, OptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from functools import partial
    from longmoe.integrations.verl import LongMoEActorConfig, LongMoEEngineConfig
    from longmoe.model.hf import hf_config
    from longmoe.train.config import load_run_config

    over = list(args.set) + LOSS
    run = load_run_config(args.config, over)
    hf_dir = Path(tempfile.mkdtemp(prefix="longmoe-verl-bench-"))
    (hf_dir / "config.json").write_text(json.dumps(hf_config(run.model)))
    actor = LongMoEActorConfig(
        strategy="longmoe", rollout_n=1, ppo_mini_batch_size=len(ss), use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=BUDGET, ppo_epochs=1, clip_ratio=0.2,
        loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False,
        optim=OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=CLIP),
        longmoe=LongMoEEngineConfig(strategy="longmoe", run_config=args.config, overrides=over,
                                    model_from_path=False, dtype="bfloat16"))
    model = HFModelConfig(path=str(hf_dir), load_tokenizer=False)
    cfg = TrainingWorkerConfig(model_type="language_model", model_config=model,
                               engine_config=actor.engine, optimizer_config=actor.optim,
                               checkpoint_config=actor.checkpoint)
    cfg.engine_config.use_dynamic_bsz = True
    cfg.engine_config.max_token_len_per_gpu = BUDGET
    cfg.engine_config.infer_max_token_len_per_gpu = BUDGET
    w = TrainingWorker(cfg)
    w.reset()
    w.set_loss_fn(partial(ppo_loss, config=actor))
    info = {}

    def logprobs():
        from verl.workers.utils.padding import no_padding_2_padding
        td = verl_batch(ss)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False,
                             max_token_len_per_gpu=BUDGET)
        out = w.infer_batch(td)
        lp = no_padding_2_padding(tu.get(out, "log_probs"), td)  # [n, R], verl's layout
        return [row[:s.response.numel()] for row, s in zip(lp, ss)]

    def update(old):
        td = verl_batch(ss, old)
        tu.assign_non_tensor(td, global_batch_size=len(ss), mini_batch_size=len(ss), epochs=1,
                             seed=0, dataloader_kwargs={"shuffle": False},
                             calculate_entropy=False, temperature=1.0)
        m = tu.get(w.train_mini_batch(td), "metrics")
        info["fused_ppo_loss"] = bool(w.engine.fused_last)
        return {"loss": float(m["loss"][0]), "grad_norm": float(m["grad_norm"][0]),
                "ppo_kl": float(m["actor/ppo_kl"][0])}
    return run, logprobs, update, info


def one_arm(args) -> dict:
    import torch.distributed as dist
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000)}.items():
        os.environ.setdefault(k, v)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:  # a host check of the harness (tiny model, --smoke)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    from longmoe.train.config import load_run_config
    run = load_run_config(args.config, list(args.set))
    ss = samples(args.case, args.samples, args.seed, run.model.vocab_size)
    build = arm_direct if args.arm == "direct" else arm_verl
    t0 = time.perf_counter()
    run, logprobs, update, info = build(args, ss, device)
    out = {"arm": args.arm, "case": args.case, "samples": len(ss),
           "tokens": sum(len(s) for s in ss), "build_s": time.perf_counter() - t0}
    first_lp, old = timed(logprobs, device)
    first_up, _ = timed(lambda: update(old), device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    lp_s, up_s, ups = [], [], []
    for _ in range(args.steps):
        s, old = timed(logprobs, device)
        lp_s.append(s)
        s, u = timed(lambda: update(old), device)
        up_s.append(s)
        ups.append(u)
    tok = out["tokens"]
    out.update(first_logprob_s=first_lp, first_update_s=first_up, logprob_s=lp_s,
               update_s=up_s, updates=ups,
               logprob_tok_s=tok / statistics.median(lp_s),
               update_tok_s=tok / statistics.median(up_s),
               peak_gib=(torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else 0.0), **info)
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="gpu_smoke")
    p.add_argument("--set", action="append", default=[], help="longmoe override, repeatable")
    p.add_argument("--cases", default="packed32k,grpo")
    p.add_argument("--samples", type=int, default=16, help="grpo: samples in the batch")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--arm", choices=("direct", "verl"), help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.arm:  # one arm, this process
        Path(args.out).write_text(json.dumps(one_arm(args)))
        return
    sys.path.insert(0, str(ROOT))
    from longmoe.bench import write_json_and_table
    runs = []
    for case in args.cases.split(","):
        for arm in ("direct", "verl"):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                cmd = [sys.executable, __file__, "--arm", arm, "--case", case, "--out", f.name,
                       "--config", args.config, "--samples", str(args.samples),
                       "--steps", str(args.steps), "--seed", str(args.seed)]
                for s in args.set:
                    cmd += ["--set", s]
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    runs.append({"arm": arm, "case": case, "status": "failed",
                                 "log_tail": r.stderr.strip().splitlines()[-12:]})
                else:
                    runs.append(json.loads(Path(f.name).read_text()))
                print(json.dumps(runs[-1])[:600], flush=True)
            # after every arm: a cut-off run keeps what it measured
            write_json_and_table(report_of(args, runs), args.out, table)


def report_of(args, runs) -> dict:
    ratios = {}
    for case in args.cases.split(","):
        d = next((r for r in runs if r["case"] == case and r["arm"] == "direct"), {})
        v = next((r for r in runs if r["case"] == case and r["arm"] == "verl"), {})
        if "update_tok_s" in d and "update_tok_s" in v:
            ratios[case] = {"update_tok_s": v["update_tok_s"] / d["update_tok_s"],
                            "logprob_tok_s": v["logprob_tok_s"] / d["logprob_tok_s"],
                            "peak": v["peak_gib"] / d["peak_gib"]}
    report = {"bench": "verl-worker", "config": args.config, "overrides": args.set,
              "budget": BUDGET, "steps": args.steps, "runs": runs, "verl_over_direct": ratios}
    try:
        from importlib.metadata import version
        report["verl"] = version("verl")
    except Exception:  # noqa: BLE001 - not installed: the verl arm failed and says why
        report["verl"] = None
    return report


def table(report: dict) -> str:
    head = ("| case | arm | samples | tokens | log-prob tok/s | update tok/s | peak GiB |\n"
            "|---|---|---|---|---|---|---|\n")
    rows = []
    for r in report["runs"]:
        if "update_tok_s" not in r:
            rows.append(f"| {r['case']} | {r['arm']} | failed | | | | |")
            continue
        rows.append(f"| {r['case']} | {r['arm']} | {r['samples']} | {r['tokens']:,} | "
                    f"{r['logprob_tok_s']:,.0f} | {r['update_tok_s']:,.0f} | "
                    f"{r['peak_gib']:.2f} |")
    ratio = "".join(f"\n{c}: verl over direct: update tok/s {x['update_tok_s']:.3f}, log-prob "
                    f"tok/s {x['logprob_tok_s']:.3f}, peak {x['peak']:.3f}"
                    for c, x in report["verl_over_direct"].items())
    return head + "\n".join(rows) + "\n" + ratio


if __name__ == "__main__":
    main()
