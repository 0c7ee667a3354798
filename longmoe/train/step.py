"""One policy-update step's forward and backward, shared by the trainer and the paired harness."""

from __future__ import annotations

import torch
import torch.distributed as dist

from longmoe.parallel.context_parallel import split_sequence, zigzag_positions
from longmoe.parallel.mesh import Layout
from longmoe.train.config import RunConfig
from longmoe.train.data import Batch
from longmoe.train.loss import policy_loss, policy_stats
from longmoe.train.setup import finish_grads, loss_scale


def global_token_count(batch: Batch, layout: Layout) -> int:
    n = (batch.labels != -100).sum().to(torch.float64)
    if layout.world > 1:
        dist.all_reduce(n, group=layout.batch_group)
    return int(n)


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


def forward_backward(model, batch: Batch, run: RunConfig, layout: Layout, global_tokens: int,
                     positions=None):
    """Loss of this rank's share (its token sum over the global count) plus the MoE aux loss;
    after it returns, every gradient holds the global-batch gradient (sharded or replicated).
    `batch` holds this rank's tokens (see local_batch) at `positions` (None: 0..S-1)."""
    if run.loss.type == "grpo" and run.impl.policy_loss != "unfused":
        fused = dict(advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                     clip_low=run.loss.clip_low, clip_high=run.loss.clip_high,
                     entropy_coef=run.loss.entropy_coef, normalizer=float(max(global_tokens, 1)),
                     impl=run.impl.policy_loss)
        logprobs, entropy, aux, loss = model(batch.input_ids, batch.labels, positions, policy=fused)
        stats = policy_stats(run.loss, logprobs, entropy, batch)
    else:
        logprobs, entropy, aux, _ = model(batch.input_ids, batch.labels, positions, with_entropy=True)
        loss, stats = policy_loss(run.loss, logprobs, entropy, batch.labels, batch.advantages,
                                  batch.old_logprobs, global_tokens)
    ((loss + aux) * loss_scale(layout)).backward()
    finish_grads(model, layout, run.parallel.fsdp)
    return loss.detach(), aux.detach(), stats
