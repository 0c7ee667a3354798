"""Fused-gradient linear losses: when a loss is a sum of per-token terms whose derivative with
respect to the token's log-prob (and entropy) is known once the forward has seen the chunk, dH and
dW are computed in the forward pass, chunk by chunk, and the backward only scales them by the
incoming gradient. The logits are computed once: 6*T*H*V FLOPs instead of 8.

  linear_cross_entropy(reduction="mean" | "sum")   d/d logp = -1/N (or -1)
  linear_policy_loss (GRPO / PPO clipped surrogate, optional entropy bonus)

Legend: T tokens, H hidden, V vocab, C tokens in a chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

from longmoe.ops.linear_ce import (LINEAR_CE, _acc_dtype, _check_inputs, _check_label_range,
                                   default_chunk_tokens, linear_logprobs)
from longmoe.ops.linear_ce_engines import ENGINES, accumulate_dw, logits_into
from longmoe.ops.registry import Registry

# weights(sl, lp_C, ent_C, lse_C) -> (loss_C per token, w_lp_C, w_ent_C or None, w_lse_C or None):
# d loss / d logp, d loss / d entropy and d loss / d log-sum-exp for the tokens of slice `sl`.
# Ignored tokens are masked by the kernels.
WeightsFn = Callable[[slice, torch.Tensor, torch.Tensor], tuple]


class _FusedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, ignore_index, chunk, with_entropy, engine, weights):
        T, V = h_TH.shape[0], w_VH.shape[0]
        acc = _acc_dtype(h_TH.dtype)
        lp_T = torch.empty(T, dtype=acc, device=h_TH.device)
        ent_T = torch.empty_like(lp_T) if with_entropy else None
        loss = torch.zeros((), dtype=acc, device=h_TH.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh_TH = torch.empty_like(h_TH) if need_h else None
        dw_VH = torch.zeros(w_VH.shape, dtype=acc, device=w_VH.device) if need_w else None
        z_buf = torch.empty(min(chunk, T), V, dtype=acc, device=h_TH.device)
        dz_buf = torch.empty(min(chunk, T), V, dtype=h_TH.dtype, device=h_TH.device)
        valid_T = labels_T != ignore_index
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            y_C = labels_T[s:e]
            z_CV = logits_into(h_TH[s:e], w_VH, z_buf[: e - s])
            lse_C, tgt_C, ent_C = engine.stats(z_CV, y_C, ignore_index, with_entropy)
            lp_C = torch.where(valid_T[s:e], tgt_C - lse_C, 0.0)
            lp_T[s:e] = lp_C
            if with_entropy:
                ent_C = torch.where(valid_T[s:e], ent_C, 0.0)
                ent_T[s:e] = ent_C
            loss_C, w_lp_C, w_ent_C, w_lse_C = weights(slice(s, e), lp_C, ent_C, lse_C)
            loss += torch.where(valid_T[s:e], loss_C, 0.0).sum()
            if not (need_h or need_w):
                continue
            ez_C = (lse_C - ent_C) if w_ent_C is not None else None
            dz_CV = engine.grad(z_CV, dz_buf[: e - s], y_C, lse_C, ez_C, w_lp_C.to(acc),
                                None if w_ent_C is None else w_ent_C.to(acc), ignore_index,
                                None if w_lse_C is None else w_lse_C.to(acc))
            if need_h:
                torch.mm(dz_CV, w_VH, out=dh_TH[s:e])
            if need_w:
                accumulate_dw(dw_VH, dz_CV, h_TH[s:e])
        ctx.save_for_backward(dh_TH, dw_VH.to(w_VH.dtype) if need_w else None)
        ctx.mark_non_differentiable(lp_T, *(() if ent_T is None else (ent_T,)))
        return loss, lp_T, (ent_T if with_entropy else lp_T.new_zeros(0))

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_ent):
        dh_TH, dw_VH = ctx.saved_tensors
        dh = dh_TH * g_loss.to(dh_TH.dtype) if dh_TH is not None else None
        dw = dw_VH * g_loss.to(dw_VH.dtype) if dw_VH is not None else None
        return dh, dw, None, None, None, None, None, None


def _engine_for(impl: str, h_TH, w_VH, labels_T):
    chosen = LINEAR_CE.select(impl, h_TH, w_VH, labels_T).name
    if chosen == "naive":
        return None, chosen
    return ENGINES["triton" if chosen == "triton" else "torch"], chosen


def fused_cross_entropy(h_TH, w_VH, labels_T, ignore_index, reduction, impl, chunk_tokens,
                        z_loss: float = 0.0):
    """CE (+ z_loss * lse^2) with the gradient in the forward; returns None when `impl` resolves
    to the naive path."""
    engine, _ = _engine_for(impl, h_TH, w_VH, labels_T)
    if engine is None:
        return None
    # One host sync for the token count: the per-token weight must be known in the forward.
    scale = 1.0 / max(int((labels_T != ignore_index).sum()), 1) if reduction == "mean" else 1.0

    def weights(sl, lp_C, ent_C, lse_C):
        w_lp = torch.full_like(lp_C, -scale)  # loss = -scale * sum(logp)
        if not z_loss:
            return lp_C * w_lp, w_lp, None, None
        lse = lse_C.to(lp_C.dtype)  # + z_loss * scale * sum(lse^2): d/d lse = 2 z_loss scale lse
        return lp_C * w_lp + z_loss * scale * lse * lse, w_lp, None, 2 * z_loss * scale * lse

    chunk = chunk_tokens or default_chunk_tokens(h_TH.shape[0], w_VH.shape[0])
    loss, _, _ = _FusedGrad.apply(h_TH, w_VH, labels_T, ignore_index, chunk, False, engine, weights)
    return loss


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
    loss, lp, ent = _FusedGrad.apply(h_TH, w_VH, labels_T, ignore_index, chunk, True, engine,
                                     weights)
    return loss, lp, ent


@POLICY_LOSS.register("reference", priority=0, reference=True)
def _reference_policy(h_TH, w_VH, labels_T, adv_T, old_T, cl, ch, coef, n, ignore_index, chunk):
    lp, ent = linear_logprobs(h_TH, w_VH, labels_T, ignore_index=ignore_index, with_entropy=True,
                              impl="naive")
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
    _check_inputs(hidden, weight, labels)
    for name, t in (("advantages", advantages), ("old_logprobs", old_logprobs)):
        if t.shape != labels.shape:
            raise ValueError(f"{name}{tuple(t.shape)} must match labels{tuple(labels.shape)}")
    h_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1).long()
    if loss_mask is not None:
        labels_T = torch.where(loss_mask.reshape(-1).bool(), labels_T, ignore_index)
    _check_label_range(labels_T, weight.shape[0], ignore_index)
    n = normalizer if normalizer is not None else (labels_T != ignore_index).sum().clamp(min=1).item()
    chosen = POLICY_LOSS.select(impl, h_TH, weight, labels_T)
    loss, lp, ent = chosen.fn(h_TH, weight, labels_T, advantages.reshape(-1),
                              old_logprobs.reshape(-1), clip_low, clip_high, entropy_coef,
                              float(n), ignore_index, chunk_tokens)
    return loss, lp.reshape(labels.shape), ent.reshape(labels.shape)
