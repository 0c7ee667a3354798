"""Triton row kernels over one chunk of logits: statistics (log-sum-exp, target logit, entropy) and
the logit gradient for per-token weights. Vendor-neutral; tile sizes come from the backend's
kernel table ("linear_ce_rows"), so warps vs wavefronts are data, not code.

Legend: C rows (tokens of the chunk), V vocab. z_CV is fp32 (the GEMM writes fp32 logits) or, on
the in-place path, the input dtype (bf16/fp16); the math is fp32 in registers either way.

  stats:  one program per row, one pass over V with an online max / sum-exp / sum(p*z):
            lse = m + log(s), entropy = lse - E_p[z], target = z[label], and optionally the
            column of the row's largest logit (the in-place path recomputes it in fp32)
  grad:   programs over (row, vocab block):
            dz = w_lp * (onehot(label) - p) - w_ent * p * (z - E_p[z]) + w_lse * p,
            p = exp(z - lse)  (w_lse: a loss term in the log-sum-exp, e.g. z-loss)
          written in the dtype of the following GEMMs (bf16/fp16/fp32). dz may be z itself (the
          in-place path): each element is read before the same program overwrites it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from longmoe.backends import active_backend


@triton.jit
def ce_row_stats_kernel(z_ptr, stride_z, labels_ptr, lse_ptr, tgt_ptr, ent_ptr, arg_ptr, V,
                        ignore_index, BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                        WITH_ARGMAX: tl.constexpr = False):
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    arg = tl.zeros((), tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        z = tl.load(z_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if WITH_ARGMAX:
            b_max, b_arg = tl.max(z, 0, return_indices=True)
            arg = tl.where(b_max > m, (v0 + b_arg).to(tl.int64), arg)
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
    if WITH_ARGMAX:
        tl.store(arg_ptr + row, arg)


@triton.jit
def ce_row_grad_kernel(z_ptr, stride_z, dz_ptr, stride_dz, labels_ptr, lse_ptr, ez_ptr,
                       w_lp_ptr, w_ent_ptr, w_lse_ptr, fix_col_ptr, fix_val_ptr, V, ignore_index,
                       BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_LSE: tl.constexpr,
                       WITH_FIX: tl.constexpr = False):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    z = tl.load(z_ptr + row.to(tl.int64) * stride_z + offs, mask=mask, other=0.0).to(tl.float32)
    if WITH_FIX:  # exact fp32 values at two columns of the row (low-precision logits)
        for k in tl.static_range(2):
            col = tl.load(fix_col_ptr + row * 2 + k)
            z = tl.where(offs == col, tl.load(fix_val_ptr + row * 2 + k), z)
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


@triton.jit
def ce_row_grad_narrow_kernel(z_ptr, stride_z, dz_ptr, stride_dz, labels_ptr, lse_ptr, ez_ptr,
                              w_lp_ptr, w_ent_ptr, w_lse_ptr, V, ignore_index,
                              BLOCK_V: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                              WITH_LSE: tl.constexpr):
    """The gradient kernel's math with dz narrower than z in the same bytes (fp32 logits, a bf16
    gradient over their first half): one program walks a row in order, and a barrier between
    each tile's loads and its stores keeps every write behind the reads of the bytes it lands
    on (tile b writes the bytes of input elements [b*BLOCK_V/2, (b+1)*BLOCK_V/2), read by tiles
    <= b; later tiles read only bytes past it)."""
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    dz_row = dz_ptr + row.to(tl.int64) * stride_dz
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    w_lp = tl.where(valid, tl.load(w_lp_ptr + row), 0.0)
    if WITH_ENTROPY:
        w_ent = tl.where(valid, tl.load(w_ent_ptr + row), 0.0)
        ez = tl.load(ez_ptr + row)
    if WITH_LSE:
        w_lse = tl.where(valid, tl.load(w_lse_ptr + row), 0.0)
    cols = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + cols
        mask = offs < V
        z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(z - lse)
        dz = tl.where(offs == label, w_lp, 0.0) - w_lp * p
        if WITH_ENTROPY:
            dz -= w_ent * p * (z - ez)
        if WITH_LSE:
            dz += w_lse * p
        tl.debug_barrier()
        tl.store(dz_row + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)


def launch_grad_narrow(z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int,
                       cfg: dict, w_lse_C=None):
    C, V = z_CV.shape
    with_ent, with_lse = w_ent_C is not None, w_lse_C is not None
    ce_row_grad_narrow_kernel[(C,)](
        z_CV, z_CV.stride(0), dz_CV, dz_CV.stride(0), labels_C, lse_C,
        ez_C if with_ent else lse_C, w_lp_C, w_ent_C if with_ent else w_lp_C,
        w_lse_C if with_lse else w_lp_C, V, ignore_index, BLOCK_V=cfg["BLOCK_V_GRAD"],
        WITH_ENTROPY=with_ent, WITH_LSE=with_lse,
        **active_backend().launch_options(cfg, "num_warps_grad"))


def launch_stats(z_CV, labels_C, lse_C, tgt_C, ent_C, ignore_index: int, cfg: dict, arg_C=None):
    C, V = z_CV.shape
    with_ent, with_arg = ent_C is not None, arg_C is not None
    ce_row_stats_kernel[(C,)](
        z_CV, z_CV.stride(0), labels_C, lse_C, tgt_C, ent_C if with_ent else lse_C,
        arg_C if with_arg else labels_C, V, ignore_index, BLOCK_V=cfg["BLOCK_V"],
        WITH_ENTROPY=with_ent, WITH_ARGMAX=with_arg,
        **active_backend().launch_options(cfg, "num_warps"))


def launch_grad(z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int, cfg: dict,
                w_lse_C=None, fix=None):
    """fix: None, or (columns [C, 2] int64, fp32 values [C, 2]) that replace z at those columns."""
    C, V = z_CV.shape
    with_ent, with_lse = w_ent_C is not None, w_lse_C is not None
    block = cfg["BLOCK_V_GRAD"]
    fix_col, fix_val = fix if fix is not None else (labels_C, lse_C)
    ce_row_grad_kernel[(C, triton.cdiv(V, block))](
        z_CV, z_CV.stride(0), dz_CV, dz_CV.stride(0), labels_C, lse_C,
        ez_C if with_ent else lse_C, w_lp_C, w_ent_C if with_ent else w_lp_C,
        w_lse_C if with_lse else w_lp_C, fix_col, fix_val, V, ignore_index, BLOCK_V=block,
        WITH_ENTROPY=with_ent, WITH_LSE=with_lse, WITH_FIX=fix is not None,
        **active_backend().launch_options(cfg, "num_warps_grad"))


