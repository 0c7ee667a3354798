"""The per-rank policy-update loop: build the layout and model, then for each step fetch this rank's
micro-batches (longmoe.train.feed), run forward (linear-CE log-probs) and the RL loss, backward,
accumulating over micro-batches (longmoe.train.step.accumulate), clip, AdamW, log, checkpoint.

A step whose loss or gradient norm is non-finite on any rank is skipped: no AdamW update (its
moments and step count stay), no master-weight copy, no router expert-bias update. The learning
rate schedule still advances: it is a function of the step index, which is how a resumed run
rebuilds it. train.max_bad_steps such steps in a row stop the run (TrainingStopped, exit code 3)
without saving. A step with no trained token on any rank is skipped the same way, without counting
as bad. Parameters are checked finite before every save.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from longmoe.backends import active_backend, get_backend
from longmoe.backends.base import Backend
from longmoe.errors import UserError
from longmoe.model.flops import dense_peak_flops, step_flops
from longmoe.ops.gated_delta import gated_delta_choice
from longmoe.parallel.mesh import build_layout
from longmoe.train import checkpoint as ckpt
from longmoe.train.config import RunConfig
from longmoe.train.feed import Feed, StepData
from longmoe.train.progress import Progress
from longmoe.train.precision import MasterWeights
from longmoe.train.impl_check import check_on_rank
from longmoe.train.setup import all_finite, build_model, clip_grad_norm, torch_dtype
from longmoe.train.step import accumulate, step_counts
from longmoe.train.supervise import TrainingStopped


@dataclass(frozen=True)
class RunOptions:
    metrics_out: str | None = None
    checkpoint_dir: str | None = None
    resume: bool = False
    profile_dir: str | None = None   # profile one step (the third, or the last of fewer)
    overwrite: bool = False          # start at step 0; the first save replaces what DIR held
    allow_batch_change: bool = False  # resume at another global batch than the checkpoint's


def resolve_backend(device: str) -> Backend:
    return active_backend() if device == "auto" else get_backend(device)


def init_distributed(backend: Backend, rank: int, world: int, local_rank: int,
                     init_method: str | None = None):
    backend.apply_collective_env()
    backend.set_device(local_rank)
    dist.init_process_group(backend.dist_backend, init_method=init_method, rank=rank,
                            world_size=world,
                            device_id=backend.device(local_rank) if backend.device_type != "cpu"
                            else None)


def _sum(values: list[float], device, op=dist.ReduceOp.SUM) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def step_profiler(backend: Backend):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if backend.device_type != "cpu":
        acts.append(torch.profiler.ProfilerActivity.CUDA)  # also HIP kernels on ROCm builds
    return torch.profiler.profile(activities=acts, record_shapes=True)


def write_profile(prof, out_dir: str, rank: int, backend: Backend):
    """Per rank: the op table sorted by device time (host time on CPU) and a gzipped Chrome trace."""
    os.makedirs(out_dir, exist_ok=True)
    key = "self_cpu_time_total" if backend.device_type == "cpu" else "self_device_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=70)
    with open(os.path.join(out_dir, f"ops_rank{rank}.txt"), "w") as f:
        f.write(table)
    prof.export_chrome_trace(os.path.join(out_dir, f"trace_rank{rank}.json.gz"))  # gzipped by torch


def train(run: RunConfig, opts: RunOptions, backend: Backend, device: torch.device) -> dict:
    """Runs on every rank inside an initialised process group (or alone). Returns rank 0's summary."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(run.train.seed + rank)
    if backend.device_type != "cpu":
        torch.set_float32_matmul_precision(run.impl.fp32_matmul)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    model = build_model(run, layout, device)
    o = run.optim
    master = None
    if not (run.parallel.fsdp and layout.dp_mesh is not None) and run.parallel.param_dtype != "float32":
        master = MasterWeights(model, torch_dtype(run.parallel.param_dtype))
    impl = o.impl if o.impl != "auto" else ("foreach" if backend.device_type == "cpu" else "fused")
    kernel = {"foreach": {"foreach": True}, "fused": {"fused": True}, "loop": {"foreach": False}}
    optim = torch.optim.AdamW(master.parameters() if master else model.parameters(), lr=o.lr,
                              betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                              **kernel[impl])
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min(1.0, (s + 1) / o.warmup_steps) if o.warmup_steps else 1.0)
    feed = Feed(run, layout.data_rank, layout.data_world)
    progress = Progress(rank == 0, run.train.steps, opts.metrics_out, backend.memory_label)
    data_counts = feed.counts()
    if feed.describe():
        progress.info(feed.describe())
    peak_flops = dense_peak_flops(backend.probe())
    model_meta = asdict(run.model)
    model_meta["layer_types"] = list(model_meta["layer_types"])

    start = 0
    identity = ckpt.run_identity(run, world, layout.ep, layout.cp)
    replaced = not opts.overwrite  # --overwrite: the first save removes the earlier checkpoints
    if opts.resume and opts.checkpoint_dir:
        point = ckpt.resume_point(opts.checkpoint_dir, run, identity, opts.allow_batch_change,
                                  full=False)  # the launcher checked every digest
        if point is not None:
            ckpt.load(point, model, optim, backend)
            start = point.step
            for _ in range(start):
                sched.step()
            progress.info(f"resumed from {point.path} at step {start}")
            for note in point.notes:
                progress.info(f"resume: {note}")
        else:
            progress.info(f"no checkpoint in {opts.checkpoint_dir}; starting fresh")
    progress.info(f"longmoe: {world} rank(s) on {backend.name}, ep={layout.ep}, "
                  f"cp={layout.cp}, fsdp={run.parallel.fsdp}, recompute={run.parallel.recompute}, "
                  f"linear_ce={run.impl.linear_ce}, params {model_meta['num_layers']} layers")
    if any(run.model.layer_type(i) == "linear_attention" for i in range(run.model.num_layers)):
        gd = gated_delta_choice(device, run.impl.gated_delta)
        why = "; ".join(f"not {k}: {v}" for k, v in gd["skipped"].items())
        progress.info(f"Gated DeltaNet core {gd['core']} ({why or 'asked ' + gd['asked']}), "
                      f"state scan {gd['state_scan']}")
    progress.info(f"AdamW {impl}; fp32 matmuls "
                  f"{'highest (CPU)' if backend.device_type == 'cpu' else run.impl.fp32_matmul}")
    moes = model.moe_layers()
    if moes and layout.ep > 1:
        d = moes[0].dispatcher
        progress.info(f"chunked EP: chunks={d.chunks} ({model.chunks_source}), "
                      f"all-to-all {d.transport.name} ({model.transport_source}), overlap streams "
                      f"{'on' if d.streams.overlaps else 'off (host runs in order)'}")

    bad_in_a_row = first_bad = 0
    for step in range(start, run.train.steps):
        data = feed.step(step)
        global_tokens, global_samples = step_counts(data.trained_tokens, data.trained_samples,
                                                    layout, device)
        backend.synchronize()
        backend.reset_peak_memory()
        prof = (step_profiler(backend) if opts.profile_dir
                and step == min(start + 2, run.train.steps - 1) else None)
        t0 = time.perf_counter()
        with prof or contextlib.nullcontext():
            loss, aux, stats = accumulate(model, data.micro, run, layout, global_tokens, device,
                                          global_samples)
            if master:
                master.grads_to_master()
            gnorm, finite = clip_grad_norm(model, o.grad_clip, layout,
                                           master.grad_of if master else None, loss=loss + aux)
            skipped = "nonfinite" if not finite else "no_tokens" if global_tokens == 0 else None
            if skipped is None:
                optim.step()
                if master:
                    master.master_to_model()
                for moe in model.moe_layers():
                    moe.router.update_expert_bias()
            optim.zero_grad(set_to_none=True)
            sched.step()
            backend.synchronize()
        dt = time.perf_counter() - t0
        if prof is not None:
            write_profile(prof, opts.profile_dir, rank, backend)
            progress.info(f"profile of step {step + 1} (timed with the profiler on): "
                          f"{opts.profile_dir}")
        if skipped == "nonfinite":
            bad_in_a_row += 1
            first_bad = step + 1 if bad_in_a_row == 1 else first_bad
        elif skipped is None:
            bad_in_a_row = 0
        progress.step(step_metrics(run, layout, data, step, loss, aux, stats, gnorm, dt,
                                   global_tokens, sched.get_last_lr()[0], backend, device,
                                   peak_flops, skipped, bad_in_a_row))
        if bad_in_a_row >= run.train.max_bad_steps:
            progress.close()
            raise TrainingStopped(
                f"training stopped after step {step + 1}: steps {first_bad}-{step + 1} had a "
                f"non-finite loss or gradient norm and applied no update ({bad_in_a_row} in a "
                f"row, train.max_bad_steps={run.train.max_bad_steps}); " + _kept(opts))

        every = run.train.checkpoint_every
        last = step + 1 == run.train.steps
        if opts.checkpoint_dir and ((every and (step + 1) % every == 0) or last):
            if not all_finite(model.parameters(), layout, device):
                progress.close()
                raise TrainingStopped(f"training stopped after step {step + 1}: the parameters "
                                      f"are not finite, so they were not saved; "
                                      + _kept(opts))
            path = ckpt.save(opts.checkpoint_dir, step + 1, model, optim, backend, run, identity)
            progress.info(f"checkpoint: {path}")
            if not replaced:
                removed, replaced = ckpt.remove_earlier(opts.checkpoint_dir, path), True
                if removed:
                    progress.info(f"--overwrite: removed the earlier {', '.join(removed)}")
    if run.train.export_hf:
        if not all_finite(model.parameters(), layout, device):
            raise TrainingStopped("train.export_hf: the parameters are not finite; not exported")
        from longmoe.model.hf import export_hf
        out = export_hf(model, run.model, run.train.export_hf,
                        dtype=torch.bfloat16 if device.type != "cpu" else torch.float32)
        progress.info(f"exported Hugging Face checkpoint: {out}")
    return progress.summary({"world": world, "backend": backend.name, **data_counts})


def step_metrics(run: RunConfig, layout, data: StepData, step: int, loss, aux, stats, gnorm,
                 dt: float, global_tokens: int, lr: float, backend: Backend, device,
                 peak_flops, skipped, bad_in_a_row) -> dict:
    """One row of the step log and --metrics-out. Rates and FLOPs count useful tokens only (the
    samples' own, not padding): tokens_per_s is useful tokens per second of the slowest rank,
    and the FLOPs are those of the samples as trained (attention per sample, longmoe.model.flops
    with their lengths), so padding never counts as work done."""
    cp, world = layout.cp, layout.world
    fl = step_flops(run.model, 0, 0, run.parallel.recompute, lengths=data.lengths)
    keys = ["entropy", "logprob_sum", "clip_frac"]
    # Quantities of a data rank sit on each of its cp ranks: summed over ranks, / cp.
    vals = _sum([float(loss), float(aux), data.row_tokens / cp, sum(data.lengths) / cp,
                 data.masked / cp, data.truncated / cp, fl.model / cp, fl.hardware / cp,
                 data.cost / cp] + [float(stats.get(k, 0.0)) for k in keys], device)
    peak, slowest, max_cost = _sum([backend.peak_memory_bytes(), dt, data.cost], device,
                                   dist.ReduceOp.MAX)
    rows, useful = round(vals[2]), round(vals[3])
    g = max(global_tokens, 1)
    model_tflops = vals[6] / slowest / world / 1e12
    mean_cost = vals[8] / layout.data_world
    over = data.overlong
    return {
        "step": step + 1, "loss": vals[0], "aux_loss": vals[1], "grad_norm": gnorm,
        "tokens_per_s": useful / slowest, "peak_mem_bytes": int(peak),
        "step_time_s": slowest, "lr": lr, "entropy": vals[9] / g,
        "mean_logprob": vals[10] / g, "clip_frac": vals[11] / g,
        "trained_tokens": int(global_tokens), "tokens": rows, "useful_tokens": useful,
        "padding_share": (rows - useful) / rows if rows else 0.0,
        "micro_batches": len(data.micro),
        "empty_micro_batches": data.plan.empty_micro_batches if data.plan else 0,
        "rank_cost_imbalance": max_cost / mean_cost if mean_cost else 1.0,
        "model_tflops_per_gpu": model_tflops,
        "hw_tflops_per_gpu": vals[7] / slowest / world / 1e12,
        "mfu": model_tflops * 1e12 / peak_flops if peak_flops else None,
        "masked_samples": round(vals[4]),
        "truncated_samples": round(vals[5]) + over.truncated,
        "dropped_samples": over.dropped, "truncated_tokens": over.truncated_tokens,
        "skipped": skipped, "bad_steps": bad_in_a_row}


def _kept(opts: RunOptions) -> str:
    """Which checkpoint a stopped run leaves as `latest`."""
    if not opts.checkpoint_dir:
        return "no checkpoint directory was given"
    try:
        path = ckpt.latest(opts.checkpoint_dir)
    except UserError as e:
        return str(e)
    return f"the latest checkpoint is {path}" if path else "no checkpoint was saved"


def rank_main(local_rank: int, world: int, run: RunConfig, opts: RunOptions, rendezvous: str):
    """Entry of a spawned rank (single node: rank == local_rank). `rendezvous` is a file path
    unique to this launch: a file store cannot collide with another job the way a probed
    free TCP port can when several launches start at once. A multi-rank caller must leave the
    process with os._exit (longmoe.train.supervise does): interpreter finalisation can abort while
    gloo's worker threads still hold tensors, after all work has finished and been written."""
    backend = resolve_backend(run.train.device)
    check_on_rank(run, backend, local_rank)
    init_distributed(backend, local_rank, world, local_rank, f"file://{rendezvous}")
    try:
        train(run, opts, backend, backend.device(local_rank))
    except TrainingStopped:  # every rank stops at the same step: leave as after a full run
        leave_together()
        dist.destroy_process_group()
        raise
    except BaseException:
        # Alone, tidy up; with peers, do not wait for them: they may be inside a collective
        # this rank will never join. The process exits next, which closes its connections.
        if world == 1:
            dist.destroy_process_group()
        raise
    leave_together()
    dist.destroy_process_group()


def leave_together():
    """Return only when every rank has finished its last collective. A device barrier alone is
    not enough: a rank can leave it and close its sockets while a peer is still reading the
    barrier's last message, and the peer's transport thread then aborts. The store barrier
    after it (outside the collective transport) guarantees no rank is inside a collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    dist.barrier()
    from torch.distributed.distributed_c10d import _get_default_store
    store, world = _get_default_store(), dist.get_world_size()
    store.add("longmoe/leave", 1)
    store.wait(["longmoe/leave"])
    while int(store.get("longmoe/leave")) < world:
        time.sleep(0.01)
