"""The chunk loops of linear cross-entropy, as autograd Functions, and the input checks every
linear-CE entry point shares.

  ChunkedLogprobs  the forward keeps per-token statistics; the backward recomputes each chunk's
                   logits (8*T*H*V FLOPs), so any downstream loss can follow.
  FusedGrad        the per-token gradient weights are known once the forward has seen a chunk:
                   dH and dW are computed in the forward, the backward only scales them
                   (6*T*H*V FLOPs). Used by the mean/sum CE loss and the RL policy loss.

Legend: T tokens, H hidden, V vocab, C tokens in one chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

from longmoe.ops.linear_ce_engines import acc_dtype, accumulate_dw, exact_fixup, logits_into

# Budget for one fp32 [C, V] logits chunk (plus a bf16 gradient chunk of half its size and an fp32
# weight-gradient accumulator). Larger chunks mean bigger GEMMs and fewer passes over the fp32
# dW accumulator; measured on H200 at T=32K, V=248,320 (results/h200/linear_ce_chunk_sweep.json):
# 2,048 tokens 1.19x the GEMM floor (+4.7 GiB), 4,096 1.17x (+7.6 GiB), 8,192 1.17x (+13.3 GiB).
# 2 GiB (2,162 tokens at that vocab) is the knee; `impl.ce_chunk_tokens` overrides it.
CHUNK_BYTES = 2 * 2**30


# The in-place layouts hold one [C, V] logits chunk and nothing else of that size (the gradient
# is written over it, dW accumulates in the weight's own gradient), so the whole op stays within
# 1 GiB above its inputs and gradients: 1,024 tokens of fp32 logits (inplace, 0.95 GiB at
# V = 248,320) or 1,920 of bf16 ones (lowp, 0.89 GiB; the fp32 recomputation of two logits per
# row adds ~60 MiB of temporaries beside it).
INPLACE_CHUNK_BYTES = {"inplace": 61 * 2**24, "lowp": 15 * 2**26}


def default_chunk_tokens(num_tokens: int, vocab: int, budget: int = CHUNK_BYTES,
                         elem_bytes: int = 4, multiple: int = 1) -> int:
    c = budget // (elem_bytes * vocab)
    if c >= 2 * multiple:
        c -= c % multiple  # GEMM-friendly token counts
    return max(1, min(num_tokens, c))


def engine_chunk_tokens(engine, num_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    """The default chunk of `engine`'s layout."""
    layout = getattr(engine, "layout", "split")
    if layout == "split":
        return default_chunk_tokens(num_tokens, vocab)
    size = (torch.empty((), dtype=dtype).element_size() if layout == "lowp"
            else torch.empty((), dtype=acc_dtype(dtype)).element_size())
    return default_chunk_tokens(num_tokens, vocab, INPLACE_CHUNK_BYTES[layout], size, 128)


def chunk_buffers(engine, h_TH, V: int, chunk: int):
    """(logits buffer, gradient buffer) for one chunk. In the in-place layouts the gradient is
    the logits' own bytes: the same tensor (lowp, or fp32 inputs), or the first half of each
    fp32 row seen as bf16/fp16 (row stride 2V)."""
    rows, dev = min(chunk, h_TH.shape[0]), h_TH.device
    acc = acc_dtype(h_TH.dtype)
    if engine.layout == "lowp":
        z = torch.empty(rows, V, dtype=h_TH.dtype, device=dev)
        return z, z
    z = torch.empty(rows, V, dtype=acc, device=dev)
    if engine.layout == "split":
        return z, torch.empty(rows, V, dtype=h_TH.dtype, device=dev)
    if h_TH.dtype == acc:
        return z, z
    return z, z.view(h_TH.dtype)[:, :V]


def chunk_stats(engine, h_CH, w_VH, z_CV, y_C, ignore_index: int, with_entropy: bool):
    """(lse, target logit, entropy, fix): fix is None for fp32 logits, else the exact values the
    gradient kernels put in at two columns per row (exact_fixup)."""
    low = z_CV.dtype.itemsize < 4
    lse_C, tgt_C, ent_C, arg_C = engine.stats(z_CV, y_C, ignore_index, with_entropy, low)
    if not low:
        return lse_C, tgt_C, ent_C, None
    tgt_f, lse_f, ent_f, fix = exact_fixup(h_CH, w_VH, z_CV, y_C, ignore_index, lse_C, ent_C,
                                           arg_C)
    return lse_f, tgt_f, ent_f, fix


def dw_buffer(engine, w_VH):
    if engine.layout != "split":  # written by the first chunk's GEMM
        return torch.empty_like(w_VH)
    return torch.zeros(w_VH.shape, dtype=acc_dtype(w_VH.dtype), device=w_VH.device)


def add_dw(engine, dw_VH, dz_CV, h_CH, first: bool):
    if engine.layout != "split":
        if first:
            return torch.mm(dz_CV.T, h_CH, out=dw_VH)
        return dw_VH.addmm_(dz_CV.T, h_CH)  # fp32 sums inside the GEMM, one rounding per chunk
    return accumulate_dw(dw_VH, dz_CV, h_CH)


def check_inputs(hidden, weight, labels):
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


def flat_checked(hidden, weight, labels, ignore_index):
    check_inputs(hidden, weight, labels)
    h_TH, labels_T = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    check_label_range(labels_T, weight.shape[0], ignore_index)
    return h_TH, labels_T


def check_label_range(labels_T, vocab, ignore_index):
    bad = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= vocab))
    if labels_T.device.type == "cpu":
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"labels[{i}]={int(labels_T[i])} is outside [0, {vocab}) "
                             f"and is not ignore_index={ignore_index}")
    else:  # no host sync on accelerators; the device asserts instead
        torch._assert_async(~bad.any(), "labels outside [0, vocab) and not ignore_index")


class ChunkedLogprobs(torch.autograd.Function):
    """Generic path: the forward keeps only per-token statistics; the backward recomputes each
    chunk's logits (8*T*H*V FLOPs in all), so any downstream loss can follow."""

    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, ignore_index, chunk, with_entropy, engine):
        T, V = h_TH.shape[0], w_VH.shape[0]
        acc = acc_dtype(h_TH.dtype)
        lse_T = torch.empty(T, dtype=acc, device=h_TH.device)  # as the gradient kernels use it
        lp_T = torch.empty_like(lse_T)
        ent_T = torch.empty_like(lse_T) if with_entropy else None
        z_buf, _ = chunk_buffers(engine, h_TH, V, chunk)
        fix_cols_T2 = fix_vals_T2 = None
        if z_buf.dtype.itemsize < 4:  # exact values at two columns per row for the backward
            fix_cols_T2 = torch.empty(T, 2, dtype=torch.int64, device=h_TH.device)
            fix_vals_T2 = torch.empty(T, 2, dtype=acc, device=h_TH.device)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = logits_into(h_TH[s:e], w_VH, z_buf[: e - s])
            lse_C, tgt_C, ent_C, fix = chunk_stats(engine, h_TH[s:e], w_VH, z_CV, labels_T[s:e],
                                                   ignore_index, with_entropy)
            lse_T[s:e] = lse_C
            lp_T[s:e] = tgt_C - lse_C
            if with_entropy:
                ent_T[s:e] = ent_C
            if fix is not None:
                fix_cols_T2[s:e], fix_vals_T2[s:e] = fix
        del z_buf
        valid_T = labels_T != ignore_index
        lp_T = torch.where(valid_T, lp_T, 0.0)
        if with_entropy:
            ent_T = torch.where(valid_T, ent_T, 0.0)
        ctx.save_for_backward(h_TH, w_VH, labels_T, lse_T, ent_T if with_entropy else lse_T,
                              fix_cols_T2, fix_vals_T2)
        ctx.set_materialize_grads(False)  # an unused entropy output costs no backward work
        ctx.args = (ignore_index, chunk, with_entropy, engine)
        return lp_T, (ent_T if with_entropy else lse_T.new_zeros(0))

    @staticmethod
    def backward(ctx, g_lp_T, g_ent_T):
        h_TH, w_VH, labels_T, lse_T, ent_T, fix_cols_T2, fix_vals_T2 = ctx.saved_tensors
        ignore_index, chunk, with_entropy, engine = ctx.args
        T, V = h_TH.shape[0], w_VH.shape[0]
        use_ent = with_entropy and g_ent_T is not None
        if g_lp_T is None and not use_ent:
            return (None,) * 7
        acc = lse_T.dtype
        g_lp_T = g_lp_T.to(acc) if g_lp_T is not None else torch.zeros_like(lse_T)
        ez_T = (lse_T - ent_T) if use_ent else None  # E_p[z] = lse - entropy
        g_ent_T = g_ent_T.to(acc) if use_ent else None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh_TH = torch.empty_like(h_TH) if need_h else None
        dw_VH = dw_buffer(engine, w_VH) if need_w else None
        z_buf, dz_buf = chunk_buffers(engine, h_TH, V, chunk)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = logits_into(h_TH[s:e], w_VH, z_buf[: e - s])
            fix = None if fix_cols_T2 is None else (fix_cols_T2[s:e], fix_vals_T2[s:e])
            dz_CV = engine.grad(z_CV, dz_buf[: e - s], labels_T[s:e], lse_T[s:e],
                                ez_T[s:e] if use_ent else None, g_lp_T[s:e],
                                g_ent_T[s:e] if use_ent else None, ignore_index, fix=fix)
            if need_h:
                torch.mm(dz_CV, w_VH, out=dh_TH[s:e])
            if need_w:
                add_dw(engine, dw_VH, dz_CV, h_TH[s:e], s == 0)
        return dh_TH, (dw_VH.to(w_VH.dtype) if need_w else None), None, None, None, None, None


# weights(sl, lp_C, ent_C, lse_C) -> (loss_C per token, w_lp_C, w_ent_C or None, w_lse_C or None):
# d loss / d logp, d loss / d entropy and d loss / d log-sum-exp for the tokens of slice `sl`.
# Ignored tokens are masked by the kernels.
WeightsFn = Callable[[slice, torch.Tensor, torch.Tensor], tuple]


class FusedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, ignore_index, chunk, with_entropy, engine, weights):
        T, V = h_TH.shape[0], w_VH.shape[0]
        acc = acc_dtype(h_TH.dtype)
        lp_T = torch.empty(T, dtype=acc, device=h_TH.device)
        ent_T = torch.empty_like(lp_T) if with_entropy else None
        loss = torch.zeros((), dtype=acc, device=h_TH.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh_TH = torch.empty_like(h_TH) if need_h else None
        dw_VH = dw_buffer(engine, w_VH) if need_w else None
        z_buf, dz_buf = chunk_buffers(engine, h_TH, V, chunk)
        valid_T = labels_T != ignore_index
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            y_C = labels_T[s:e]
            z_CV = logits_into(h_TH[s:e], w_VH, z_buf[: e - s])
            lse_C, tgt_C, ent_C, fix = chunk_stats(engine, h_TH[s:e], w_VH, z_CV, y_C, ignore_index,
                                                   with_entropy)
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
                                None if w_lse_C is None else w_lse_C.to(acc), fix=fix)
            if need_h:
                torch.mm(dz_CV, w_VH, out=dh_TH[s:e])
            if need_w:
                add_dw(engine, dw_VH, dz_CV, h_TH[s:e], s == 0)
        del z_buf, dz_buf
        ctx.save_for_backward(dh_TH, dw_VH.to(w_VH.dtype) if need_w else None)
        ctx.mark_non_differentiable(lp_T, *(() if ent_T is None else (ent_T,)))
        return loss, lp_T, (ent_T if with_entropy else lp_T.new_zeros(0))

    @staticmethod
    def backward(ctx, g_loss, _g_lp, _g_ent):
        # Scaled in place and handed over: a copy of dW would be a second [V, H] tensor at the
        # peak. The gradients exist once, so a second backward through the graph cannot be right.
        if getattr(ctx, "used", False):
            raise RuntimeError("linear CE with gradients in the forward: backward ran twice on "
                               "one graph; run the loss again for another backward")
        ctx.used = True
        dh_TH, dw_VH = ctx.saved_tensors
        # A foreach scale reads the scale from device memory in a vectorised kernel, where
        # mul_ by a 0-dim device tensor takes the broadcasting path (1.4 ms for dW's 1 GB on an
        # H100, ~1.4 TB/s, measured in the 8K profile).
        for t in (dh_TH, dw_VH):
            if t is not None:
                torch._foreach_mul_([t], g_loss.to(t.dtype))
        return dh_TH, dw_VH, None, None, None, None, None, None
