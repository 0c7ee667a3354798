"""Policy-update losses on per-token log-probs. Every loss is a *sum over this rank's tokens
divided by the global token count*, so summing gradients across ranks (see
train/setup.finish_grads) gives exactly the gradient of the global-batch token mean.
"""

from __future__ import annotations

import torch

from longmoe.ops.linear_ce_fused import clipped_surrogate
from longmoe.train.config import LossConfig


def policy_loss(cfg: LossConfig, logprobs, entropy, labels, advantages, old_logprobs,
                global_tokens: int):
    """Returns (loss, stats). GRPO/PPO clipped surrogate:
    -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), r = exp(logp - logp_old);
    tokens whose rollout log-prob is NaN (not supplied) are on-policy: logp_old = logp.detach()."""
    mask = labels != -100
    n = max(int(global_tokens), 1)
    stats = {}
    if cfg.type == "sft":
        loss = -(logprobs * mask).sum() / n
    else:
        ratio, s1, s2 = clipped_surrogate(logprobs, old_logprobs, advantages, mask,
                                          cfg.clip_low, cfg.clip_high)
        loss = -(torch.minimum(s1, s2) * mask).sum() / n
        with torch.no_grad():
            stats["clip_frac"] = ((s2 < s1) & mask).sum()
            stats["ratio_sum"] = (ratio * mask).sum()
    if entropy is not None:
        ent = (entropy * mask).sum() / n
        stats["entropy"] = ent.detach() * n
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent
    stats["logprob_sum"] = (logprobs.detach() * mask).sum()
    return loss, stats


@torch.no_grad()
def policy_stats(cfg: LossConfig, logprobs, entropy, batch) -> dict:
    """The logging sums policy_loss reports, from (detached) fused-path log-probs."""
    mask = batch.labels != -100
    ratio, s1, s2 = clipped_surrogate(logprobs, batch.old_logprobs, batch.advantages, mask,
                                      cfg.clip_low, cfg.clip_high)
    return {"clip_frac": ((s2 < s1) & mask).sum(), "ratio_sum": (ratio * mask).sum(),
            "entropy": (entropy * mask).sum(), "logprob_sum": (logprobs * mask).sum()}
