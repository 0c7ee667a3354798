"""Linear cross-entropy: loss, per-token log-probs and entropy of `hidden @ weight.T` without ever
holding the [tokens x vocab] logits.

Legend: T tokens, H hidden, V vocab, C tokens in one chunk.

Implementations (registry "linear_ce"):
  reference  plain PyTorch, materialises the fp32 [T, V] logits.
  chunked  an autograd.Function over token chunks with plain-PyTorch row math: the forward keeps
           only per-token statistics, the backward recomputes each chunk's logits. Peak extra
           memory is one fp32 [C, V] chunk plus its gradient. Runs everywhere.
  triton   the same chunking with the row statistics and the logit gradient in Triton kernels
           (ops/kernels/ce_rows.py); GPUs, or CPU under TRITON_INTERPRET=1.
  triton_inplace   (the default on GPUs) the Triton kernels on fp32 logits with the gradient
           written over their bytes and dW accumulated in the weight's dtype: one fp32 [C, V]
           chunk is all it holds beyond the gradients.
  triton_lowp  the same with logits in the input dtype (half the bytes again; log-probs and the
           largest gradient entries are corrected in fp32, the rest carries bf16 logit error).
  chunked_inplace, chunked_lowp  the same layouts with plain-PyTorch rows (never picked by
           "auto"). linear_ce_engines.py has the layouts and what each costs in precision.
  liger    liger-kernel's fused linear CE (loss only; never picked by "auto"), an adapter so the
           peer runs behind the same API.
CE with mean/sum reduction knows each token's gradient weight in the forward, so it runs the
fused-gradient chunk loop and never recomputes the logits (6*T*H*V FLOPs instead of 8); the RL
policy loss does the same in linear_ce_fused.py. The chunk loops are in linear_ce_chunks.py.
"""

from __future__ import annotations

import torch

from longmoe.ops.linear_ce_chunks import (ChunkedLogprobs, FusedGrad, check_inputs,
                                          check_label_range, engine_chunk_tokens, flat_checked)
from longmoe.ops.linear_ce_engines import ENGINES, TritonRows, acc_dtype
from longmoe.ops.registry import ImplUnavailable, Registry

LINEAR_CE = Registry("linear_ce", renamed={"naive": "reference"})


def _engine_impl(engine_name: str):
    def fn(h_TH, w_VH, labels_T, ignore_index, with_entropy, chunk_tokens=None):
        engine = ENGINES[engine_name]
        chunk = chunk_tokens or engine_chunk_tokens(engine, h_TH.shape[0], w_VH.shape[0], h_TH.dtype)
        lp, ent = ChunkedLogprobs.apply(h_TH, w_VH, labels_T, ignore_index, chunk,
                                         with_entropy, engine)
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


# impl name -> row engine of the chunk loops
IMPL_ENGINES = {"chunked": "torch", "triton": "triton", "chunked_inplace": "torch_inplace",
                "triton_inplace": "triton_inplace", "chunked_lowp": "torch_lowp",
                "triton_lowp": "triton_lowp"}
LINEAR_CE.register("chunked", priority=10)(_engine_impl("torch"))
LINEAR_CE.register("chunked_inplace", priority=5)(_engine_impl("torch_inplace"))
LINEAR_CE.register("chunked_lowp", priority=4)(_engine_impl("torch_lowp"))
LINEAR_CE.register("triton", priority=20, check=lambda h, w, y: TritonRows.ready(h.device))(
    _engine_impl("triton"))
LINEAR_CE.register("triton_inplace", priority=30,
                   check=lambda h, w, y: TritonRows.ready(h.device))(_engine_impl("triton_inplace"))
LINEAR_CE.register("triton_lowp", priority=15,
                   check=lambda h, w, y: TritonRows.ready(h.device))(_engine_impl("triton_lowp"))


@LINEAR_CE.register("reference", priority=0, reference=True)
def _reference(h_TH, w_VH, labels_T, ignore_index, with_entropy, chunk_tokens=None):
    logp_TV = torch.log_softmax((h_TH @ w_VH.T).to(acc_dtype(h_TH.dtype)), dim=-1)
    valid_T = labels_T != ignore_index
    lp_T = logp_TV.gather(1, torch.where(valid_T, labels_T, 0)[:, None]).squeeze(1)
    lp_T = torch.where(valid_T, lp_T, 0.0)
    ent_T = None
    if with_entropy:
        ent_T = torch.where(valid_T, -(logp_TV.exp() * logp_TV).sum(-1), 0.0)
    return lp_T, ent_T


def _reference_cross_entropy_z(h_TH, w_VH, labels_T, ignore_index, reduction, z_loss):
    """The reference for CE + z-loss: full logits."""
    z_TV = (h_TH @ w_VH.T).to(acc_dtype(h_TH.dtype))
    lse_T = torch.logsumexp(z_TV, -1)
    valid_T = labels_T != ignore_index
    tgt_T = z_TV.gather(1, torch.where(valid_T, labels_T, 0)[:, None])[:, 0]
    per_T = torch.where(valid_T, lse_T - tgt_T + z_loss * lse_T * lse_T, 0.0)
    n = valid_T.sum().clamp(min=1) if reduction == "mean" else 1
    return per_T.sum() / n


def _engine_for(impl: str, h_TH, w_VH, labels_T):
    chosen = LINEAR_CE.select(impl, h_TH, w_VH, labels_T).name
    if chosen == "reference":
        return None, chosen
    return ENGINES[IMPL_ENGINES[chosen]], chosen


def fused_cross_entropy(h_TH, w_VH, labels_T, ignore_index, reduction, impl, chunk_tokens,
                        z_loss: float = 0.0):
    """CE (+ z_loss * lse^2) with the gradient in the forward; returns None when `impl` resolves
    to the reference."""
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

    chunk = chunk_tokens or engine_chunk_tokens(engine, h_TH.shape[0], w_VH.shape[0], h_TH.dtype)
    loss, _, _ = FusedGrad.apply(h_TH, w_VH, labels_T, ignore_index, chunk, False, engine, weights)
    return loss


def linear_logprobs(hidden, weight, labels, *, ignore_index: int = -100, with_entropy: bool = False,
                    impl: str = "auto", chunk_tokens: int | None = None):
    """Per-token log p(label) (fp32, shape of labels) and optionally the entropy of the full
    softmax, of logits = hidden @ weight.T. Ignored tokens get 0 for both."""
    check_inputs(hidden, weight, labels)
    h_TH = hidden.reshape(-1, hidden.shape[-1])
    labels_T = labels.reshape(-1).long()
    check_label_range(labels_T, weight.shape[0], ignore_index)
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
        h_TH, labels_T = flat_checked(hidden, weight, labels, ignore_index)
        LINEAR_CE.select("liger", h_TH, weight, labels_T)  # raises with the reason if unusable
        out = _liger_cross_entropy(h_TH, weight, labels_T, ignore_index, reduction)
        return out.view(labels.shape) if reduction == "none" else out
    if reduction != "none":  # the per-token gradient weight is known: gradients in the forward
        h_TH, labels_T = flat_checked(hidden, weight, labels, ignore_index)
        loss = fused_cross_entropy(h_TH, weight, labels_T, ignore_index, reduction, impl,
                                   chunk_tokens, z_loss)
        if loss is not None:  # None: the impl resolved to the reference
            return loss
        if z_loss:
            return _reference_cross_entropy_z(h_TH, weight, labels_T, ignore_index, reduction, z_loss)
    lp, _ = linear_logprobs(hidden, weight, labels, ignore_index=ignore_index, impl=impl,
                            chunk_tokens=chunk_tokens)
    nll = -lp
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    n = (labels != ignore_index).sum().clamp(min=1)
    return nll.sum() / n
