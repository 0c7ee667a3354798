"""The per-rank policy-update loop: build the layout and model, then for each step fetch this rank's
batch, run forward (linear-CE log-probs) and the RL loss, backward, clip, AdamW, log, checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from longmoe.backends import active_backend, get_backend
from longmoe.backends.base import Backend
from longmoe.model.flops import dense_peak_flops, step_flops
from longmoe.ops.gated_delta import gated_delta_choice
from longmoe.parallel.mesh import build_layout
from longmoe.train import checkpoint as ckpt
from longmoe.train.config import RunConfig
from longmoe.train.data import make_source
from longmoe.train.progress import Progress
from longmoe.train.precision import MasterWeights
from longmoe.train.impl_check import check_on_rank
from longmoe.train.setup import build_model, clip_grad_norm, torch_dtype
from longmoe.train.step import forward_backward, global_token_count, local_batch


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
    source = make_source(run.data, run.model.vocab_size, run.train.seed)
    progress = Progress(rank == 0, run.train.steps, opts.metrics_out, backend.memory_label)
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

    for step in range(start, run.train.steps):
        batch, positions = local_batch(source.batch(step, layout.data_rank, layout.data_world)
                                       .to(device), layout)
        global_tokens = global_token_count(batch, layout)
        backend.synchronize()
        backend.reset_peak_memory()
        prof = (step_profiler(backend) if opts.profile_dir
                and step == min(start + 2, run.train.steps - 1) else None)
        t0 = time.perf_counter()
        with prof or contextlib.nullcontext():
            loss, aux, stats = forward_backward(model, batch, run, layout, global_tokens, positions)
            if master:
                master.grads_to_master()
            gnorm = clip_grad_norm(model, o.grad_clip, layout, master.grad_of if master else None)
            optim.step()
            optim.zero_grad(set_to_none=True)
            if master:
                master.master_to_model()
            sched.step()
            for moe in model.moe_layers():
                moe.router.update_expert_bias()
            backend.synchronize()
        dt = time.perf_counter() - t0
        if prof is not None:
            write_profile(prof, opts.profile_dir, rank, backend)
            progress.info(f"profile of step {step + 1} (timed with the profiler on): "
                          f"{opts.profile_dir}")

        keys = ["entropy", "logprob_sum", "clip_frac"]
        vals = _sum([float(loss), float(aux), batch.num_tokens]
                    + [float(stats.get(k, 0.0)) for k in keys], device)
        peak, = _sum([backend.peak_memory_bytes()], device, dist.ReduceOp.MAX)
        slowest, = _sum([dt], device, dist.ReduceOp.MAX)
        g = max(global_tokens, 1)
        fl = step_flops(run.model, int(vals[2]), run.data.seq_len, run.parallel.recompute)
        model_tflops = fl.model / slowest / world / 1e12
        progress.step({
            "step": step + 1, "loss": vals[0], "aux_loss": vals[1], "grad_norm": gnorm,
            "tokens_per_s": vals[2] / slowest, "peak_mem_bytes": int(peak),
            "step_time_s": slowest, "lr": sched.get_last_lr()[0], "entropy": vals[3] / g,
            "mean_logprob": vals[4] / g, "clip_frac": vals[5] / g,
            "trained_tokens": int(global_tokens), "tokens": int(vals[2]),
            "model_tflops_per_gpu": model_tflops,
            "hw_tflops_per_gpu": fl.hardware / slowest / world / 1e12,
            "mfu": model_tflops * 1e12 / peak_flops if peak_flops else None})

        every = run.train.checkpoint_every
        last = step + 1 == run.train.steps
        if opts.checkpoint_dir and ((every and (step + 1) % every == 0) or last):
            path = ckpt.save(opts.checkpoint_dir, step + 1, model, optim, backend, run, identity)
            progress.info(f"checkpoint: {path}")
            if not replaced:
                removed, replaced = ckpt.remove_earlier(opts.checkpoint_dir, path), True
                if removed:
                    progress.info(f"--overwrite: removed the earlier {', '.join(removed)}")
    if run.train.export_hf:
        from longmoe.model.hf import export_hf
        out = export_hf(model, run.model, run.train.export_hf,
                        dtype=torch.bfloat16 if device.type != "cpu" else torch.float32)
        progress.info(f"exported Hugging Face checkpoint: {out}")
    return progress.summary({"world": world, "backend": backend.name})


def rank_main(local_rank: int, world: int, run: RunConfig, opts: RunOptions, rendezvous: str):
    """Entry of a spawned rank (single node: rank == local_rank). `rendezvous` is a file path
    unique to this launch: a file store cannot collide with another job the way a probed
    free TCP port can when several launches start at once."""
    backend = resolve_backend(run.train.device)
    check_on_rank(run, backend, local_rank)
    init_distributed(backend, local_rank, world, local_rank, f"file://{rendezvous}")
    try:
        train(run, opts, backend, backend.device(local_rank))
        leave_together()
    finally:
        dist.destroy_process_group()
    if world > 1:
        # A spawned rank is its own process: skip interpreter finalisation, where gloo's worker
        # threads, still holding tensors, can abort the process (SIGABRT, "terminate called
        # without an active exception") after all work has finished and been written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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
