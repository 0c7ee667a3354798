"""Vocab-parallel linear cross-entropy for a tensor-parallel group: each rank holds a slice of the
LM head's rows (vocab [vocab_start, vocab_start + V_r)) and the same hidden states; the softmax
statistics are reduced over the group, so no rank ever holds more than [C, V_r] logits.

Legend: T tokens, C tokens in a chunk, H hidden, V_r this rank's vocab rows.

Per chunk, forward: z = h @ W_r^T (fp32); m = all-reduce-max(max z); then one all-reduce-sum of
[sum exp(z - m), sum exp(z - m) * z, z[label] if the label is local] gives log-sum-exp, E_p[z]
(entropy = lse - E_p[z]) and the target logit. Backward recomputes z, forms the logit gradient of
the local rows, all-reduces dH over the group and keeps dW_r local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from longmoe.ops.linear_ce_chunks import default_chunk_tokens
from longmoe.ops.linear_ce_engines import acc_dtype


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, vocab_start, ignore_index, chunk, group):
        T, V_r = h_TH.shape[0], w_VH.shape[0]
        acc = acc_dtype(h_TH.dtype)
        local_T = (labels_T >= vocab_start) & (labels_T < vocab_start + V_r)
        idx_T = torch.where(local_T, labels_T - vocab_start, 0)
        lse_T = torch.empty(T, dtype=acc, device=h_TH.device)
        tgt_T = torch.empty_like(lse_T)
        ez_T = torch.empty_like(lse_T)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = (h_TH[s:e] @ w_VH.T).to(acc)
            m_C = z_CV.max(-1).values
            dist.all_reduce(m_C, op=dist.ReduceOp.MAX, group=group)
            ex_CV = torch.exp(z_CV - m_C[:, None])
            tgt = torch.where(local_T[s:e], z_CV.gather(1, idx_T[s:e, None])[:, 0], 0.0)
            sums = torch.stack([ex_CV.sum(-1), (ex_CV * z_CV).sum(-1), tgt])
            dist.all_reduce(sums, group=group)
            lse_T[s:e] = m_C + torch.log(sums[0])
            ez_T[s:e] = sums[1] / sums[0]
            tgt_T[s:e] = sums[2]
        valid_T = labels_T != ignore_index
        lp_T = torch.where(valid_T, tgt_T - lse_T, 0.0)
        ent_T = torch.where(valid_T, lse_T - ez_T, 0.0)
        ctx.save_for_backward(h_TH, w_VH, labels_T, lse_T, ez_T)
        ctx.args = (vocab_start, ignore_index, chunk, group)
        ctx.set_materialize_grads(False)
        return lp_T, ent_T

    @staticmethod
    def backward(ctx, g_lp_T, g_ent_T):
        h_TH, w_VH, labels_T, lse_T, ez_T = ctx.saved_tensors
        vocab_start, ignore_index, chunk, group = ctx.args
        T, V_r = h_TH.shape[0], w_VH.shape[0]
        acc = lse_T.dtype
        valid_T = labels_T != ignore_index
        g_lp_T = torch.where(valid_T, g_lp_T.to(acc), 0.0) if g_lp_T is not None else torch.zeros_like(lse_T)
        g_ent_T = torch.where(valid_T, g_ent_T.to(acc), 0.0) if g_ent_T is not None else None
        local_T = valid_T & (labels_T >= vocab_start) & (labels_T < vocab_start + V_r)
        idx_T = torch.where(local_T, labels_T - vocab_start, 0)
        dh_TH = torch.empty(h_TH.shape, dtype=acc, device=h_TH.device)
        dw_VH = torch.zeros(w_VH.shape, dtype=acc, device=w_VH.device)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = (h_TH[s:e] @ w_VH.T).to(acc)
            p_CV = torch.exp(z_CV - lse_T[s:e, None])
            dz_CV = -p_CV * g_lp_T[s:e, None]
            dz_CV.scatter_add_(1, idx_T[s:e, None], torch.where(local_T[s:e], g_lp_T[s:e], 0.0)[:, None])
            if g_ent_T is not None:
                dz_CV -= g_ent_T[s:e, None] * p_CV * (z_CV - ez_T[s:e, None])
            dz_CV = dz_CV.to(h_TH.dtype)
            dh_TH[s:e] = dz_CV @ w_VH
            dw_VH += (dz_CV.T @ h_TH[s:e]).to(acc)
        dist.all_reduce(dh_TH, group=group)  # every rank's vocab rows contribute to dH
        return dh_TH.to(h_TH.dtype), dw_VH.to(w_VH.dtype), None, None, None, None, None


def vocab_parallel_logprobs(hidden, weight_shard, labels, group, vocab_start: int, *,
                            ignore_index: int = -100, chunk_tokens: int | None = None):
    """(logprobs, entropy) over the full vocabulary, computed from this rank's LM-head rows
    [vocab_start, vocab_start + weight_shard.shape[0]); `hidden` and `labels` are the same on
    every rank of `group`. Every rank returns the full per-token results."""
    if hidden.shape[-1] != weight_shard.shape[1] or labels.shape != hidden.shape[:-1]:
        raise ValueError(f"hidden{tuple(hidden.shape)}, weight_shard{tuple(weight_shard.shape)}, "
                         f"labels{tuple(labels.shape)}: shapes do not match")
    h_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1).long()
    chunk = chunk_tokens or default_chunk_tokens(h_TH.shape[0], weight_shard.shape[0])
    lp, ent = _VocabParallelLogprobs.apply(h_TH, weight_shard, labels_T, vocab_start, ignore_index,
                                           chunk, group)
    return lp.view(labels.shape).clone(), ent.view(labels.shape).clone()
