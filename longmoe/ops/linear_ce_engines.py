"""Row engines for chunked linear cross-entropy: given one chunk's logits z_CV (fp32, or fp64 for
fp64 references), compute the row statistics and the logit gradient for per-token weights.

  TorchRows   plain PyTorch; runs everywhere (the CPU path and the fallback).
  TritonRows  the Triton kernels of ops/kernels/ce_rows.py, tiles from the backend's table.

Each comes in three layouts (`layout`):
  split    fp32 logits, a separate gradient chunk in the input dtype, dW accumulated in fp32.
  inplace  fp32 logits, the gradient (input dtype) written over their bytes, dW accumulated in
           the weight's dtype (the GEMM adds in fp32 and rounds once per chunk).
  lowp     logits in the input dtype, the gradient written over them, dW as for inplace. Rows
           are reduced in fp32; the target logit and each row's largest logit are recomputed
           in fp32 from hidden and weight and used in the statistics and the gradient
           (`exact_fixup`). The other logits keep their rounding (up to |z| * 2^-8): measured
           log-prob errors 5e-4 to 7e-4 with |z| up to 20, 0.02 with |z| up to 34 (0.08 without
           the fix-up); docs/primitives/linear_ce.md.

Also the two GEMMs whose output precision matters: logits in fp32 from low-precision inputs, and
the split layout's weight gradient accumulated in fp32 across chunks (cuBLAS/hipBLASLt
`out_dtype` where torch has it, an upcast copy otherwise).

Legend: C rows of the chunk, V vocab, H hidden.
"""

from __future__ import annotations

import torch

from longmoe.backends import active_backend
from longmoe.ops.kernels import triton_ready


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 accumulation for bf16/fp16/fp32 inputs; fp64 stays fp64 (high-precision references).
    return torch.promote_types(dtype, torch.float32)


def _has_out_dtype(device: torch.device) -> bool:
    return active_backend().fp32_output_gemm(device) is None


def logits_into(h_CH, w_VH, out_CV):
    """out = h @ w.T in out's dtype (fp32 accumulate and fp32 result for bf16/fp16 inputs)."""
    if h_CH.dtype == out_CV.dtype:
        return torch.mm(h_CH, w_VH.T, out=out_CV)
    if _has_out_dtype(h_CH.device):
        return torch.mm(h_CH, w_VH.T, out_dtype=out_CV.dtype, out=out_CV)
    return torch.mm(h_CH.to(out_CV.dtype), w_VH.T.to(out_CV.dtype), out=out_CV)


def accumulate_dw(dw_VH, dz_CV, h_CH):
    """dw (fp32/fp64) += dz.T @ h, accumulating in dw's precision."""
    if dz_CV.dtype == dw_VH.dtype:
        return dw_VH.addmm_(dz_CV.T, h_CH)
    if _has_out_dtype(h_CH.device):
        return torch.addmm(dw_VH, dz_CV.T, h_CH, out_dtype=dw_VH.dtype, out=dw_VH)
    return dw_VH.addmm_(dz_CV.T.to(dw_VH.dtype), h_CH.to(dw_VH.dtype))


def exact_fixup(h_CH, w_VH, z_CV, labels_C, ignore_index: int, lse_C, ent_C, arg_C):
    """(target logit, log-sum-exp, entropy, fix) of low-precision logits z_CV, corrected to first
    order: the target logit and the row's largest logit (column arg_C) are recomputed as fp32 dot
    products of hidden and weight rows, and d lse / d z_m = p_m, d entropy / d z_m =
    -p_m (z_m - E_p[z]) carry the largest logit's rounding error out of the statistics. The
    other logits' rounding errors are weighted by their probabilities, which sum to 1 - p_m, and
    are independent, so they mostly cancel. `fix` = (columns [C, 2], fp32 values [C, 2]): the
    gradient kernels use the exact values at those two columns, so the largest softmax entries
    carry fp32 accuracy into the gradient as well."""
    acc = lse_C.dtype
    valid = labels_C != ignore_index
    cols_C2 = torch.stack([torch.where(valid, labels_C, 0), arg_C], 1)
    exact_C2 = (w_VH[cols_C2].to(acc) * h_CH[:, None, :].to(acc)).sum(-1)  # bf16 products are exact in fp32
    m_low_C = z_CV.gather(1, arg_C[:, None])[:, 0].to(acc)
    delta_C = exact_C2[:, 1] - m_low_C
    p_m_C = torch.exp(m_low_C - lse_C)
    lse_fix = lse_C + p_m_C * delta_C
    ent_fix = None
    if ent_C is not None:
        ent_fix = ent_C - p_m_C * (m_low_C - (lse_C - ent_C)) * delta_C
    return torch.where(valid, exact_C2[:, 0], 0.0), lse_fix, ent_fix, (cols_C2, exact_C2)


class TorchRows:
    name = "torch"
    layout = "split"

    @staticmethod
    def stats(z_CV, labels_C, ignore_index: int, with_entropy: bool, with_argmax: bool = False):
        """(lse, target logit, entropy or None, argmax column or None), fp32."""
        z_CV = z_CV.to(torch.promote_types(z_CV.dtype, torch.float32))
        lse_C = torch.logsumexp(z_CV, dim=-1)
        valid = labels_C != ignore_index
        tgt_C = torch.where(valid, z_CV.gather(1, torch.where(valid, labels_C, 0)[:, None])[:, 0], 0.0)
        ent_C = None
        if with_entropy:
            p = torch.exp(z_CV - lse_C[:, None])
            ent_C = lse_C - (p * z_CV).sum(-1)
        return lse_C, tgt_C, ent_C, (z_CV.argmax(-1) if with_argmax else None)

    @staticmethod
    def grad(z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int, w_lse_C=None,
             fix=None):
        valid = labels_C != ignore_index
        z_CV = z_CV.to(lse_C.dtype)  # a copy when z is low precision: dz may be the same buffer
        if fix is not None:
            z_CV = z_CV.scatter(1, fix[0], fix[1].to(z_CV.dtype))
        p = torch.exp(z_CV - lse_C[:, None])
        w_lp = torch.where(valid, w_lp_C, 0.0)
        g = -p * w_lp[:, None]
        g.scatter_add_(1, torch.where(valid, labels_C, 0)[:, None], w_lp[:, None])
        if w_ent_C is not None:
            g -= torch.where(valid, w_ent_C, 0.0)[:, None] * p * (z_CV - ez_C[:, None])
        if w_lse_C is not None:
            g += torch.where(valid, w_lse_C, 0.0)[:, None] * p
        dz_CV.copy_(g)
        return dz_CV


class TritonRows:
    name = "triton"
    layout = "split"
    table_key = "linear_ce_rows"
    ready = staticmethod(triton_ready)

    @classmethod
    def _cfg(cls, device: torch.device) -> dict:
        return active_backend().kernel_config(cls.table_key)

    @classmethod
    def stats(cls, z_CV, labels_C, ignore_index: int, with_entropy: bool, with_argmax: bool = False):
        from longmoe.ops.kernels.ce_rows import launch_stats
        C = z_CV.shape[0]
        lse_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
        tgt_C = torch.empty_like(lse_C)
        ent_C = torch.empty_like(lse_C) if with_entropy else None
        arg_C = torch.empty(C, dtype=torch.int64, device=z_CV.device) if with_argmax else None
        launch_stats(z_CV, labels_C, lse_C, tgt_C, ent_C, ignore_index, cls._cfg(z_CV.device),
                     arg_C)
        return lse_C, tgt_C, ent_C, arg_C

    @classmethod
    def grad(cls, z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int,
             w_lse_C=None, fix=None):
        from longmoe.ops.kernels.ce_rows import launch_grad, launch_grad_narrow
        if cls.layout == "inplace" and dz_CV.dtype != z_CV.dtype:
            # a narrower gradient over the logits' own bytes (chunk_buffers)
            launch_grad_narrow(z_CV, dz_CV, labels_C, lse_C.float().contiguous(),
                               None if ez_C is None else ez_C.float().contiguous(),
                               w_lp_C.float().contiguous(),
                               None if w_ent_C is None else w_ent_C.float().contiguous(),
                               ignore_index, cls._cfg(z_CV.device),
                               None if w_lse_C is None else w_lse_C.float().contiguous())
            return dz_CV
        launch_grad(z_CV, dz_CV, labels_C, lse_C.float().contiguous(),
                    None if ez_C is None else ez_C.float().contiguous(),
                    w_lp_C.float().contiguous(),
                    None if w_ent_C is None else w_ent_C.float().contiguous(),
                    ignore_index, cls._cfg(z_CV.device),
                    None if w_lse_C is None else w_lse_C.float().contiguous(),
                    None if fix is None else (fix[0].contiguous(), fix[1].float().contiguous()))
        return dz_CV


class TorchRowsInplace(TorchRows):
    name = "torch_inplace"
    layout = "inplace"


class TritonRowsInplace(TritonRows):
    name = "triton_inplace"
    layout = "inplace"
    table_key = "linear_ce_rows_inplace"  # the gradient kernel walks each row in one program


class TorchRowsLowp(TorchRows):
    name = "torch_lowp"
    layout = "lowp"


class TritonRowsLowp(TritonRows):
    # Own tiles: the logits are half the bytes of fp32 ones.
    name = "triton_lowp"
    layout = "lowp"
    table_key = "linear_ce_rows_lowp"


ENGINES = {e.name: e for e in (TorchRows, TritonRows, TorchRowsInplace, TritonRowsInplace,
                               TorchRowsLowp, TritonRowsLowp)}
