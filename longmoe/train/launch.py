"""`longmoe train`: validate everything that can be wrong with the input, then start N local ranks
(gloo on CPU, nccl on CUDA/ROCm) under supervision (longmoe.train.supervise: one line for the
first rank failure, SIGINT/SIGTERM stop every rank, no temporary files left) or, under torchrun,
join the ranks it started.

Exit codes: 0 done; 1 a rank failed; 2 bad input (also when only a rank could see it); 3 the run
stopped itself on non-finite steps or weights; 128 + the signal's number when SIGINT/SIGTERM
stopped the launch.
"""

from __future__ import annotations

import math
import os

from longmoe.checkpoint.directory import claim, holds_checkpoints, remove_stale_tmp
from longmoe.checkpoint.load import resume_point
from longmoe.checkpoint.manifest import run_identity
from longmoe.errors import UserError
from longmoe.parallel.mesh import validate_layout
from longmoe.train.config import RunConfig
from longmoe.train.impl_check import check_named_impls, check_on_rank
from longmoe.train.kernel_manifest import check_kernel_manifest
from longmoe.train.feed import check_data, mode
from longmoe.train.setup import run_local_tokens, torch_dtype
from longmoe.train.supervise import (Interrupted, TrainingStopped, launch_dir, say,
                                     stop_on_signals, supervise)
from longmoe.train.trainer import (RunOptions, init_distributed, leave_together, rank_main,
                                   resolve_backend, train)


def validate(run: RunConfig, nproc: int, local_ranks: int | None = None):
    """Every check that needs no process group; raises UserError naming the field. `nproc` is the
    world size; `local_ranks` the ranks on this node (torchrun's LOCAL_WORLD_SIZE; default: all)."""
    validate_layout(nproc, run.parallel.ep, run.model.num_experts, run.parallel.cp,
                    run.parallel.pp, run.parallel.tp)
    cp = run.parallel.cp
    data_ranks = nproc // cp
    planned = run.data.budget is not None
    if not planned and run.data.batch_size % data_ranks:
        raise UserError(f"data.batch_size: the global batch of {run.data.batch_size} sequences "
                        f"does not split evenly over {data_ranks} data ranks (--nproc {nproc} / "
                        f"parallel.cp {cp})")
    if not planned and cp > 1 and "linear_attention" in run.model.layer_types and \
            run.data.seq_len // (2 * cp) < run.model.linear_conv_kernel - 1:
        raise UserError(f"parallel.cp: pieces of {run.data.seq_len // (2 * cp)} tokens are "
                        f"shorter than the Gated DeltaNet conv history "
                        f"({run.model.linear_conv_kernel - 1})")
    if run.train.init_hf:
        check_hf_init(run)
    if run.train.kernel_manifest:
        check_kernel_manifest(run.train.kernel_manifest)
    if run.train.export_hf:  # the architecture that computes this model, or refused by field
        from longmoe.model.hf_compat import target
        target(run.model)
    if not planned and run.data.seq_len % (2 * cp):
        raise UserError(f"parallel.cp: data.seq_len={run.data.seq_len} does not split into "
                        f"2*cp={2 * cp} equal zigzag pieces")
    per_rank_tokens = run_local_tokens(run, data_ranks, cp)
    if run.parallel.chunks != "auto" and run.parallel.chunks > per_rank_tokens:
        raise UserError(f"parallel.chunks: {run.parallel.chunks} exceeds the "
                        f"{per_rank_tokens} tokens a rank holds per layer")
    local_experts = run.model.num_experts // run.parallel.ep
    if run.parallel.chunk_by == "experts" and run.parallel.chunks != "auto" and \
            run.parallel.chunks > local_experts:
        raise UserError(f"parallel.chunks: {run.parallel.chunks} exceeds the {local_experts} "
                        f"local experts per rank (parallel.chunk_by=experts)")
    if not planned and run.data.seq_len > run.model.max_seq_len:
        raise UserError(f"data.seq_len: {run.data.seq_len} exceeds model.max_seq_len="
                        f"{run.model.max_seq_len}")
    source = check_data(run)   # a file: every row read and checked once
    if mode(run) != "rows":     # rows: seq_len, checked above, is the longest
        longest = source.longest()[1]
        if planned:
            longest = min(longest, run.data.budget)
        if longest > run.model.max_seq_len:
            raise UserError(f"data: samples of up to {longest} tokens exceed model.max_seq_len="
                            f"{run.model.max_seq_len} (RoPE positions restart per sample)")
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
        if local_ranks is not None and local_ranks > count:
            raise UserError(f"LOCAL_WORLD_SIZE: {local_ranks} ranks on this node but only {count} "
                            f"{backend.name} device(s)")
        if local_ranks is None and nproc > count:
            raise UserError(f"--nproc: {nproc} ranks but only {count} {backend.name} device(s)")
    else:  # GPU ranks check on their own device (here it would open a device context)
        check_named_impls(run.impl, backend.device(0), torch_dtype(run.parallel.param_dtype))
    return backend


def check_hf_init(run: RunConfig):
    """The Hugging Face directory exists, its shards are all there and its config describes the
    model being trained (the per-tensor shape checks run again on each rank before copying)."""
    from pathlib import Path

    from longmoe.config import from_hf_config
    from longmoe.model.hf import _import_shift, _Store
    path = Path(run.train.init_hf)
    _import_shift(_Store(path), run.model)  # its model_type is the architecture of run.model
    theirs = from_hf_config(path / "config.json")
    # Sizes, and every value that changes the function the weights compute: loading weights
    # trained under another rope_theta or eps would train a different model without a word.
    fields = ["vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "num_experts", "top_k", "moe_ffn_size", "shared_expert_ffn_size", "layer_types",
              "rope_theta", "partial_rotary_factor", "rms_norm_eps", "norm_topk_prob",
              "attn_output_gate"]
    if "linear_attention" in run.model.layer_types:
        fields += ["linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                   "linear_value_head_dim", "linear_conv_kernel"]
    for f in fields:
        a, b = getattr(run.model, f), getattr(theirs, f)
        if isinstance(a, float) and math.isclose(a, b, rel_tol=1e-12):
            continue
        if a != b and not (f == "layer_types" and not a and all(t == "full_attention" for t in b)):
            raise UserError(f"train.init_hf: {path / 'config.json'} has {f}={b!r}, the run's "
                            f"model has {a!r}")


def claim_checkpoint_dir(run: RunConfig, opts: RunOptions, world: int):
    """Before any rank starts: the checkpoint directory is a writable directory and ours (its
    lock, returned, is held for as long as the caller keeps the object: the whole run), a fresh
    run does not start over beside checkpoints it would replace, and a resume's checkpoint is
    whole and fits. Then the leftovers of saves that died are removed: we are the only writer."""
    if not opts.checkpoint_dir:
        return None
    lock = claim(opts.checkpoint_dir)
    try:
        held = holds_checkpoints(lock.root)
        if held and not (opts.resume or opts.overwrite):
            raise UserError(f"--checkpoint-dir: {lock.root} already holds checkpoints (latest: "
                            f"{held}); pass --resume to continue from them, or --overwrite to "
                            f"train from step 0 and replace them")
        check_resume(run, opts, world)
        if not lock.shared:   # this process's own earlier claim may be mid-save
            remove_stale_tmp(lock.root)
    except BaseException:
        lock.release()
        raise
    return lock


def check_resume(run: RunConfig, opts: RunOptions, world: int):
    """A damaged, crafted, incomplete or incompatible checkpoint is bad input too: name the file
    before any rank starts (every digest, every pickled piece parsed without running code; the
    ranks repeat the cheap checks). Validated layouts keep ep == run.parallel.ep."""
    if not (opts.resume and opts.checkpoint_dir):
        return
    identity = run_identity(run, world, run.parallel.ep, run.parallel.cp)
    resume_point(opts.checkpoint_dir, run, identity, opts.allow_batch_change, full=True)


def launch(run: RunConfig, nproc: int, opts: RunOptions) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        world = int(os.environ["WORLD_SIZE"])
        backend = validate(run, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if int(os.environ["RANK"]) == 0:  # the only writer of the metrics file and checkpoints
            owner = claim_checkpoint_dir(run, opts, world)  # noqa: F841 - held until we return
        local = int(os.environ.get("LOCAL_RANK", 0))
        check_on_rank(run, backend, local)
        init_distributed(backend, int(os.environ["RANK"]), world, local)
        import torch.distributed as dist
        try:
            code = 0
            try:
                train(run, opts, backend, backend.device(local))
            except TrainingStopped as e:  # every rank stops at the same step
                if int(os.environ["RANK"]) == 0:
                    say(str(e))
                code = e.exit_code
            leave_together()
        finally:
            dist.destroy_process_group()
        return code
    validate(run, nproc)
    owner = claim_checkpoint_dir(run, opts, nproc)  # noqa: F841 - held until we return
    try:
        with launch_dir() as workdir, stop_on_signals():
            if nproc > 1:
                return supervise(rank_main, nproc, (run, opts), workdir)
            try:
                rank_main(0, 1, run, opts, os.path.join(workdir, "rendezvous"))
            except TrainingStopped as e:
                say(str(e))
                return e.exit_code
            return 0
    except Interrupted as e:
        say(f"stopped by {e}: every rank ended")
        return 128 + e.signum
