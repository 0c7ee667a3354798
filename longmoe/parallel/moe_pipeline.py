"""The chunked expert-parallel MoE pipeline, forward and backward, as one autograd Function.

Legend: T tokens, A assignments (T*K), H hidden, F expert FFN, M rows one rank's experts receive
in a chunk, C chunks, c a chunk.

Forward, with a communication stream beside the compute stream (HostStreams on CPU: the same
order, run serially):

    compute  | gemm 0 | gemm 1 | acc 0 | gemm 2 | acc 1 | ...
    comm     | d0 d1  |  c0 d2 |        c1 d3  |        ...       d = dispatch, c = combine

Dispatch of chunk c+2 is issued behind the combine of chunk c, so while chunk c+1's expert GEMMs
run, the comm stream carries the combine of c and the dispatch of c+2. The backward mirrors it:
gradient dispatch of chunk c+2 and the dgrad combine of chunk c run under chunk c+1's dgrad GEMMs,
and each chunk's weight gradients are computed right after its dgrad is handed to the comm
stream, i.e. in the gap where its all-to-all is in flight, accumulated across chunks.

Everything the backward keeps goes through save_for_backward, so full recompute (non-reentrant
checkpoint) drops it and rebuilds it by rerunning this same pipelined forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longmoe.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
from longmoe.parallel.expert_parallel import RoutePlan, source_major_to_expert_major


def swiglu(h_MF2: torch.Tensor) -> torch.Tensor:
    gate, up = h_MF2.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward(h_MF2: torch.Tensor, ga_MF: torch.Tensor):
    """(d h, a) for a = silu(gate) * up, given d a; math in fp32, results in h's dtype."""
    gate, up = h_MF2.float().chunk(2, dim=-1)
    sg = torch.sigmoid(gate)
    silu = gate * sg
    ga = ga_MF.float()
    g_gate = ga * up * (sg * (1 + gate * (1 - sg)))
    return torch.cat([g_gate, ga * silu], -1).to(h_MF2.dtype), (silu * up).to(h_MF2.dtype)


class ChunkPipeline:
    """One layer's route plan plus how to move rows (transport) and order work (streams)."""

    def __init__(self, plan: RoutePlan, top_k: int, group, transport, streams,
                 keep_outputs: bool = False):
        self.plan, self.top_k, self.group = plan, top_k, group
        self.transport, self.streams = transport, streams
        self.keep_outputs = keep_outputs

    def run(self, x_TH, w_A, w_in, w_out, impl: str = "auto"):
        """The routed output without the last chunk's combine, which is left in flight: call
        `finish` with the work that should run under it (the shared expert)."""
        self.last = None        # (mark, tokens, combined rows, weights) of the pending chunk
        self.bwd_started = None  # gradient dispatches issued early by _FinishCombine.backward
        self.w_A = w_A.detach()
        return _PipelinedExperts.apply(x_TH, w_A, w_in, w_out, self, impl)

    def finish(self, y_partial, y_fill):
        """y_partial + y_fill + the pending last chunk, once its combine has landed."""
        return _FinishCombine.apply(y_partial, y_fill, self)

    def dispatch_grad(self, g_TH, c: int, metas, recv, marks):
        """Gradient rows of chunk c (scaled by the routing weights) to the experts' ranks."""
        a0, a1 = self.arange(c)
        g_rows = g_TH[metas[c][0]]
        recv[c] = g_TH.new_empty((sum(self.plan.recv[c]), g_TH.shape[1]))
        marks[c] = self.a2a(recv[c], g_rows * self.w_A[a0:a1, None].to(g_rows.dtype), c,
                            reverse=False)

    # --- per-chunk index metadata (device tensors; no host sync) --------------------------
    def arange(self, c: int) -> tuple[int, int]:
        s, e = self.plan.bounds[c]
        return s * self.top_k, e * self.top_k

    def meta(self, c: int):
        """(token of each sent row, received->expert-major gather, its inverse)."""
        a0, a1 = self.arange(c)
        tok = self.plan.order_A[a0:a1] // self.top_k
        total = sum(self.plan.recv[c])
        perm = source_major_to_expert_major(self.plan.recv_SL[c], total)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(total, device=perm.device)
        return tok, perm, inv

    def a2a(self, out, inp, c: int, reverse: bool):
        """Dispatch direction (tokens to experts) or, reversed, combine direction."""
        p, st = self.plan, self.streams
        st.comm_waits_compute()
        st.comm_uses(inp)
        m = p.matrix[c]
        with st.comm():
            if reverse:
                mt = [list(r) for r in zip(*m)]
                self.transport(out, inp, p.send[c], p.recv[c], self.group, mt)
            else:
                self.transport(out, inp, p.recv[c], p.send[c], self.group, m)
        return st.mark_comm()


def _experts_fwd(xg, w_in, w_out, rows, impl):
    if xg.shape[0] == 0:
        return xg.new_empty((0, w_in.shape[2])), xg.new_empty((0, w_out.shape[2]))
    h = grouped_mm(xg, w_in, rows, impl=impl)
    return h, grouped_mm(swiglu(h), w_out, rows, impl=impl)


class _PipelinedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_A, w_in, w_out, pipe: ChunkPipeline, impl):
        plan, st = pipe.plan, pipe.streams
        C, H = len(plan.bounds), x_TH.shape[1]
        metas = [pipe.meta(c) for c in range(C)]
        keep = pipe.keep_outputs
        # Combined expert outputs: one buffer kept for the backward, or one per chunk, dropped
        # once accumulated (the backward then rebuilds what it needs on the expert side).
        y_A = x_TH.new_empty((plan.order_A.numel(), H)) if keep else x_TH.new_empty((0, H))
        comb = [None] * C
        y_TH = torch.zeros_like(x_TH)
        recv, d_mark, c_mark, saved = [None] * C, [None] * C, [None] * C, []

        def dispatch(c):
            recv[c] = x_TH.new_empty((sum(plan.recv[c]), H))
            d_mark[c] = pipe.a2a(recv[c], x_TH[metas[c][0]], c, reverse=False)

        def accumulate(c):
            st.compute_waits(c_mark[c])
            a0, a1 = pipe.arange(c)
            y_TH.index_add_(0, metas[c][0], comb[c] * w_A[a0:a1, None].to(comb[c].dtype))
            comb[c] = None

        for c in range(min(2, C)):
            dispatch(c)
        for c in range(C):
            st.compute_waits(d_mark[c])
            xg = recv[c][metas[c][1]]
            recv[c] = None
            h, yg = _experts_fwd(xg, w_in, w_out, plan.expert_rows[c], impl)
            a0, a1 = pipe.arange(c)
            comb[c] = y_A[a0:a1] if keep else x_TH.new_empty((a1 - a0, H))
            c_mark[c] = pipe.a2a(comb[c], yg[metas[c][2]], c, reverse=True)
            if c + 2 < C:
                dispatch(c + 2)
            if c:
                accumulate(c - 1)
            saved += [xg, h]
        a0, a1 = pipe.arange(C - 1)
        pipe.last = (c_mark[C - 1], metas[C - 1][0], comb[C - 1], w_A[a0:a1])
        st.pending.append(c_mark[C - 1])
        ctx.save_for_backward(w_A, w_in, w_out, y_A, *saved)
        ctx.pipe, ctx.impl, ctx.keep = pipe, impl, keep
        return y_TH

    @staticmethod
    def backward(ctx, g_TH):
        w_A, w_in, w_out, y_A, *saved = ctx.saved_tensors
        pipe, impl = ctx.pipe, ctx.impl
        plan, st = pipe.plan, pipe.streams
        st.flush_pending()  # a recomputed forward may have left its last combine in flight
        C, H = len(plan.bounds), g_TH.shape[1]
        started, pipe.bwd_started = pipe.bwd_started, None
        g_TH = started[0] if started else g_TH.contiguous()
        metas = started[1] if started else [pipe.meta(c) for c in range(C)]
        gx_TH = torch.zeros_like(g_TH)
        keep = ctx.keep
        g_wA = torch.empty_like(w_A)
        gw_A = None if keep else torch.empty(w_A.shape, dtype=torch.float32, device=w_A.device)
        gw_mark = None
        acc = torch.float32 if w_in.element_size() < 4 and C > 1 else w_in.dtype
        dw_in = torch.zeros(w_in.shape, dtype=acc, device=w_in.device)
        dw_out = torch.zeros(w_out.shape, dtype=acc, device=w_out.device)
        w_in_t, w_out_t = w_in.transpose(1, 2), w_out.transpose(1, 2)
        gx_A = g_TH.new_empty((plan.order_A.numel(), H))
        recv, d_mark = (started[2], started[3]) if started else ([None] * C, [None] * C)
        c_mark = [None] * C
        for c in range(C if keep else 0):  # router-weight gradient: <g, combined output>
            a0, a1 = pipe.arange(c)
            g_wA[a0:a1] = (g_TH[metas[c][0]].float() * y_A[a0:a1].float()).sum(-1).to(g_wA.dtype)

        def dispatch(c):
            pipe.dispatch_grad(g_TH, c, metas, recv, d_mark)

        def accumulate(c):
            st.compute_waits(c_mark[c])
            a0, a1 = pipe.arange(c)
            gx_TH.index_add_(0, metas[c][0], gx_A[a0:a1])

        for c in range(min(2, C)):
            if d_mark[c] is None and recv[c] is None:
                dispatch(c)
        for c in range(C):
            st.compute_waits(d_mark[c])
            gy = recv[c][metas[c][1]]
            recv[c] = None
            xg, h = saved[2 * c], saved[2 * c + 1]
            rows = plan.expert_rows[c]
            a0, a1 = pipe.arange(c)
            if gy.shape[0]:
                ga = grouped_mm(gy, w_out_t, rows, impl=impl)           # dgrad first ...
                gh, a = swiglu_backward(h, ga)
                gxg = grouped_mm(gh, w_in_t, rows, impl=impl)
            else:
                gxg = gy
            c_mark[c] = pipe.a2a(gx_A[a0:a1], gxg[metas[c][2]], c, reverse=True)
            if not keep:
                # <gy, expert output> on the expert side (gy = w * g, so this is w * <g, y>),
                # from the output recomputed with one GEMM, sent back beside dX.
                gw_e = ((gy.float() * grouped_mm(a, w_out, rows, impl=impl).float()).sum(-1)
                        if gy.shape[0] else gy.new_zeros((0,), dtype=torch.float32))
                gw_mark = pipe.a2a(gw_A[a0:a1], gw_e[metas[c][2]], c, reverse=True)
            if c + 2 < C:
                dispatch(c + 2)
            if gy.shape[0]:                                            # ... wgrad in the gap
                dw_out += grouped_mm_wgrad(a, gy, rows, w_out, impl)
                dw_in += grouped_mm_wgrad(xg, gh, rows, w_in, impl)
            if c:
                accumulate(c - 1)
        accumulate(C - 1)
        if not keep:
            st.compute_waits(gw_mark)
            w = w_A.float()
            # w = 0 only where softmax underflowed; the router's gradient multiplies dL/dw by w
            # there, so any finite value is exact: 0.
            g_wA = torch.where(w > 0, gw_A / torch.where(w > 0, w, 1.0), 0.0).to(w_A.dtype)
        return gx_TH, g_wA, dw_in.to(w_in.dtype), dw_out.to(w_out.dtype), None, None


class _FinishCombine(torch.autograd.Function):
    """Completes the routed output after work that ran under the last combine (forward), and
    starts the first gradient dispatches so the same work's backward runs under them."""

    @staticmethod
    def forward(ctx, y_partial, y_fill, pipe: ChunkPipeline):
        mark, tok, y_rows, w_rows = pipe.last
        pipe.last = None
        st = pipe.streams
        st.compute_waits(mark)
        st.pending.remove(mark) if mark in st.pending else None
        out = y_partial + y_fill
        out.index_add_(0, tok, y_rows * w_rows[:, None].to(y_rows.dtype))
        ctx.pipe = pipe
        return out

    @staticmethod
    def backward(ctx, g):
        pipe = ctx.pipe
        C = len(pipe.plan.bounds)
        g = g.contiguous()
        metas = [pipe.meta(c) for c in range(C)]
        recv, marks = [None] * C, [None] * C
        for c in range(min(2, C)):
            pipe.dispatch_grad(g, c, metas, recv, marks)
        pipe.bwd_started = (g, metas, recv, marks)
        return g, g, None
