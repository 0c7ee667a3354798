"""Row engines for chunked linear cross-entropy: given one chunk's logits z_CV (fp32, or fp64 for
fp64 references), compute the row statistics and the logit gradient for per-token weights.

  TorchRows   plain PyTorch; runs everywhere (the CPU path and the fallback).
  TritonRows  the Triton kernels of ops/kernels/ce_rows.py, tiles from the backend's table.

Also the two GEMMs whose output precision matters: logits in fp32 from low-precision inputs, and
the weight gradient accumulated in fp32 across chunks (cuBLAS/hipBLASLt `out_dtype` where torch
has it, an upcast copy otherwise).

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


class TorchRows:
    name = "torch"

    @staticmethod
    def stats(z_CV, labels_C, ignore_index: int, with_entropy: bool):
        lse_C = torch.logsumexp(z_CV, dim=-1)
        valid = labels_C != ignore_index
        tgt_C = torch.where(valid, z_CV.gather(1, torch.where(valid, labels_C, 0)[:, None])[:, 0], 0.0)
        ent_C = None
        if with_entropy:
            p = torch.exp(z_CV - lse_C[:, None])
            ent_C = lse_C - (p * z_CV).sum(-1)
        return lse_C, tgt_C, ent_C

    @staticmethod
    def grad(z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int, w_lse_C=None):
        valid = labels_C != ignore_index
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
    ready = staticmethod(triton_ready)

    @staticmethod
    def _cfg(device: torch.device) -> dict:
        return active_backend().kernel_config("linear_ce_rows")

    @classmethod
    def stats(cls, z_CV, labels_C, ignore_index: int, with_entropy: bool):
        from longmoe.ops.kernels.ce_rows import launch_stats
        C = z_CV.shape[0]
        lse_C = torch.empty(C, dtype=torch.float32, device=z_CV.device)
        tgt_C = torch.empty_like(lse_C)
        ent_C = torch.empty_like(lse_C) if with_entropy else None
        launch_stats(z_CV, labels_C, lse_C, tgt_C, ent_C, ignore_index, cls._cfg(z_CV.device))
        return lse_C, tgt_C, ent_C

    @classmethod
    def grad(cls, z_CV, dz_CV, labels_C, lse_C, ez_C, w_lp_C, w_ent_C, ignore_index: int,
             w_lse_C=None):
        from longmoe.ops.kernels.ce_rows import launch_grad
        launch_grad(z_CV, dz_CV, labels_C, lse_C.float().contiguous(),
                    None if ez_C is None else ez_C.float().contiguous(),
                    w_lp_C.float().contiguous(),
                    None if w_ent_C is None else w_ent_C.float().contiguous(),
                    ignore_index, cls._cfg(z_CV.device),
                    None if w_lse_C is None else w_lse_C.float().contiguous())
        return dz_CV


ENGINES = {"torch": TorchRows, "triton": TritonRows}
