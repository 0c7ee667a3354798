"""Linear cross-entropy: loss, per-token log-probs and entropy of `hidden @ weight.T` without ever
holding the [tokens x vocab] logits.

Legend: T tokens, H hidden, V vocab, C tokens in one chunk.

Implementations (registry "linear_ce"):
  naive    plain PyTorch, materialises the fp32 [T, V] logits; the reference.
  chunked  an autograd.Function over token chunks with plain-PyTorch row math: the forward keeps
           only per-token statistics, the backward recomputes each chunk's logits. Peak extra
           memory is one fp32 [C, V] chunk plus its gradient. Runs everywhere.
  triton   the same chunking with the row statistics and the logit gradient in Triton kernels
           (ops/kernels/ce_rows.py); GPUs, or CPU under TRITON_INTERPRET=1.
  liger    liger-kernel's fused linear CE (loss only; never picked by "auto"), an adapter so the
           peer runs behind the same API.
The fused-gradient paths (CE with mean/sum reduction, the RL policy loss) live in
linear_ce_fused.py: they know each token's gradient weight in the forward, so they never
recompute the logits (6*T*H*V FLOPs instead of 8).
"""

from __future__ import annotations

import torch

from longmoe.ops.linear_ce_engines import ENGINES, TritonRows, accumulate_dw, logits_into
from longmoe.ops.registry import ImplUnavailable, Registry

LINEAR_CE = Registry("linear_ce")

# Budget for one fp32 [C, V] logits chunk (plus a bf16 gradient chunk of half its size and an fp32
# weight-gradient accumulator). Larger chunks mean bigger GEMMs and fewer passes over the fp32
# dW accumulator; measured on H200 at T=32K, V=248,320 (results/h200/linear_ce.json): 2,048
# tokens 1.19x the GEMM floor (+4.7 GiB), 4,096 1.17x (+7.6 GiB), 8,192 1.17x (+13.3 GiB).
# 2 GiB (2,162 tokens at that vocab) is the knee; `impl.ce_chunk_tokens` overrides it.
CHUNK_BYTES = 2 * 2**30


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


def _flat_checked(hidden, weight, labels, ignore_index):
    _check_inputs(hidden, weight, labels)
    h_TH, labels_T = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    _check_label_range(labels_T, weight.shape[0], ignore_index)
    return h_TH, labels_T


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
    """Generic path: the forward keeps only per-token statistics; the backward recomputes each
    chunk's logits (8*T*H*V FLOPs in all), so any downstream loss can follow."""

    @staticmethod
    def forward(ctx, h_TH, w_VH, labels_T, ignore_index, chunk, with_entropy, engine):
        T, V = h_TH.shape[0], w_VH.shape[0]
        acc = _acc_dtype(h_TH.dtype)
        lse_T = torch.empty(T, dtype=acc, device=h_TH.device)
        lp_T = torch.empty_like(lse_T)
        ent_T = torch.empty_like(lse_T) if with_entropy else None
        z_buf = torch.empty(min(chunk, T), V, dtype=acc, device=h_TH.device)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = logits_into(h_TH[s:e], w_VH, z_buf[: e - s])
            lse_C, tgt_C, ent_C = engine.stats(z_CV, labels_T[s:e], ignore_index, with_entropy)
            lse_T[s:e] = lse_C
            lp_T[s:e] = tgt_C - lse_C
            if with_entropy:
                ent_T[s:e] = ent_C
        valid_T = labels_T != ignore_index
        lp_T = torch.where(valid_T, lp_T, 0.0)
        if with_entropy:
            ent_T = torch.where(valid_T, ent_T, 0.0)
        ctx.save_for_backward(h_TH, w_VH, labels_T, lse_T, ent_T if with_entropy else lse_T)
        ctx.set_materialize_grads(False)  # an unused entropy output costs no backward work
        ctx.args = (ignore_index, chunk, with_entropy, engine)
        return lp_T, (ent_T if with_entropy else lse_T.new_zeros(0))

    @staticmethod
    def backward(ctx, g_lp_T, g_ent_T):
        h_TH, w_VH, labels_T, lse_T, ent_T = ctx.saved_tensors
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
        dw_VH = torch.zeros(w_VH.shape, dtype=acc, device=w_VH.device) if need_w else None
        z_buf = torch.empty(min(chunk, T), V, dtype=acc, device=h_TH.device)
        dz_buf = torch.empty(min(chunk, T), V, dtype=h_TH.dtype, device=h_TH.device)
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            z_CV = logits_into(h_TH[s:e], w_VH, z_buf[: e - s])
            dz_CV = engine.grad(z_CV, dz_buf[: e - s], labels_T[s:e], lse_T[s:e],
                                ez_T[s:e] if use_ent else None, g_lp_T[s:e],
                                g_ent_T[s:e] if use_ent else None, ignore_index)
            if need_h:
                torch.mm(dz_CV, w_VH, out=dh_TH[s:e])
            if need_w:
                accumulate_dw(dw_VH, dz_CV, h_TH[s:e])
        return dh_TH, (dw_VH.to(w_VH.dtype) if need_w else None), None, None, None, None, None


def _engine_impl(engine_name: str):
    def fn(h_TH, w_VH, labels_T, ignore_index, with_entropy, chunk_tokens=None):
        chunk = chunk_tokens or default_chunk_tokens(h_TH.shape[0], w_VH.shape[0])
        lp, ent = _ChunkedLogprobs.apply(h_TH, w_VH, labels_T, ignore_index, chunk,
                                         with_entropy, ENGINES[engine_name])
        return lp, (ent if with_entropy else None)
    return fn


def _liger_check(h, w, y):
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed"
    if h.device.type == "cpu":
        return "liger-kernel's Triton kernels need a GPU"
    return None


@LINEAR_CE.register("liger", priority=-10, check=_liger_check)
def _liger_logprobs(*args, **kw):
    # Reached only through linear_logprobs(impl="liger"): liger-kernel fuses the CE loss but
    # does not return per-token log-probs or entropy.
    raise ImplUnavailable("linear_ce: impl 'liger' computes the CE loss only; use it with "
                          "linear_cross_entropy, or pick chunked/triton for log-probs")


def _liger_cross_entropy(h_TH, w_VH, labels_T, ignore_index, reduction):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    return LigerFusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(
        w_VH, h_TH, labels_T)


LINEAR_CE.register("chunked", priority=10)(_engine_impl("torch"))
LINEAR_CE.register("triton", priority=20, check=lambda h, w, y: TritonRows.ready(h.device))(
    _engine_impl("triton"))


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


def _naive_cross_entropy_z(h_TH, w_VH, labels_T, ignore_index, reduction, z_loss):
    """The reference for CE + z-loss: full logits."""
    z_TV = (h_TH @ w_VH.T).to(_acc_dtype(h_TH.dtype))
    lse_T = torch.logsumexp(z_TV, -1)
    valid_T = labels_T != ignore_index
    tgt_T = z_TV.gather(1, torch.where(valid_T, labels_T, 0)[:, None])[:, 0]
    per_T = torch.where(valid_T, lse_T - tgt_T + z_loss * lse_T * lse_T, 0.0)
    n = valid_T.sum().clamp(min=1) if reduction == "mean" else 1
    return per_T.sum() / n


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
                         chunk_tokens: int | None = None, z_loss: float = 0.0):
    """Cross-entropy of hidden @ weight.T against labels; "mean" averages over non-ignored tokens
    (0, still connected to the graph, when every token is ignored). `z_loss` adds
    z_loss * lse^2 per token (same reduction), which keeps the logits' scale in check."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
    if z_loss and (reduction == "none" or impl == "liger"):
        raise ValueError("z_loss needs reduction mean or sum and a longmoe impl")
    if impl == "liger":  # the adapter to liger-kernel's fused linear CE (a benchmark peer)
        h_TH, labels_T = _flat_checked(hidden, weight, labels, ignore_index)
        LINEAR_CE.select("liger", h_TH, weight, labels_T)  # raises with the reason if unusable
        out = _liger_cross_entropy(h_TH, weight, labels_T, ignore_index, reduction)
        return out.view(labels.shape) if reduction == "none" else out
    if reduction != "none":  # the per-token gradient weight is known: gradients in the forward
        from longmoe.ops.linear_ce_fused import fused_cross_entropy
        h_TH, labels_T = _flat_checked(hidden, weight, labels, ignore_index)
        loss = fused_cross_entropy(h_TH, weight, labels_T, ignore_index, reduction, impl,
                                   chunk_tokens, z_loss)
        if loss is not None:  # None: the impl resolved to the naive reference
            return loss
        if z_loss:
            return _naive_cross_entropy_z(h_TH, weight, labels_T, ignore_index, reduction, z_loss)
    lp, _ = linear_logprobs(hidden, weight, labels, ignore_index=ignore_index, impl=impl,
                            chunk_tokens=chunk_tokens)
    nll = -lp
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    n = (labels != ignore_index).sum().clamp(min=1)
    return nll.sum() / n
