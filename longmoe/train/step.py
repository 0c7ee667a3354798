"""One policy-update step's forward and backward, shared by the trainer and the paired harness:
one micro-batch (forward_backward), and a step of several accumulated into one gradient
(accumulate)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from longmoe.parallel.context_parallel import local_packing, split_sequence, zigzag_positions
from longmoe.parallel.mesh import Layout
from longmoe.train.config import RunConfig
from longmoe.train.data import Batch
from longmoe.train.loss import policy_loss, policy_stats
from longmoe.train.setup import finish_grads, loss_scale, set_cp_row_length

# Per-token fields of a packed micro-batch, sliced alike for context parallelism.
_PACKED_TOKENS = ("input_ids", "labels", "advantages", "old_logprobs", "ref_logprobs",
                  "rollout_logprobs", "sample_ids", "positions")


def global_token_count(batch: Batch, layout: Layout) -> int:
    n = (batch.labels != -100).sum().to(torch.float64)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return int(n)


def step_token_count(local_whole_rows: int, layout: Layout, device) -> int:
    """N, the step's trained tokens over all ranks and micro-batches, from each rank's count
    over its whole rows (each sample sits on all cp ranks of its group)."""
    n = torch.tensor(float(local_whole_rows), dtype=torch.float64, device=device)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return round(float(n) / layout.cp)


def local_batch(batch: Batch, layout: Layout):
    """(this rank's tokens, their global positions or None): with CP, the zigzag slice of every
    sequence of the batch that the rank's CP group shares."""
    if layout.cp == 1:
        return batch, None
    pos = zigzag_positions(batch.input_ids.shape[1], layout.cp, layout.cp_rank,
                           batch.input_ids.device)
    return Batch(*(split_sequence(t, pos) for t in (batch.input_ids, batch.labels,
                                                    batch.advantages, batch.old_logprobs)),
                 batch.masked, batch.truncated), pos  # counts of whole samples, as on every CP rank


def local_micro_batch(batch, packed: bool, layout: Layout, device):
    """(this rank's tokens, positions, PackedRows or None) of one micro-batch of whole rows on
    the host: a longmoe.train.data.Batch, or a longmoe.data.packing.PackedBatch whose rows hold
    several samples (`packed`) or one each."""
    batch = batch.to(device)
    if isinstance(batch, Batch):
        return (*local_batch(batch, layout), None)
    packing = None
    if packed:
        from longmoe.model.packing import PackedRows
        packing = local_packing(PackedRows(batch.sample_ids, batch.positions), layout.cp,
                                layout.cp_rank)
    if layout.cp == 1:
        return batch, None, packing
    pos = zigzag_positions(batch.input_ids.shape[1], layout.cp, layout.cp_rank, device)
    local = replace(batch, **{f: split_sequence(getattr(batch, f), pos) for f in _PACKED_TOKENS})
    return local, (None if packed else pos), packing


def forward_backward(model, batch: Batch, run: RunConfig, layout: Layout, global_tokens: int,
                     positions=None, packing=None, finish: bool = True, aux_scale: float = 1.0):
    """Loss of this rank's share (its token sum over the global count) plus the MoE aux loss
    (times `aux_scale`); after it returns with `finish`, every gradient holds the global-batch
    gradient (sharded or replicated). `batch` holds this rank's tokens (see local_batch) at
    `positions` (None: 0..S-1), or packed rows described by `packing` (PackedRows, this rank's
    share). Without `finish` gradients only accumulate (a micro-batch before the step's last)."""
    if run.loss.type == "grpo" and run.impl.policy_loss != "unfused":
        fused = dict(advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                     clip_low=run.loss.clip_low, clip_high=run.loss.clip_high,
                     entropy_coef=run.loss.entropy_coef, normalizer=float(max(global_tokens, 1)),
                     impl=run.impl.policy_loss)
        logprobs, entropy, aux, loss = model(batch.input_ids, batch.labels, positions, policy=fused,
                                             packing=packing)
        stats = policy_stats(run.loss, logprobs, entropy, batch)
    else:
        logprobs, entropy, aux, _ = model(batch.input_ids, batch.labels, positions,
                                          with_entropy=True, packing=packing)
        loss, stats = policy_loss(run.loss, logprobs, entropy, batch.labels, batch.advantages,
                                  batch.old_logprobs, global_tokens)
    ((loss + aux * aux_scale) * loss_scale(layout)).backward()
    if finish:
        finish_grads(model, layout, run.parallel.fsdp)
    return loss.detach(), aux.detach(), stats


def accumulate(model, micro, run: RunConfig, layout: Layout, global_tokens: int, device):
    """One step over this rank's micro-batches (longmoe.train.feed.Micro; every rank runs the
    same number, collectives inside): each one's loss is its token sum over the step's global
    count N, so the accumulated gradient is the one-big-batch gradient. The MoE aux loss is the
    mean over micro-batches of each one's (its balance is measured per micro-batch). FSDP
    reduces once, in the last backward (parallel.grad_sync=step; micro_batch, or a single rank:
    after every backward, into accumulating shards); replicated gradients sync once, after it;
    the routers' load becomes the whole step's. Returns (loss, aux loss, logging sums) of this
    rank."""
    from torch.distributed.fsdp import FSDPModule
    M = len(micro)
    sync = (isinstance(model, FSDPModule) and M > 1 and layout.world > 1
            and run.parallel.grad_sync == "step")
    moes = model.moe_layers()
    load = [torch.zeros_like(m.router.last_load) for m in moes]
    loss_sum = aux_sum = None
    stats: dict = {}
    try:
        for j, mb in enumerate(micro):
            last = j == M - 1
            if sync:
                model.set_requires_gradient_sync(last)
            batch, positions, packing = local_micro_batch(mb.batch, mb.packed, layout, device)
            if layout.cp > 1:
                set_cp_row_length(model, layout, mb.row_len)
            loss, aux, st = forward_backward(model, batch, run, layout, global_tokens, positions,
                                             packing, finish=last, aux_scale=1.0 / M)
            for acc, m in zip(load, moes):
                acc += m.router.last_load
            loss_sum = loss if loss_sum is None else loss_sum + loss
            aux_sum = aux / M if aux_sum is None else aux_sum + aux / M
            for k, v in st.items():
                stats[k] = v if k not in stats else stats[k] + v
    finally:
        if sync:
            model.set_requires_gradient_sync(True)
    for acc, m in zip(load, moes):
        m.router.last_load.copy_(acc)
    return loss_sum, aux_sum, stats
