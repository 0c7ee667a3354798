"""One policy-update step's forward and backward, shared by the trainer and the paired harness."""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def forward_backward(model, batch: Batch, run: RunConfig, layout: Layout, global_tokens: int):
    """Loss of this rank's share (its token sum over the global count) plus the MoE aux loss;
    after it returns, every gradient holds the global-batch gradient (sharded or replicated)."""
    if run.loss.type == "grpo" and run.impl.policy_loss != "unfused":
        fused = dict(advantages=batch.advantages, old_logprobs=batch.old_logprobs,
                     clip_low=run.loss.clip_low, clip_high=run.loss.clip_high,
                     entropy_coef=run.loss.entropy_coef, normalizer=float(max(global_tokens, 1)),
                     impl=run.impl.policy_loss)
        logprobs, entropy, aux, loss = model(batch.input_ids, batch.labels, policy=fused)
        stats = policy_stats(run.loss, logprobs, entropy, batch)
    else:
        logprobs, entropy, aux, _ = model(batch.input_ids, batch.labels, with_entropy=True)
        loss, stats = policy_loss(run.loss, logprobs, entropy, batch.labels, batch.advantages,
                                  batch.old_logprobs, global_tokens)
    ((loss + aux) * loss_scale(layout)).backward()
    finish_grads(model, layout, run.parallel.fsdp)
    return loss.detach(), aux.detach(), stats
