"""The RL policy loss on the LM head (GRPO / PPO clipped surrogate, optional entropy bonus) with
fused gradients: each token's derivative with respect to its log-prob (and entropy) is known once
the forward has seen the chunk, so dH and dW are computed in the forward pass, chunk by chunk
(linear_ce_chunks.FusedGrad), and the backward only scales them by the incoming gradient. The
logits are computed once: 6*T*H*V FLOPs instead of 8. (CE with mean/sum reduction takes the same
path, in linear_ce.py.)

Legend: T tokens, H hidden, V vocab, C tokens in a chunk.
"""

from __future__ import annotations

import torch

from longmoe.ops.linear_ce import LINEAR_CE, linear_logprobs
from longmoe.ops.linear_ce_chunks import (FusedGrad, check_inputs, check_label_range,
                                          default_chunk_tokens)
from longmoe.ops.linear_ce_engines import ENGINES
from longmoe.ops.registry import Registry

POLICY_LOSS = Registry("policy_loss")


def clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_low: float, clip_high: float):
    """(ratio, s1, s2) of the GRPO/PPO objective -min(s1, s2): r = exp(logp - logp_old) with
    NaN rollout log-probs meaning on-policy (logp_old = logp, r = 1) and r = 1 off the mask,
    s1 = r * A, s2 = clip(r, 1 - clip_low, 1 + clip_high) * A. The one definition the fused
    kernel weights, the reference and the trainer's unfused loss and logging share."""
    old = torch.where(torch.isnan(old_logprobs), logprobs.detach(), old_logprobs.to(logprobs.dtype))
    ratio = torch.exp(torch.where(mask, logprobs - old, 0.0))
    return ratio, ratio * advantages, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages


def _rl_weights(adv_T, old_T, valid_T, clip_low, clip_high, entropy_coef, n):
    def weights(sl, lp_C, ent_C, lse_C):
        adv = adv_T[sl].to(lp_C.dtype)
        ratio, s1, s2 = clipped_surrogate(lp_C, old_T[sl], adv, valid_T[sl], clip_low, clip_high)
        # d(-min(s1, s2))/d logp: -A*r where the unclipped branch is the minimum, else 0.
        w_lp = torch.where(s1 <= s2, -adv * ratio, 0.0) / n
        loss_C = -torch.minimum(s1, s2) / n
        w_ent = None
        if ent_C is not None and entropy_coef:
            loss_C = loss_C - entropy_coef * ent_C / n
            w_ent = torch.full_like(lp_C, -entropy_coef / n)
        return loss_C, w_lp, w_ent, None
    return weights


def _policy_check(h, w, labels, *a):
    return LINEAR_CE.why_not("triton", h, w, labels)


@POLICY_LOSS.register("fused", priority=10, check=_policy_check)
def _fused_policy(h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n, ignore_index, chunk):
    return _run_fused(ENGINES["triton"], h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n,
                      ignore_index, chunk)


@POLICY_LOSS.register("fused_torch", priority=5)
def _fused_torch_policy(h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n, ignore_index, chunk):
    return _run_fused(ENGINES["torch"], h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n,
                      ignore_index, chunk)


def _run_fused(engine, h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n, ignore_index, chunk):
    chunk = chunk or default_chunk_tokens(h_TH.shape[0], w_VH.shape[0])
    weights = _rl_weights(adv_T, old_T, labels_T != ignore_index, cl, ch, coef, n)
    loss, lp, ent = FusedGrad.apply(h_TH, w_VH, labels_T, ignore_index, chunk, True, engine,
                                     weights)
    return loss, lp, ent


@POLICY_LOSS.register("reference", priority=0, reference=True)
def _reference_policy(h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n, ignore_index, chunk):
    lp, ent = linear_logprobs(h_TH, w_VH, labels_T, ignore_index=ignore_index, with_entropy=True,
                              impl="reference")
    mask = labels_T != ignore_index
    _, s1, s2 = clipped_surrogate(lp, old_T, adv_T, mask, cl, ch)
    loss = -(torch.minimum(s1, s2) * mask).sum() / n - coef * (ent * mask).sum() / n
    return loss, lp.detach(), ent.detach()


def linear_policy_loss(hidden, weight, labels, advantages, old_logprobs, *, clip_low: float = 0.2,
                       clip_high: float = 0.28, entropy_coef: float = 0.0, loss_mask=None,
                       normalizer: float | None = None, ignore_index: int = -100,
                       impl: str = "auto", chunk_tokens: int | None = None):
    """GRPO/PPO clipped surrogate on logits = hidden @ weight.T, token-mean over `normalizer`
    (default: the number of trained tokens). Returns (loss, logprobs, entropy); the last two are
    detached, for logging. `old_logprobs` NaN marks on-policy tokens (ratio 1)."""
    check_inputs(hidden, weight, labels)
    for name, t in (("advantages", advantages), ("old_logprobs", old_logprobs)):
        if t.shape != labels.shape:
            raise ValueError(f"{name}{tuple(t.shape)} must match labels{tuple(labels.shape)}")
    h_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1).long()
    if loss_mask is not None:
        labels_T = torch.where(loss_mask.reshape(-1).bool(), labels_T, ignore_index)
    check_label_range(labels_T, weight.shape[0], ignore_index)
    n = normalizer if normalizer is not None else (labels_T != ignore_index).sum().clamp(min=1).item()
    chosen = POLICY_LOSS.select(impl, h_TH, weight, labels_T)
    loss, lp, ent = chosen.fn(h_TH, weight, labels_T, advantages.reshape(-1),
                              old_logprobs.reshape(-1), clip_low, clip_high, entropy_coef,
                              float(n), ignore_index, chunk_tokens)
    return loss, lp.reshape(labels.shape), ent.reshape(labels.shape)
