"""Triton row kernels over one chunk of logits: statistics (log-sum-exp, target logit, entropy) and
the logit gradient for per-token weights. Vendor-neutral; tile sizes come from the backend's
kernel table ("linear_ce_rows"), so warps vs wavefronts are data, not code.

Legend: C rows (tokens of the chunk), V vocab. z_CV is fp32 (the GEMM writes fp32 logits).

  stats:  one program per row, one pass over V with an online max / sum-exp / sum(p*z):
            lse = m + log(s), entropy = lse - E_p[z], target = z[label]
  grad:   programs over (row, vocab block):
            dz = w_lp * (onehot(label) - p) - w_ent * p * (z - E_p[z]) + w_lse * p,
            p = exp(z - lse)  (w_lse: a loss term in the log-sum-exp, e.g. z-loss)
          written in the dtype of the following GEMMs (bf16/fp16/fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from longmoe.backends import active_backend


@triton.jit
def ce_row_stats_kernel(z_ptr, stride_z, labels_ptr, lse_ptr, tgt_ptr, ent_ptr, V, ignore_index,
                        BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        z = tl.load(z_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        s = s * alpha + tl.sum(e, 0)
        if WITH_ENTROPY:
            t = t * alpha + tl.sum(e * tl.where(mask, z, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse_ptr + row, lse)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    safe = tl.where(valid, label, 0)
    tgt = tl.load(z_row + safe).to(tl.float32)
    tl.store(tgt_ptr + row, tl.where(valid, tgt, 0.0))
    if WITH_ENTROPY:
        tl.store(ent_ptr + row, lse - t / s)


@triton.jit
def ce_row_grad_kernel(z_ptr, stride_z, dz_ptr, stride_dz, labels_ptr, lse_ptr, ez_ptr,
                       w_lp_ptr, w_ent_ptr, w_lse_ptr, V, ignore_index,
                       BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_LSE: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    z = tl.load(z_ptr + row.to(tl.int64) * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    w_lp = tl.load(w_lp_ptr + row)
    w_lp = tl.where(label != ignore_index, w_lp, 0.0)
    p = tl.exp(z - lse)
    dz = tl.where(offs == label, w_lp, 0.0) - w_lp * p
    if WITH_ENTROPY:
        w_ent = tl.load(w_ent_ptr + row)
        w_ent = tl.where(label != ignore_index, w_ent, 0.0)
        ez = tl.load(ez_ptr + row)
        dz -= w_ent * p * (z - ez)
    if WITH_LSE:  # a term in log-sum-exp (z-loss): d lse / dz = p
        w_lse = tl.load(w_lse_ptr + row)
        dz += tl.where(label != ignore_index, w_lse, 0.0) * p
    tl.store(dz_ptr + row.to(tl.int64) * stride_dz + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def launch_stats(z_CV, labels_C, lse_C, tgt_C, ent_C, ignore_index: int, cfg: dict):
    C, V = z_CV.shape
    with_ent = ent_C is not None
    ce_row_stats_kernel[(C,)](
        z_CV, z_CV.stride(0), labels_C, lse_C, tgt_C, ent_C if with_ent else lse_C, V,
        ignore_index, BLOCK_V=cfg["BLOCK_V"], WITH_ENTROPY=with_ent,
        **active_backend().launch_options(cfg, "num_warps"))


def launch_grad(z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int, cfg: dict,
                w_lse_C=None):
    C, V = z_CV.shape
    with_ent, with_lse = w_ent_C is not None, w_lse_C is not None
    block = cfg["BLOCK_V_GRAD"]
    ce_row_grad_kernel[(C, triton.cdiv(V, block))](
        z_CV, z_CV.stride(0), dz_CV, dz_CV.stride(0), labels_C, lse_C,
        ez_C if with_ent else lse_C, w_lp_C, w_ent_C if with_ent else w_lp_C,
        w_lse_C if with_lse else w_lp_C, V, ignore_index, BLOCK_V=block, WITH_ENTROPY=with_ent,
        WITH_LSE=with_lse, **active_backend().launch_options(cfg, "num_warps_grad"))


