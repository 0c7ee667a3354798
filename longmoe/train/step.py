"""One policy-update step's forward and backward, shared by the trainer and the paired harness."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longmoe.parallel.context_parallel import split_sequence, zigzag_positions
from longmoe.parallel.mesh import Layout
from longmoe.rl.objective import (FusedLoss, Objective, TokenInputs, counts_to_int,
                                  local_counts)
from longmoe.train.config import RunConfig
from longmoe.train.data import Batch
from longmoe.train.loss import policy_loss
from longmoe.train.setup import finish_grads, loss_scale


def global_token_count(batch: Batch, layout: Layout) -> int:
    n = (batch.labels != -100).sum().to(torch.float64)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return int(n)


def global_counts(batch: Batch, layout: Layout) -> tuple[int, int]:
    """(trained tokens, samples with a trained token) of the global batch: one all-reduce.
    `batch` may hold a context-parallel share of its samples (sample_tokens counts whole ones)."""
    n = local_counts(batch.labels != -100, batch.sample_tokens)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return counts_to_int(n)


def local_batch(batch: Batch, layout: Layout):
    """(this rank's tokens, their global positions or None): with CP, the zigzag slice of every
    sequence of the batch that the rank's CP group shares."""
    if layout.cp == 1:
        return batch, None
    pos = zigzag_positions(batch.input_ids.shape[1], layout.cp, layout.cp_rank,
                           batch.input_ids.device)
    # masked/truncated count whole samples, as on every CP rank; sample_tokens too.
    return batch.with_tokens(lambda t: split_sequence(t, pos)), pos


def token_inputs(batch: Batch, objective: Objective, global_tokens: int,
                 global_samples: int | None = None) -> TokenInputs:
    """The objective's per-token inputs for `batch`: its aggregation weights from the global
    counts, and only the log-probs the objective reads."""
    weights = objective.token_weights(batch.labels != -100, global_tokens, global_samples,
                                      batch.sample_tokens)
    used = objective.required_logprobs()
    return TokenInputs(batch.advantages, weights, batch.old_logprobs,
                       batch.ref_logprobs if "ref_logprobs" in used else None,
                       batch.rollout_logprobs if "rollout_logprobs" in used else None)


def forward_backward(model, batch: Batch, run: RunConfig, layout: Layout, global_tokens: int,
                     positions=None, global_samples: int | None = None):
    """Loss of this rank's share (sum_t w_t loss_t, its weights normalised by the global
    counts) plus the MoE aux loss; after it returns, every gradient holds the global-batch
    gradient (sharded or replicated). `batch` holds this rank's tokens (see local_batch) at
    `positions` (None: 0..S-1). `global_samples` (the samples of the whole step, for the
    seq-mean aggregation modes) is counted here when None: pass it when the step's batch is
    split into several calls (micro-batches), like global_tokens."""
    objective = run.loss.objective()
    if objective.loss_agg_mode != "token-mean" and global_samples is None:
        _, global_samples = global_counts(batch, layout)
    inputs = token_inputs(batch, objective, global_tokens, global_samples)
    mask = batch.labels != -100
    if run.loss.type == "grpo" and run.impl.policy_loss != "unfused":
        fused = FusedLoss(objective, inputs, run.impl.policy_loss)
        logprobs, entropy, aux, loss = model(batch.input_ids, batch.labels, positions, policy=fused)
        stats = objective.stats(logprobs, entropy, inputs, mask)
    else:
        logprobs, entropy, aux, _ = model(batch.input_ids, batch.labels, positions, with_entropy=True)
        loss, stats = policy_loss(run.loss, logprobs, entropy, batch.labels, inputs)
    ((loss + aux) * loss_scale(layout)).backward()
    finish_grads(model, layout, run.parallel.fsdp)
    return loss.detach(), aux.detach(), stats
