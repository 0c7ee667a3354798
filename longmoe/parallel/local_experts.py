"""The routed experts of a layer whose experts all live on this rank (EP = 1), as one autograd
Function with a hand-written backward.

Legend: T tokens, K top-k, A = T*K assignments (sorted by expert), H hidden, F expert FFN.

Autograd over the plain ops (gather, grouped GEMM, SwiGLU, grouped GEMM, weighted combine) keeps
the gathered rows [A, H], the first GEMM's output [A, 2F], the SwiGLU output [A, F] twice over
(the product's operand and the second GEMM's input) and the expert outputs [A, H] for the
combine's weight gradient. This keeps the rows and the first GEMM's output only: the router
weights' gradient <g, y> comes from <ga, a>, the first dgrad GEMM's output against the SwiGLU
output recomputed in the backward (gy = w g, so <gy W_out^T, a> = <gy, a W_out> = w <g, y>),
as the chunk pipeline does. At 64K tokens, top-8, H = 2048, F = 512 in bf16 that is 3 of 6 GiB
per layer. Every sum runs by gather and reduction, never by scatter-add.
"""

from __future__ import annotations

import torch

from longmoe.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
from longmoe.parallel.expert_parallel import RoutePlan, combine_rows
from longmoe.parallel.moe_pipeline import row_dot, swiglu, swiglu_backward


class LocalExperts:
    """What GroupedExperts.run receives for EP = 1: the route plan and the (token, k) gather."""

    def __init__(self, plan: RoutePlan, tk_A: torch.Tensor, top_k: int):
        self.plan, self.tk_A, self.top_k = plan, tk_A, top_k

    def run(self, x_TH, w_A, w_in, w_out, impl: str = "auto"):
        return _LocalExpertsFn.apply(x_TH, w_A, w_in, w_out, self, impl)


class _LocalExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_A, w_in, w_out, loc: LocalExperts, impl):
        p, K = loc.plan, loc.top_k
        rows, offs = p.expert_rows[0], p.offs[0]
        xg = x_TH.index_select(0, p.order_A // K)
        h = grouped_mm(xg, w_in, rows, offs, impl=impl)
        yg = grouped_mm(swiglu(h), w_out, rows, offs, impl=impl)
        ctx.save_for_backward(xg, h, w_A, w_in, w_out)
        ctx.loc, ctx.impl = loc, impl
        return combine_rows(yg, loc.tk_A, w_A, K)

    @staticmethod
    def backward(ctx, g_TH):
        xg, h, w_A, w_in, w_out = ctx.saved_tensors
        loc, impl = ctx.loc, ctx.impl
        p, K, tk = loc.plan, loc.top_k, loc.tk_A
        rows, offs = p.expert_rows[0], p.offs[0]
        g_TH = g_TH.contiguous()
        gy = g_TH.index_select(0, p.order_A // K) * w_A[:, None].to(g_TH.dtype)
        ga = grouped_mm(gy, w_out.transpose(1, 2), rows, offs, impl=impl)
        gh, a = swiglu_backward(h, ga)
        gxg = grouped_mm(gh, w_in.transpose(1, 2), rows, offs, impl=impl)
        acc = torch.promote_types(g_TH.dtype, torch.float32)
        w = w_A.to(acc)
        gw = row_dot(ga, a)  # = w <g, y>; w = 0 only where softmax underflowed: gradient 0
        g_wA = torch.where(w > 0, gw / torch.where(w > 0, w, 1.0), 0.0).to(w_A.dtype)
        gx_TH = gxg[tk].view(-1, K, gxg.shape[1]).sum(1)
        dw_out = grouped_mm_wgrad(a, gy, rows, w_out, impl, offs)
        dw_in = grouped_mm_wgrad(xg, gh, rows, w_in, impl, offs)
        return gx_TH, g_wA, dw_in, dw_out, None, None
