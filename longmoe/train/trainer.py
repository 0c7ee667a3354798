"""The CLI's per-rank policy-update loop on longmoe.api.PolicyTrainer (the same code path an RL
framework calls): for each step fetch this rank's micro-batches (longmoe.train.feed), one
forward_backward (linear-CE log-probs, the RL loss, backward accumulated over micro-batches) and
one optim_step (clip, AdamW, schedule), then log and checkpoint.

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

from longmoe.api.policy import PolicyTrainer
from longmoe.backends import active_backend, get_backend
from longmoe.backends.base import Backend
from longmoe.checkpoint.load import latest, resume_point
from longmoe.checkpoint.manifest import run_identity
from longmoe.checkpoint.save import keep_newest, remove_earlier
from longmoe.checkpoint.save import save as save_checkpoint
from longmoe.errors import UserError
from longmoe.model.flops import dense_peak_flops, step_flops
from longmoe.ops.gated_delta import gated_delta_choice
from longmoe.train.config import RunConfig
from longmoe.train.feed import Feed, StepData
from longmoe.train.progress import Progress
from longmoe.train.impl_check import check_on_rank
from longmoe.train.kernel_manifest import ManifestRun
from longmoe.train.setup import all_finite
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
    """Runs on every rank inside an initialised process group (or alone). Returns rank 0's summary.
    Each step: this rank's share of the data source (longmoe.train.feed), one forward_backward
    and one optim_step of a longmoe.api.PolicyTrainer, the step log, the checkpoint cadence."""
    # train.kernel_manifest's pool starts beside the model build below; each step's kernel
    # compiles go in its log row (with a manifest, rank 0 adds the variants to it)
    manifest = ManifestRun(run.train.kernel_manifest, backend,
                           dist.get_rank() if dist.is_initialized() else 0)
    pt = PolicyTrainer(run, backend=backend, device=device)
    rank, world, layout, model = pt.layout.rank, pt.layout.world, pt.layout, pt.model
    feed = Feed(run, layout.data_rank, layout.data_world)
    progress = Progress(rank == 0, run.train.steps, opts.metrics_out, backend.memory_label)
    data_counts = feed.counts()
    if feed.describe():
        progress.info(feed.describe())
    peak_flops = dense_peak_flops(backend.probe())
    model_meta = asdict(run.model)
    model_meta["layer_types"] = list(model_meta["layer_types"])

    start = 0
    identity = run_identity(run, world, layout.ep, layout.cp)
    replaced = not opts.overwrite  # --overwrite: the first save removes the earlier checkpoints
    if opts.resume and opts.checkpoint_dir:
        point = resume_point(opts.checkpoint_dir, run, identity, opts.allow_batch_change,
                             full=False)  # the launcher checked every digest
        if point is not None:
            pt.load_point(point)
            start = point.step
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
    progress.info(f"AdamW {pt.optim_impl}; fp32 matmuls "
                  f"{'highest (CPU)' if backend.device_type == 'cpu' else run.impl.fp32_matmul}")
    moes = model.moe_layers()
    if moes and layout.ep > 1:
        d = moes[0].dispatcher
        progress.info(f"chunked EP: chunks={d.chunks} ({model.chunks_source}), "
                      f"all-to-all {d.transport.name} ({model.transport_source}), overlap streams "
                      f"{'on' if d.streams.overlaps else 'off (host runs in order)'}")

    try:
        _steps(run, opts, backend, device, pt, feed, progress, peak_flops, identity, start,
               replaced, manifest)
    finally:
        manifest.close()
    if run.train.export_hf:
        if not all_finite(model.parameters(), layout, device):
            raise TrainingStopped("train.export_hf: the parameters are not finite; not exported")
        out = pt.export_hf(run.train.export_hf)
        progress.info(f"exported Hugging Face checkpoint: {out}")
    return progress.summary({"world": world, "backend": backend.name, **data_counts})


def _steps(run: RunConfig, opts: RunOptions, backend: Backend, device, pt: PolicyTrainer, feed,
           progress, peak_flops, identity, start: int, replaced: bool, manifest: ManifestRun):
    """train()'s step loop: data, forward_backward + optim_step, the step log, checkpoints."""
    layout, model, rank, first_bad = pt.layout, pt.model, pt.layout.rank, 0
    for step in range(start, run.train.steps):
        data = feed.step(step)
        backend.synchronize()
        backend.reset_peak_memory()
        prof = (step_profiler(backend) if opts.profile_dir
                and step == min(start + 2, run.train.steps - 1) else None)
        manifest.begin()
        t0 = time.perf_counter()
        with prof or contextlib.nullcontext():
            stats = pt.forward_backward(data)
            info = pt.optim_step(stop_on_bad=False)
            backend.synchronize()
        dt = time.perf_counter() - t0
        lines, compiles, first = manifest.end(step + 1)
        if prof is not None:
            write_profile(prof, opts.profile_dir, rank, backend)
            progress.info(f"profile of step {step + 1} (timed with the profiler on): "
                          f"{opts.profile_dir}")
        bad_in_a_row = info["bad_steps"]
        if info["skipped"] == "nonfinite" and bad_in_a_row == 1:
            first_bad = step + 1
        row = step_metrics(run, layout, data, step, stats, info, dt, pt.lr, backend, device,
                           peak_flops, compiles)
        row.update(first)  # the manifest's pool, collected after the first step
        for line in lines:
            progress.info(line)
        progress.step(row)
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
            path = save_checkpoint(opts.checkpoint_dir, step + 1, model, pt.optim, backend, run,
                                   identity)
            progress.info(f"checkpoint: {path}")
            if not replaced:
                removed, replaced = remove_earlier(opts.checkpoint_dir, path), True
                if removed:
                    progress.info(f"--overwrite: removed the earlier {', '.join(removed)}")
            # After --overwrite's removal: until this run's first publish, nothing goes.
            if run.train.keep_checkpoints:
                removed = keep_newest(opts.checkpoint_dir, run.train.keep_checkpoints, path)
                if removed:
                    progress.info(f"train.keep_checkpoints={run.train.keep_checkpoints}: "
                                  f"removed {', '.join(removed)}")


# The objective's per-token means beyond the ones every row has, logged when the objective
# computes them (longmoe.api.policy.STATS).
OPTIONAL_STATS = ("ratio", "kl", "tis_weight", "tis_clip_frac", "dual_clip_frac")
COMPILE_FIELDS = ("kernel_compiles", "kernel_compile_s", "kernel_cache_loads")


def step_metrics(run: RunConfig, layout, data: StepData, step: int, stats: dict, info: dict,
                 dt: float, lr: float, backend: Backend, device, peak_flops,
                 compiles: dict | None = None) -> dict:
    """One row of the step log and --metrics-out from forward_backward's reduced `stats` and
    optim_step's `info`. Rates and FLOPs count useful tokens only (the samples' own, not
    padding): tokens_per_s is useful tokens per second of the slowest rank, and the FLOPs are
    those of the samples as trained (attention per sample, longmoe.model.flops with their
    lengths), so padding never counts as work done. `compiles` (CompileWatch.take: this
    rank's kernel compiles in the step) gives kernel_compiles, kernel_compile_s and
    kernel_cache_loads, each the largest over ranks; absent where the watch is inactive."""
    cp, world = layout.cp, layout.world
    fl = step_flops(run.model, 0, 0, run.parallel.recompute, lengths=data.lengths,
                    keep_attention=run.parallel.keep_attention)
    # Quantities of a data rank sit on each of its cp ranks: summed over ranks, / cp.
    vals = _sum([data.masked / cp, data.truncated / cp, fl.model / cp, fl.hardware / cp,
                 data.cost / cp], device)
    comp = [compiles[k] for k in COMPILE_FIELDS] if compiles is not None else []
    peak, slowest, max_cost, *comp = _sum([backend.peak_memory_bytes(), dt, data.cost, *comp],
                                          device, dist.ReduceOp.MAX)
    rows, useful = stats["row_tokens"], stats["useful_tokens"]
    model_tflops = vals[2] / slowest / world / 1e12
    mean_cost = vals[4] / layout.data_world
    over = data.overlong
    row = {
        "step": step + 1, "loss": stats["loss"], "aux_loss": stats["aux_loss"],
        "grad_norm": info["grad_norm"],
        "tokens_per_s": useful / slowest, "peak_mem_bytes": int(peak),
        "step_time_s": slowest, "lr": lr, "entropy": stats.get("entropy", 0.0),
        "mean_logprob": stats.get("mean_logprob", 0.0), "clip_frac": stats.get("clip_frac", 0.0),
        "trained_tokens": int(stats["tokens"]), "tokens": rows, "useful_tokens": useful,
        "padding_share": (rows - useful) / rows if rows else 0.0,
        "micro_batches": len(data.micro),
        "empty_micro_batches": data.plan.empty_micro_batches if data.plan else 0,
        "rank_cost_imbalance": max_cost / mean_cost if mean_cost else 1.0,
        "model_tflops_per_gpu": model_tflops,
        "hw_tflops_per_gpu": vals[3] / slowest / world / 1e12,
        "mfu": model_tflops * 1e12 / peak_flops if peak_flops else None,
        "masked_samples": round(vals[0]),
        "truncated_samples": round(vals[1]) + over.truncated,
        "dropped_samples": over.dropped, "truncated_tokens": over.truncated_tokens,
        "skipped": info["skipped"], "bad_steps": info["bad_steps"]}
    row.update({k: stats[k] for k in OPTIONAL_STATS if k in stats})
    if compiles is not None:
        row.update({k: (v if k == "kernel_compile_s" else round(v))
                    for k, v in zip(COMPILE_FIELDS, comp)})
    return row


def _kept(opts: RunOptions) -> str:
    """Which checkpoint a stopped run leaves as `latest`."""
    if not opts.checkpoint_dir:
        return "no checkpoint directory was given"
    try:
        path = latest(opts.checkpoint_dir)
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
