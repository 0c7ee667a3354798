"""One policy-update step's forward and backward, shared by the trainer and the paired harness:
one micro-batch (forward_backward), and a step of several accumulated into one gradient
(accumulate). A micro-batch is a longmoe.data.packing.PackedBatch of whole rows, moved to the
device and sliced for context parallelism (longmoe.parallel.context_parallel.cp_share) as it is."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longmoe.data.packing import PackedBatch
from longmoe.model.packing import PackedRows
from longmoe.parallel.context_parallel import cp_share, local_packing
from longmoe.parallel.mesh import Layout
from longmoe.rl.objective import (FusedLoss, Objective, TokenInputs, counts_to_int,
                                  local_counts)
from longmoe.train.config import RunConfig
from longmoe.train.loss import policy_loss
from longmoe.train.setup import finish_grads, loss_scale, set_cp_row_length


def global_token_count(batch: PackedBatch, layout: Layout) -> int:
    n = (batch.labels != -100).sum().to(torch.float64)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return int(n)


def global_counts(batch: PackedBatch, layout: Layout) -> tuple[int, int]:
    """(trained tokens, samples with a trained token) of the global batch: one all-reduce.
    `batch` may hold a context-parallel share of its samples (sample_tokens counts whole ones)."""
    n = local_counts(batch.labels != -100, batch.sample_tokens)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return counts_to_int(n)


def step_counts(tokens: int, samples: int, layout: Layout, device) -> tuple[int, int]:
    """(N tokens, samples) trained by the whole step over all ranks and micro-batches, from each
    rank's counts over its whole rows (each sample sits on all cp ranks of its group): one
    all-reduce."""
    n = torch.tensor([float(tokens), float(samples)], dtype=torch.float64, device=device)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return counts_to_int(n / layout.cp)


def local_micro_batch(batch: PackedBatch, layout: Layout, device):
    """(this rank's share of the micro-batch on `device`, its global positions or None, the
    model's PackedRows of it or None). Packed rows (`batch.packed`) give the model their
    sample boundaries and in-sample positions; rows of one sample each run plainly causal, at
    their zigzag positions under CP."""
    batch = batch.to(device)
    local, positions = cp_share(batch, layout.cp, layout.cp_rank)
    if not batch.packed:
        return local, positions, None
    rows = PackedRows(batch.sample_ids, batch.positions)
    return local, None, local_packing(rows, layout.cp, layout.cp_rank)


def token_inputs(batch: PackedBatch, objective: Objective, global_tokens: int,
                 global_samples: int | None = None) -> TokenInputs:
    """The objective's per-token inputs for `batch`: its aggregation weights from the global
    counts, and only the log-probs the objective reads."""
    weights = objective.token_weights(batch.labels != -100, global_tokens, global_samples,
                                      batch.sample_tokens)
    used = objective.required_logprobs()
    return TokenInputs(batch.advantages, weights, batch.old_logprobs,
                       batch.ref_logprobs if "ref_logprobs" in used else None,
                       batch.rollout_logprobs if "rollout_logprobs" in used else None)


def forward_backward(model, batch: PackedBatch, run: RunConfig, layout: Layout, global_tokens: int,
                     positions=None, global_samples: int | None = None, packing=None,
                     finish: bool = True, aux_scale: float = 1.0):
    """Loss of this rank's share (sum_t w_t loss_t, its weights normalised by the global
    counts) plus the MoE aux loss (times `aux_scale`); after it returns with `finish`, every
    gradient holds the global-batch gradient (sharded or replicated). `batch` holds this rank's
    tokens (see local_micro_batch) at `positions` (None: 0..S-1), or packed rows described by
    `packing` (PackedRows, this rank's share). `global_samples` (the samples of the whole step,
    for the seq-mean aggregation modes) is counted here when None: pass it when the step's batch
    is split into several calls (micro-batches), like global_tokens. Without `finish` gradients
    only accumulate (a micro-batch before the step's last)."""
    objective = run.loss.objective()
    if objective.loss_agg_mode != "token-mean" and global_samples is None:
        _, global_samples = global_counts(batch, layout)
    inputs = token_inputs(batch, objective, global_tokens, global_samples)
    mask = batch.labels != -100
    if run.loss.type == "grpo" and run.impl.policy_loss != "unfused":
        fused = FusedLoss(objective, inputs, run.impl.policy_loss)
        logprobs, entropy, aux, loss = model(batch.input_ids, batch.labels, positions, policy=fused,
                                             packing=packing, temperature_BS=batch.temperature,
                                             routes_BSLK=batch.routed_experts)
        stats = objective.stats(logprobs, entropy, inputs, mask)
    else:
        logprobs, entropy, aux, _ = model(batch.input_ids, batch.labels, positions,
                                          with_entropy=True, packing=packing,
                                          temperature_BS=batch.temperature,
                                          routes_BSLK=batch.routed_experts)
        loss, stats = policy_loss(run.loss, logprobs, entropy, batch.labels, inputs)
    ((loss + aux * aux_scale) * loss_scale(layout)).backward()
    if finish:
        finish_grads(model, layout, run.parallel.fsdp)
    return loss.detach(), aux.detach(), stats


def accumulate(model, micro, run: RunConfig, layout: Layout, global_tokens: int, device,
               global_samples: int | None = None, finish: bool = True):
    """One step over this rank's micro-batches (PackedBatch each; every rank runs the
    same number, collectives inside): each one's loss weights come from the step's global counts
    (N tokens, and samples for the seq-mean modes), so the accumulated gradient is the
    one-big-batch gradient. The MoE aux loss is the mean over micro-batches of each one's (its
    balance is measured per micro-batch). FSDP reduces once, in the last backward
    (parallel.grad_sync=step; micro_batch, or a single rank: after every backward, into
    accumulating shards); replicated gradients sync once, after it; the routers' load becomes
    the whole step's. Without `finish` the replicated sync and the experts' rescale are left
    to the caller's one finish_grads before the optimizer step (several calls accumulating
    into one step). Returns (loss, aux loss, logging sums) of this rank."""
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
            batch, positions, packing = local_micro_batch(mb, layout, device)
            if layout.cp > 1:
                set_cp_row_length(model, layout, mb.row_len)
            loss, aux, st = forward_backward(model, batch, run, layout, global_tokens, positions,
                                             global_samples, packing, finish=last and finish,
                                             aux_scale=1.0 / M)
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
