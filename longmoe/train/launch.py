"""`longmoe train`: validate everything that can be wrong with the input, then start N local ranks
(gloo on CPU, nccl on CUDA/ROCm) or, under torchrun, join the ranks it started."""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict

import torch.multiprocessing as mp

from longmoe.errors import UserError
from longmoe.parallel.mesh import validate_layout
from longmoe.train import checkpoint as ckpt
from longmoe.train.config import RunConfig
from longmoe.train.data import read_jsonl
from longmoe.train.impl_check import check_named_impls, check_on_rank
from longmoe.train.setup import torch_dtype
from longmoe.train.trainer import (RunOptions, init_distributed, leave_together, rank_main,
                                   resolve_backend, train)


def validate(run: RunConfig, nproc: int):
    """Every check that needs no process group; raises UserError naming the field."""
    validate_layout(nproc, run.parallel.ep, run.model.num_experts, run.parallel.cp,
                    run.parallel.pp, run.parallel.tp)
    cp = run.parallel.cp
    if cp > 1 and "linear_attention" in run.model.layer_types and \
            run.data.seq_len // (2 * cp) < run.model.linear_conv_kernel - 1:
        raise UserError(f"parallel.cp: pieces of {run.data.seq_len // (2 * cp)} tokens are "
                        f"shorter than the Gated DeltaNet conv history "
                        f"({run.model.linear_conv_kernel - 1})")
    if run.train.init_hf:
        check_hf_init(run)
    if run.data.seq_len % (2 * cp):
        raise UserError(f"parallel.cp: data.seq_len={run.data.seq_len} does not split into "
                        f"2*cp={2 * cp} equal zigzag pieces")
    per_rank_tokens = run.data.batch_size * run.data.seq_len // cp
    if run.parallel.chunks != "auto" and run.parallel.chunks > per_rank_tokens:
        raise UserError(f"parallel.chunks: {run.parallel.chunks} exceeds the "
                        f"{per_rank_tokens} tokens a rank holds per layer")
    local_experts = run.model.num_experts // run.parallel.ep
    if run.parallel.chunk_by == "experts" and run.parallel.chunks != "auto" and \
            run.parallel.chunks > local_experts:
        raise UserError(f"parallel.chunks: {run.parallel.chunks} exceeds the {local_experts} "
                        f"local experts per rank (parallel.chunk_by=experts)")
    if run.data.seq_len > run.model.max_seq_len:
        raise UserError(f"data.seq_len: {run.data.seq_len} exceeds model.max_seq_len="
                        f"{run.model.max_seq_len}")
    if run.data.source == "jsonl":
        read_jsonl(run.data.path, run.model.vocab_size, run.data.seq_len, run.data.overlong,
                   require=run.loss.required_logprobs())
    try:
        backend = resolve_backend(run.train.device)
    except (ValueError, RuntimeError) as e:
        raise UserError(f"train.device: {e}") from None
    try:
        backend.a2a(run.parallel.a2a_transport, backend.device(0))
    except ValueError as e:
        raise UserError(f"parallel.a2a_transport: {e}") from None
    if backend.device_type != "cpu":
        count = backend.probe().get("device_count") or 0
        if nproc > count:
            raise UserError(f"--nproc: {nproc} ranks but only {count} {backend.name} device(s)")
    else:  # GPU ranks check on their own device (here it would open a device context)
        check_named_impls(run.impl, backend.device(0), torch_dtype(run.parallel.param_dtype))
    return backend


def check_hf_init(run: RunConfig):
    """The Hugging Face directory exists, its shards are all there and its config describes the
    model being trained (the per-tensor shape checks run again on each rank before copying)."""
    from pathlib import Path

    from longmoe.config import from_hf_config
    from longmoe.model.hf import _Store
    path = Path(run.train.init_hf)
    _Store(path)
    theirs = from_hf_config(path / "config.json")
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "num_experts", "top_k", "moe_ffn_size", "shared_expert_ffn_size", "layer_types"):
        a, b = getattr(run.model, f), getattr(theirs, f)
        if a != b and not (f == "layer_types" and not a and all(t == "full_attention" for t in b)):
            raise UserError(f"train.init_hf: {path / 'config.json'} has {f}={b!r}, the run's "
                            f"model has {a!r}")


def check_resume(run: RunConfig, opts: RunOptions):
    """An incomplete or incompatible checkpoint is bad input too: name it before any rank starts
    (the ranks repeat the check; without this a rank dies and the user reads its traceback's tail).
    Validated layouts keep ep == run.parallel.ep, the value the ranks' check compares."""
    if not (opts.resume and opts.checkpoint_dir):
        return
    path = ckpt.latest(opts.checkpoint_dir)
    if path is not None:
        model_meta = asdict(run.model)
        model_meta["layer_types"] = list(model_meta["layer_types"])  # as JSON gives it back
        ckpt.check_compatible(path, model_meta)


def _fresh_metrics(opts: RunOptions):
    """A new run starts its metrics file empty; a resumed one appends to it."""
    if opts.metrics_out and os.path.exists(opts.metrics_out) and not opts.resume:
        os.remove(opts.metrics_out)


def rendezvous_file() -> str:
    """A path that does not exist yet, for a FileStore rendezvous unique to this launch."""
    fd, path = tempfile.mkstemp(prefix="longmoe-rdzv-")
    os.close(fd)
    os.unlink(path)
    return path


def launch(run: RunConfig, nproc: int, opts: RunOptions) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        backend = validate(run, world)
        check_resume(run, opts)
        if int(os.environ["RANK"]) == 0:  # the only writer of the metrics file
            _fresh_metrics(opts)
        local = int(os.environ.get("LOCAL_RANK", 0))
        check_on_rank(run, backend, local)
        init_distributed(backend, int(os.environ["RANK"]), world, local)
        import torch.distributed as dist
        try:
            train(run, opts, backend, backend.device(local))
            leave_together()
        finally:
            dist.destroy_process_group()
        return 0
    validate(run, nproc)
    check_resume(run, opts)
    _fresh_metrics(opts)
    rdzv = rendezvous_file()
    try:
        if nproc == 1:
            rank_main(0, 1, run, opts, rdzv)
        else:
            mp.start_processes(rank_main, args=(nproc, run, opts, rdzv), nprocs=nproc,
                               start_method="spawn", join=True)
    finally:
        if os.path.exists(rdzv):
            os.unlink(rdzv)
    return 0
