"""The unfused policy-update loss: per-token log-probs (and entropy) with autograd from the LM
head, then the objective's per-token loss (longmoe/rl/objective.py) summed with the batch's
aggregation weights. The weights' normalisers are global (every rank, every micro-batch), so
summing gradients across ranks (see train/setup.finish_grads) gives exactly the gradient of the
global-batch loss.
"""

from __future__ import annotations

import torch

from longmoe.rl.objective import TokenInputs
from longmoe.train.config import LossConfig


def policy_loss(cfg: LossConfig, logprobs, entropy, labels, inputs: TokenInputs):
    """(loss, stats): for grpo the objective's loss sum_t w_t loss_t and its statistics; for
    sft -sum_t w_t logp_t (minus the entropy bonus). `inputs` are shaped like `labels`."""
    mask = labels != -100
    objective = cfg.objective()
    inputs.check(labels.shape, objective)
    if cfg.type == "grpo":
        loss = objective.token_loss(logprobs, entropy, inputs, mask).sum()
        return loss, objective.stats(logprobs, entropy, inputs, mask)
    w = torch.where(mask, inputs.weights.to(logprobs.dtype), 0.0)
    loss = -(w * logprobs).sum()
    stats = {"logprob_sum": torch.where(mask, logprobs.detach(), 0.0).sum()}
    if entropy is not None:
        stats["entropy"] = torch.where(mask, entropy.detach(), 0.0).sum()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * (w * entropy).sum()
    elif cfg.entropy_coef:
        raise ValueError(f"loss.entropy_coef={cfg.entropy_coef:g} needs the per-token entropy")
    return loss, stats
