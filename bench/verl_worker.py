"""verl's worker path against PolicyTrainer called directly, on the same batch, one GPU.

One process, one model: verl's TrainingWorker over LongMoEEngine, and the PolicyTrainer that the
engine holds called directly. Two arms on the same samples, interleaved (their order alternates
from step to step), so both run the same compiled kernels and autotuned configs:

  direct  PolicyTrainer.compute_logprobs (the log-prob pass), then forward_backward + optim_step
          (the update) with those log-probs as old_logprobs
  verl    as the actor worker drives it: the rollout's padded batch through verl's
          left_right_2_no_padding, infer_batch (compute_log_prob) and its padded log-probs back,
          then train_mini_batch (update_actor: one mini-batch, one epoch, verl's ppo_loss) with
          those log-probs

Cases: `packed32k`, samples of the log-normal length distribution that fill one 32K token
budget (one micro-batch); `grpo`, --samples samples of prompt 1024 + response
lognormal:6144:31744 in 32K-token micro-batches. Each case: one untimed pass of each kind and arm
(compile and warm-up), then --steps timed rounds; per arm the median pass as useful tokens/s (the
samples' own tokens per second) and the peak memory over its timed passes.

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


def build_worker(args):
    """verl's TrainingWorker over the longmoe engine, as ActorRolloutRefWorker.init_model builds
    its actor, with verl's ppo_loss as the loss."""
    from functools import partial

    from verl.workers.config import HFModelConfig, OptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    from longmoe.integrations.verl import LongMoEActorConfig, LongMoEEngineConfig
    from longmoe.model.hf import hf_config
    from longmoe.train.config import load_run_config

    over = list(args.set) + LOSS
    run = load_run_config(args.config, over)
    hf_dir = Path(tempfile.mkdtemp(prefix="longmoe-verl-bench-"))
    (hf_dir / "config.json").write_text(json.dumps(hf_config(run.model)))
    actor = LongMoEActorConfig(
        strategy="longmoe", rollout_n=1, ppo_mini_batch_size=1, use_dynamic_bsz=True,
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
    return w


def arms(w, ss) -> dict:
    """arm -> (log-prob pass, update given old log-probs); both return what they computed."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from longmoe.data.sample import Sample
    pt = w.engine.trainer
    worker_s = []  # seconds of each TrainingWorker.infer_batch call, in order

    def direct_logprobs():
        return pt.compute_logprobs(ss)

    def direct_update(old):
        with_old = [Sample(s.prompt, s.response, s.advantage, old_logprobs=o, index=s.index)
                    for s, o in zip(ss, old)]
        out = pt.forward_backward(with_old)
        step = pt.optim_step()
        return {"loss": float(out["loss"]), "grad_norm": float(step["grad_norm"])}

    def verl_logprobs():
        td = verl_batch(ss)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False,
                             max_token_len_per_gpu=BUDGET)
        # the worker's call alone (its outputs are host tensors: it has waited for the device),
        # without the trainer-side padding conversions around it
        t = time.perf_counter()
        out = w.infer_batch(td)
        worker_s.append(time.perf_counter() - t)
        lp = no_padding_2_padding(tu.get(out, "log_probs"), td)  # [n, R], verl's layout
        return [row[:s.response.numel()] for row, s in zip(lp, ss)]

    def verl_update(old):
        td = verl_batch(ss, old)
        tu.assign_non_tensor(td, global_batch_size=len(ss), mini_batch_size=len(ss), epochs=1,
                             seed=0, dataloader_kwargs={"shuffle": False},
                             calculate_entropy=False, temperature=1.0)
        m = tu.get(w.train_mini_batch(td), "metrics")
        return {"loss": float(m["loss"][0]), "grad_norm": float(m["grad_norm"][0]),
                "ppo_kl": float(m["actor/ppo_kl"][0]), "fused_ppo_loss": w.engine.fused_last}
    return {"direct": (direct_logprobs, direct_update), "verl": (verl_logprobs, verl_update),
            "worker_s": worker_s}


def run_case(w, case: str, args, device) -> list[dict]:
    ss = samples(case, args.samples, args.seed, w.engine.trainer.run.model.vocab_size)
    tok = sum(len(s) for s in ss)
    fns = arms(w, ss)
    worker_s = fns.pop("worker_s")
    res = {a: {"arm": a, "case": case, "samples": len(ss), "tokens": tok, "logprob_s": [],
               "update_s": [], "updates": [], "peak_gib": 0.0} for a in fns}
    for a, (logprobs, update) in fns.items():  # compile and warm-up
        res[a]["first_logprob_s"], old = timed(logprobs, device)
        res[a]["first_update_s"], _ = timed(lambda: update(old), device)
    worker_s.clear()
    for step in range(args.steps):
        for a in (("direct", "verl") if step % 2 == 0 else ("verl", "direct")):
            logprobs, update = fns[a]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            s, old = timed(logprobs, device)
            res[a]["logprob_s"].append(s)
            s, u = timed(lambda: update(old), device)
            res[a]["update_s"].append(s)
            res[a]["updates"].append(u)
            if device.type == "cuda":
                res[a]["peak_gib"] = max(res[a]["peak_gib"],
                                         torch.cuda.max_memory_allocated(device) / 2**30)
    # verl's log-prob pass without the trainer's padding conversions (left_right_2_no_padding,
    # no_padding_2_padding), which verl's trainer runs outside the worker
    res["verl"]["infer_batch_s"] = list(worker_s)
    if args.profile:  # one more log-prob pass per arm under the profiler: where the time goes
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        for a, (logprobs, _) in fns.items():
            with profile(activities=acts) as prof:
                timed(logprobs, device)
            ka = prof.key_averages()
            sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
            Path(args.profile, f"{case}_{a}_logprob_ops.txt").write_text(
                ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n\n"
                + ka.table(sort_by=sort, row_limit=25))
    res["verl"]["infer_batch_tok_s"] = tok / statistics.median(res["verl"]["infer_batch_s"])
    for r in res.values():
        r["logprob_tok_s"] = tok / statistics.median(r["logprob_s"])
        r["update_tok_s"] = tok / statistics.median(r["update_s"])
    return list(res.values())


def _state(pt) -> list[torch.Tensor]:
    """Every parameter shard and AdamW moment of the trainer, in a fixed order."""
    from torch.distributed.tensor import DTensor
    loc = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    out = [loc(p).detach() for p in pt.model.parameters()]
    for st in pt.optim.state.values():
        out += [loc(v).detach() for k, v in st.items() if torch.is_tensor(v) and k != "step"]
    return out


def _fingerprints(state: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """Per tensor (bytes, sum of its 32-bit words, sum of word * position), exact int64
    arithmetic where the tensor lives. Host copies of the 40-layer state (about 80 GB) beside
    what the offload itself puts in host memory would not fit a 128 GiB host; a change of any
    word changes a sum unless another change cancels it in both."""
    out = []
    for t in state:
        b = t.contiguous().view(-1).view(torch.uint8)
        w = b[: b.numel() // 4 * 4].view(torch.int32)
        acc, pos = 0, 0
        for piece in w.split(1 << 26):
            v = piece.to(torch.int64)
            i = torch.arange(pos, pos + v.numel(), device=v.device, dtype=torch.int64)
            acc += int(v.sum()) + (int((v * i).sum()) << 1)
            pos += v.numel()
        tail = b[w.numel() * 4:]
        out.append((b.numel(), acc, int(tail.to(torch.int64).sum()) if tail.numel() else 0))
    return out


def offload_round(w, args, device) -> dict:
    """verl's manual offload and reload (engine.to, what its colocated rollout does around
    generation) after the timed cases: the device memory the trainer gives up, the seconds each
    way, and whether the state and the log-probs after the round trip are bit for bit those
    before it."""
    pt = w.engine.trainer
    ss = samples("packed32k", args.samples, args.seed + 7, pt.run.model.vocab_size)
    lp_before = pt.compute_logprobs(ss)
    state = _state(pt)
    before = _fingerprints(state)
    sync(device)
    gib = lambda b: b / 2**30  # noqa: E731
    out = {"allocated_gib": gib(torch.cuda.memory_allocated(device)),
           "reserved_gib": gib(torch.cuda.memory_reserved(device)),
           "state_gib": gib(sum(t.numel() * t.element_size() for t in state))}
    del state
    out["offload_s"], _ = timed(lambda: w.engine.to("cpu", model=True, optimizer=True), device)
    out["offloaded_allocated_gib"] = gib(torch.cuda.memory_allocated(device))
    out["offloaded_reserved_gib"] = gib(torch.cuda.memory_reserved(device))
    out["reload_s"], _ = timed(lambda: w.engine.to("cuda", model=True, optimizer=True), device)
    out["state_fingerprints_equal"] = _fingerprints(_state(pt)) == before
    lp_after = pt.compute_logprobs(ss)
    out["logprobs_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(lp_before, lp_after))
    out["tokens"] = sum(len(s) for s in ss)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="gpu_smoke")
    p.add_argument("--set", action="append", default=[], help="longmoe override, repeatable")
    p.add_argument("--cases", default="packed32k,grpo")
    p.add_argument("--samples", type=int, default=16, help="grpo: samples in the batch")
    p.add_argument("--steps", type=int, default=3, help="timed rounds per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--offload", action="store_true",
                   help="after the cases, one offload/reload round trip (engine.to): memory "
                        "freed, seconds, state and log-probs unchanged")
    p.add_argument("--profile", metavar="DIR",
                   help="also profile one log-prob pass per arm and case: DIR/CASE_ARM_logprob_ops.txt")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from longmoe.bench import write_json_and_table
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:  # a host check of the harness only (tiny model, verl's host platform set by the caller)
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    t0 = time.perf_counter()
    w = build_worker(args)
    build_s = time.perf_counter() - t0
    runs = []
    for case in args.cases.split(","):
        runs += run_case(w, case, args, device)
        for r in runs[-2:]:
            print(json.dumps(r)[:400], flush=True)
        # after every case: a cut-off run keeps what it measured
        report = report_of(args, runs)
        report["build_s"] = build_s
        write_json_and_table(report, args.out, table)
    if args.offload and device.type == "cuda":
        report["offload"] = offload_round(w, args, device)
        print(json.dumps(report["offload"]), flush=True)
        write_json_and_table(report, args.out, table)
    dist.destroy_process_group()


def report_of(args, runs) -> dict:
    ratios = {}
    for case in args.cases.split(","):
        d = next((r for r in runs if r["case"] == case and r["arm"] == "direct"), {})
        v = next((r for r in runs if r["case"] == case and r["arm"] == "verl"), {})
        if "update_tok_s" in d and "update_tok_s" in v:
            ratios[case] = {"update_tok_s": v["update_tok_s"] / d["update_tok_s"],
                            "logprob_tok_s": v["logprob_tok_s"] / d["logprob_tok_s"],
                            "infer_batch_tok_s": v["infer_batch_tok_s"] / d["logprob_tok_s"],
                            "peak": v["peak_gib"] / d["peak_gib"] if d["peak_gib"] else None}
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
                    f"tok/s {x['logprob_tok_s']:.3f} (infer_batch alone "
                    f"{x['infer_batch_tok_s']:.3f}), peak {x['peak'] or 0:.3f}"
                    for c, x in report["verl_over_direct"].items())
    off = report.get("offload")
    if off:
        ratio += (f"\n\noffload (engine.to, parameters and AdamW moments, "
                  f"{off['state_gib']:.1f} GiB): device allocated {off['allocated_gib']:.1f} -> "
                  f"{off['offloaded_allocated_gib']:.2f} GiB (reserved "
                  f"{off['offloaded_reserved_gib']:.2f} GiB), {off['offload_s']:.1f} s to the "
                  f"host, {off['reload_s']:.1f} s back; state fingerprints (per tensor, sums of "
                  f"its 32-bit words) equal: {off['state_fingerprints_equal']}; log-probs max abs diff after the round trip: "
                  f"{off['logprobs_max_abs_diff']:.3g}")
    return head + "\n".join(rows) + "\n" + ratio


if __name__ == "__main__":
    main()
