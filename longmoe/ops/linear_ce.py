"""Linear cross-entropy: loss, per-token log-probs and entropy of `hidden @ weight.T` without ever
holding the [tokens x vocab] logits.

Legend: T tokens, H hidden, V vocab, C tokens in one chunk.

Implementations (registry "linear_ce"):
  naive    plain PyTorch, materialises the fp32 [T, V] logits; the reference.
  chunked  plain PyTorch autograd.Function over token chunks: the forward keeps only the per-token
           log-sum-exp, the backward recomputes each chunk's logits. Peak extra memory is a few
           [C, V] fp32 tiles. Runs everywhere.
Fused Triton kernels register here too (issue B) behind the same two entry points.
"""

from __future__ import annotations

import torch

from longmoe.ops.registry import Registry

LINEAR_CE = Registry("linear_ce")

# Budget for one fp32 [C, V] tile. The backward holds ~3 such tiles (logits, probs, grad), so the
# extra peak is about 3x this; 128 MiB keeps it well under the 0.5 GiB target at V=248K.
CHUNK_BYTES = 128 * 2**20


def default_chunk_tokens(num_tokens: int, vocab: int, budget: int = CHUNK_BYTES) -> int:
    return max(1, min(num_tokens, budget // (4 * vocab)))


def _acc_dtype(dtype):
    # fp32 accumulation for bf16/fp16/fp32 inputs; fp64 stays fp64 (high-precision references).
    return torch.promote_types(dtype, torch.float32)


def _check_inputs(hidden, weight, labels):
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got weight{tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden{tuple(hidden.shape)} and weight{tuple(weight.shape)}: "
                         "hidden size mismatch")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels{tuple(labels.shape)} must match hidden{tuple(hidden.shape)}[:-1]")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"hidden on {hidden.device}, weight on {weight.device}, labels on "
                         f"{labels.device}: all must share one device")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 or int32, got {labels.dtype}")


def _check_label_range(labels_T, vocab, ignore_index):
    bad = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= vocab))
    if labels_T.device.type == "cpu":
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"labels[{i}]={int(labels_T[i])} is outside [0, {vocab}) "
                             f"and is not ignore_index={ignore_index}")
    else:  # no host sync on accelerators; the device asserts instead
        torch._assert_async(~bad.any(), "labels outside [0, vocab) and not ignore_index")


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, ignore_index, chunk, with_entropy):
        T = h_TH.shape[0]
        valid_T = labels_T != ignore_index
        safe_T = torch.where(valid_T, labels_T, 0)
        acc = _acc_dtype(h_TH.dtype)
        lse_T = torch.empty(T, dtype=acc, device=h_TH.device)
        lp_T = torch.empty_like(lse_T)
        ent_T = torch.empty_like(lse_T) if with_entropy else None
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = (h_TH[s:e] @ w_VH.T).to(acc)
            lse_C = torch.logsumexp(z_CV, dim=-1)
            lse_T[s:e] = lse_C
            lp_T[s:e] = z_CV.gather(1, safe_T[s:e, None]).squeeze(1) - lse_C
            if with_entropy:
                p_CV = torch.exp(z_CV - lse_C[:, None])
                ent_T[s:e] = lse_C - (p_CV * z_CV).sum(-1)
        lp_T = torch.where(valid_T, lp_T, 0.0)
        if with_entropy:
            ent_T = torch.where(valid_T, ent_T, 0.0)
        ctx.save_for_backward(h_TH, w_VH, safe_T, valid_T, lse_T)
        ctx.set_materialize_grads(False)  # an unused entropy output costs no backward work
        ctx.chunk, ctx.with_entropy = chunk, with_entropy
        return lp_T, (ent_T if with_entropy else lse_T.new_zeros(0))

    @staticmethod
    def backward(ctx, g_lp_T, g_ent_T):
        h_TH, w_VH, safe_T, valid_T, lse_T = ctx.saved_tensors
        T, chunk = h_TH.shape[0], ctx.chunk
        acc = lse_T.dtype
        use_ent = ctx.with_entropy and g_ent_T is not None and g_ent_T.numel() > 0
        g_lp_T = torch.where(valid_T, g_lp_T.to(acc), 0.0) if g_lp_T is not None else None
        if use_ent:
            g_ent_T = torch.where(valid_T, g_ent_T.to(acc), 0.0)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh_TH = torch.empty_like(h_TH) if need_h else None
        dw_VH = torch.zeros(w_VH.shape, dtype=acc, device=w_VH.device) if need_w else None
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = (h_TH[s:e] @ w_VH.T).to(acc)
            p_CV = torch.exp(z_CV - lse_T[s:e, None])
            gz_CV = torch.zeros_like(z_CV)
            if g_lp_T is not None:
                # d logp_y / dz = onehot(y) - p
                gz_CV -= p_CV * g_lp_T[s:e, None]
                gz_CV.scatter_add_(1, safe_T[s:e, None], g_lp_T[s:e, None])
            if use_ent:
                # d H / dz_j = -p_j (z_j - E_p[z])
                ez_C = (p_CV * z_CV).sum(-1, keepdim=True)
                gz_CV -= g_ent_T[s:e, None] * p_CV * (z_CV - ez_C)
            gz_CV = gz_CV.to(h_TH.dtype)
            if need_h:
                dh_TH[s:e] = gz_CV @ w_VH
            if need_w:
                dw_VH += (gz_CV.T @ h_TH[s:e]).to(acc)
        return dh_TH, (dw_VH.to(w_VH.dtype) if need_w else None), None, None, None, None


@LINEAR_CE.register("chunked", priority=10)
def _chunked(h_TH, w_VH, labels_T, ignore_index, with_entropy, chunk_tokens=None):
    chunk = chunk_tokens or default_chunk_tokens(h_TH.shape[0], w_VH.shape[0])
    lp, ent = _ChunkedLogprobs.apply(h_TH, w_VH, labels_T, ignore_index, chunk, with_entropy)
    return lp, (ent if with_entropy else None)


@LINEAR_CE.register("naive", priority=0, reference=True)
def _naive(h_TH, w_VH, labels_T, ignore_index, with_entropy, chunk_tokens=None):
    logp_TV = torch.log_softmax((h_TH @ w_VH.T).to(_acc_dtype(h_TH.dtype)), dim=-1)
    valid_T = labels_T != ignore_index
    lp_T = logp_TV.gather(1, torch.where(valid_T, labels_T, 0)[:, None]).squeeze(1)
    lp_T = torch.where(valid_T, lp_T, 0.0)
    ent_T = None
    if with_entropy:
        ent_T = torch.where(valid_T, -(logp_TV.exp() * logp_TV).sum(-1), 0.0)
    return lp_T, ent_T


def linear_logprobs(hidden, weight, labels, *, ignore_index: int = -100, with_entropy: bool = False,
                    impl: str = "auto", chunk_tokens: int | None = None):
    """Per-token log p(label) (fp32, shape of labels) and optionally the entropy of the full
    softmax, of logits = hidden @ weight.T. Ignored tokens get 0 for both."""
    _check_inputs(hidden, weight, labels)
    h_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1).long()
    _check_label_range(labels_T, weight.shape[0], ignore_index)
    chosen = LINEAR_CE.select(impl, h_TH, weight, labels_T)
    lp_T, ent_T = chosen.fn(h_TH, weight, labels_T, ignore_index, with_entropy, chunk_tokens)
    # Copies of T floats, so callers (and FSDP's output hooks) never see a view.
    lp = lp_T.reshape(labels.shape).clone()
    return lp, (ent_T.reshape(labels.shape).clone() if ent_T is not None else None)


def linear_cross_entropy(hidden, weight, labels, *, ignore_index: int = -100,
                         reduction: str = "mean", impl: str = "auto",
                         chunk_tokens: int | None = None):
    """Cross-entropy of hidden @ weight.T against labels; "mean" averages over non-ignored tokens
    (0, still connected to the graph, when every token is ignored)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
    lp, _ = linear_logprobs(hidden, weight, labels, ignore_index=ignore_index, impl=impl,
                            chunk_tokens=chunk_tokens)
    nll = -lp
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    n = (labels != ignore_index).sum().clamp(min=1)
    return nll.sum() / n
