"""The chunked gated delta rule on Triton kernels (gated_delta_fwd.py, gated_delta_bwd.py): the
launches and the autograd seam. Inputs are what the core sees after the q/k l2norm and q's
dk^-1/2 scale (longmoe/ops/gated_delta.py does those, adjacent).

Legend as in gated_delta_fwd.py: B, T, Hk, Hv, DK, DV, C, n.

Saved for backward: q, k, v, beta, the initial state and the starts, and what the forward
made on the way: gamma, Tinv, w, the chunk start states h and v_new (u is not needed). At 64K
tokens, 32 value heads of 128 x 128, C = 64 in bf16 that is 2.5 GiB per layer beyond the
inputs (h 1 GiB, Tinv fp32, w and v_new 512 MiB each). Recomputing them instead repeats the
forward's prep and state passes inside every backward; under full recompute (how the model
trains at these lengths) the layer's forward runs right before its backward and nothing is
saved in the first pass, so keeping them costs no more than recomputing them there. Transient
in the backward: the end-state gradients (1 GiB), P^T do, dv_new and dv (512 MiB each), the WY
part of dk per value head (fp32, 1 GiB), once per layer.
"""

from __future__ import annotations

import torch
import triton

from longmoe.ops.kernels import runtime_loop_bounds
from longmoe.ops.kernels.gated_delta_bwd import (gdn_bwd_qk_kernel, gdn_bwd_wy_kernel,
                                                  gdn_states_bwd_kernel)
from longmoe.ops.kernels.gated_delta_fwd import (gdn_output_kernel, gdn_prep_kernel,
                                                  gdn_states_kernel)

TABLE_KEY = "gated_delta_chunk"


def kernel_config() -> tuple[dict, str]:
    """The backend's tiles and the fp32 dot precision: torch's "highest" fp32 matmul precision
    keeps IEEE fp32, otherwise the table's fast fp32 dot (TF32 where the GPU has it)."""
    from longmoe.backends import active_backend
    cfg = active_backend().kernel_config(TABLE_KEY)
    precision = ("ieee" if torch.get_float32_matmul_precision() == "highest"
                 else cfg.get("fp32_fast", "ieee"))
    return cfg, precision


def _launch(kernel, grid, cfg, warps_key, *args, **consts):
    from longmoe.backends import active_backend
    kernel[grid](*args, **consts, **active_backend().launch_options(cfg, warps_key))


class _Shapes:
    def __init__(self, q, v, cfg):
        self.B, self.T, self.Hk, self.DK = q.shape
        self.Hv, self.DV = v.shape[2], v.shape[3]
        self.C = cfg["CHUNK"]
        self.n = triton.cdiv(self.T, self.C)
        self.BV = min(cfg["BV"], self.DV)           # state passes: columns per program
        self.BVO = min(cfg["BV_OUT"], self.DV)      # chunk-parallel kernels: column blocks
        self.BVB = min(cfg["BV_BWD"], self.DV)      # ...of the WY-gradient kernel
        self.BVQ = min(cfg["BV_QK"], self.DV)       # ...of the q/k-gradient kernel
        self.BKB = min(cfg["BK_BWD"], self.DK)      # key-column block of the q/k-gradient one
        self.BKP = min(cfg["BK_PREP"], self.DK)     # ...of the prep kernel's w
        self.dims = dict(DK=self.DK, DV=self.DV, C=self.C)


def _forward_pieces(q, k, v, g, beta, h0, starts, cfg, prec, s: _Shapes):
    """gamma, Tinv, w, u, the chunk start states h, v_new and the final state."""
    B, T, Hv, n = s.B, s.T, s.Hv, s.n
    has_starts = starts is not None
    st = starts if has_starts else g
    gam = torch.empty(B, T, Hv, device=q.device, dtype=torch.float32)
    tinv = torch.empty(B, T, Hv, s.C, device=q.device, dtype=torch.float32)
    w = torch.empty(B, T, Hv, s.DK, device=q.device, dtype=q.dtype)
    u = torch.empty(B, T, Hv, s.DV, device=q.device, dtype=q.dtype)
    _launch(gdn_prep_kernel, (n, B * Hv), cfg, "num_warps_prep", k, v, g, beta, st, gam, tinv, w, u,
            T, s.Hk, Hv, BV=s.BVO, BK=s.BKP, HAS_STARTS=has_starts, PRECISION=prec, **s.dims)
    h = torch.empty(B, n, Hv, s.DK, s.DV, device=q.device, dtype=q.dtype)
    vn = torch.empty_like(u)
    ht = torch.empty(B, Hv, s.DK, s.DV, device=q.device, dtype=torch.float32)
    _launch(gdn_states_kernel, (s.DV // s.BV, B * Hv), cfg, "num_warps_scan", k, w, u, gam, st,
            h0 if h0 is not None else ht, h, vn, ht, T, n, s.Hk, Hv, BV=s.BV,
            HAS_STARTS=has_starts, HAS_H0=h0 is not None, PRECISION=prec,
            COUNTED=runtime_loop_bounds(), **s.dims)
    return gam, tinv, w, h, vn, ht


def _intra(q, k, gam, starts, h, x, s: _Shapes, cfg, prec, adjoint: bool, o_dtype=None):
    # the output in o_dtype (rounded once from the fp32 sum); P^T do in the inputs' dtype: its
    # one reader adds it to the end state's part of dv_new in fp32 and rounds the sum to that
    # dtype for its products anyway
    out = torch.empty(s.B, s.T, s.Hv, s.DV, device=q.device,
                      dtype=q.dtype if adjoint else o_dtype)
    _launch(gdn_output_kernel, (s.DV // s.BVO, s.n, s.B * s.Hk), cfg, "num_warps", q, k, gam,
            starts if starts is not None else gam, h, x, out, s.T, s.n, s.Hk, G=s.Hv // s.Hk,
            BV=s.BVO, HAS_STARTS=starts is not None, ADJOINT=adjoint, PRECISION=prec, **s.dims)
    return out


class ChunkedGatedDelta(torch.autograd.Function):
    """(o in o_dtype, final state fp32) from normalised, scaled q, k [B, T, Hk, DK],
    v [B, T, Hv, DV] (q, k, v of one dtype), g fp32 and beta [B, T, Hv], h0 fp32
    [B, Hv, DK, DV] or None, starts uint8 [B, T] or None."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, starts, o_dtype):
        cfg, prec = kernel_config()
        s = _Shapes(q, v, cfg)
        gam, tinv, w, h, vn, ht = _forward_pieces(q, k, v, g, beta, h0, starts, cfg, prec, s)
        o = _intra(q, k, gam, starts, h, vn, s, cfg, prec, adjoint=False, o_dtype=o_dtype)
        ctx.save_for_backward(q, k, v, beta, h0, starts, gam, tinv, w, h, vn)
        ctx.cfg = cfg, prec
        ctx.g_dtype = g.dtype
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, beta, h0, starts, gam, tinv, w, h, vn = ctx.saved_tensors
        cfg, prec = ctx.cfg
        s = _Shapes(q, v, cfg)
        B, T, Hv, n = s.B, s.T, s.Hv, s.n
        do, dht = _dense(do), _dense(dht)
        dvi = _intra(q, k, gam, starts, h, do, s, cfg, prec, adjoint=True)   # P^T do
        st = starts if starts is not None else gam
        dh = torch.empty_like(h)
        # dv_new in the inputs' dtype: every product that reads it takes it in that dtype
        dvn = torch.empty(B, T, Hv, s.DV, device=q.device, dtype=q.dtype)
        dh0 = torch.empty(B, Hv, s.DK, s.DV, device=q.device, dtype=torch.float32)
        _launch(gdn_states_bwd_kernel, (s.DV // s.BV, B * Hv), cfg, "num_warps_scan_bwd", q, k, w,
                gam, st, do, dvi, dht if dht is not None else dh0, dh, dvn, dh0, T,
                n, s.Hk, Hv, BV=s.BV, HAS_STARTS=starts is not None, HAS_DHT=dht is not None,
                PRECISION=prec, COUNTED=runtime_loop_bounds(), **s.dims)
        del dvi
        f32 = dict(device=q.device, dtype=torch.float32)
        dv = torch.empty(B, T, Hv, s.DV, device=q.device, dtype=v.dtype)
        dkw = torch.empty(B, T, Hv, s.DK, **f32)
        dbeta, dgw = torch.empty(B, T, Hv, **f32), torch.empty(B, T, Hv, **f32)
        _launch(gdn_bwd_wy_kernel, (n, B * Hv), cfg, "num_warps_bwd", k, v, beta, gam, st, tinv,
                h, dvn, dv, dkw, dbeta, dgw, T, n, s.Hk, Hv, BV=s.BVB,
                HAS_STARTS=starts is not None, PRECISION=prec, **s.dims)
        del tinv, dvn
        # dq and dk summed over each key head's value heads inside the kernel, in q's dtype
        dq, dk = torch.empty_like(q), torch.empty_like(k)
        nk = s.DK // s.BKB
        dg = torch.empty(nk, B, T, Hv, **f32)   # each key-column block's share
        _launch(gdn_bwd_qk_kernel, (nk, n, B * s.Hk), cfg, "num_warps_qk", q, k, gam, st, h,
                dh, do, vn, dkw, dgw, dq, dk, dg, T, n, s.Hk, G=Hv // s.Hk, BV=s.BVQ, BK=s.BKB,
                HAS_STARTS=starts is not None, PRECISION=prec, **s.dims)
        return (dq, dk, dv, dg.sum(0).to(ctx.g_dtype), dbeta.to(beta.dtype),
                dh0 if h0 is not None else None, None, None)


def _dense(x):
    """x contiguous at a 16-byte aligned address: the kernels are compiled for aligned pointers
    (vector loads; unaligned, the per-element addresses spill the backward's registers), and
    a contiguous view into a larger tensor may start anywhere."""
    if x is None:
        return None
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def chunked_gated_delta(q, k, v, g, beta, h0=None, starts=None, out_dtype=torch.float32):
    """Forward (and, through autograd, backward) of the chunked core; see ChunkedGatedDelta.
    o in out_dtype: its gradient then comes in that dtype too, and the kernels read it so."""
    st = None if starts is None else starts.to(torch.uint8)
    h0 = None if h0 is None else h0.float()
    return ChunkedGatedDelta.apply(*map(_dense, (q, k, v, g.float(), beta, h0, st)), out_dtype)
