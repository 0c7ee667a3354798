"""The chunked expert-parallel MoE pipeline, forward and backward, as one autograd Function.

Legend: T tokens, A assignments (T*K), H hidden, F expert FFN, M rows one rank's experts receive
in a chunk, C chunks, c a chunk.

Forward, with a communication stream beside the compute stream (HostStreams on CPU: the same
order, run serially):

    compute  | gemm 0 | gemm 1 | acc 0 | gemm 2 | acc 1 | ...
    comm     | d0 d1  |  c0 d2 |        c1 d3  |        ...       d = dispatch, c = combine

Dispatch of chunk c+2 is issued behind the combine of chunk c, so while chunk c+1's expert GEMMs
run, the comm stream carries the combine of c and the dispatch of c+2. The backward mirrors it:
gradient dispatch of chunk c+2 and the dgrad combine of chunk c run under chunk c+1's dgrad GEMMs.

Weight gradients (wgrad="in_chunks"): where a chunk's experts are its own (expert chunks, or a
single chunk), its weight gradients run inside its step, each as soon as its operands exist: dW_out
right after the SwiGLU backward (so dY's rows and the SwiGLU output are freed before dX's rows
are made), dW_in after dX's rows are handed to the combine, under it. A chunk's operands then
live for one chunk, not the layer, and every chunk's compute grows by its wgrad, which the comm
stream's all-to-alls run beside. Token chunks share every expert, so their weight gradients are
delayed to the end (and so are expert chunks' with wgrad="delayed"): each chunk's dgrad writes
its operands into chunk-major buffers (the forward's expert inputs already sit in one); at the
end both operands of each weight are gathered into expert-major order and one grouped GEMM per
weight (a group per expert, all chunks' rows deep) runs under the last chunk's combine. Each of
those buffers is freed once its last read is issued (dY's rows and the SwiGLU output before dW_in's
operands are gathered); only the compute stream reads them, so no stream needs recording.
Per-chunk wgrads of token chunks would each write a weight-sized tensor (0.75 ms per chunk and
weight for 128 local experts on an H200), and so would a (chunk, expert)-grouped GEMM's C
partials plus their sum; scattering rows into an expert-major layout as each chunk finishes
(index_put) ran at a third of copy bandwidth, the gather at full.
wgrad="auto": in the chunks at EP > 1 (the all-to-alls run beside them) or with one chunk (no dW
slice copy); delayed on one rank with several chunks, where nothing runs under them and every
slice is a copy (measured: docs/primitives/chunked_ep.md).

A chunk is a range of each rank's local experts (plan.expert_bounds: every token's assignments to
them; its GEMMs read only those experts' weights) or a token range. Combines never use atomics:
rows are gathered back to (token, k) order and reduced with one batched [1, K] x [K, H] product,
per chunk into its token slice for token chunks, once at the end over all rows for expert chunks
(a token's rows come back over several chunks).
Grouped-GEMM offsets come from the route plan on the device: no host list reaches the device
inside the layer (each would be a stream synchronisation).

One rank (an EP group of one, e.g. the pipeline timed on a single device): no all-to-all moves a
row, so none is issued, and the source-major <-> expert-major gathers, identities with one
source, are skipped. One index_select gathers every chunk's tokens straight into the
expert-input buffer they share, and in the backward one gather_scale every chunk's gradient
rows (as is, the delayed schedule's dY operand: no copy into it); each chunk's expert outputs
and dX rows stay where its GEMMs wrote them, and the combines read them there
(gather_sum_parts: one kernel over up to four chunks' buffers). On an H200 at 16K tokens the
transfers and gathers were 8 full passes over the rows per layer step (+28% at C = 1), and
copying each chunk's rows into one buffer cost 0.5 ms at C = 2. Each in-chunk weight
gradient's slice copy (below) runs on the idle comm stream, issued before the chunk's dX GEMM
so that it runs beside it (the last chunk's copies then end under the layer's own work, not
after it).

Host time: per-chunk views come from one split (or view) per tensor and layer, implementations
are chosen once per layer, one rank concatenates the router weights' gradient rows once and
waits on no dispatch marks: an expert chunk with in-chunk weight gradients adds 10 operations
(the unpipelined layer's 8 kernels and 2 dW slice copies) and 4 stream calls (pinned by
tests/test_moe_pipeline.py). At 16K tokens an H200 runs each chunk's GEMMs in 0.1-0.3 ms, so a
layer with several chunks runs near the host's pace (docs/primitives/chunked_ep.md).

Everything the backward keeps goes through save_for_backward, so full recompute (non-reentrant
checkpoint) drops it and rebuilds it by rerunning this same pipelined forward.
"""

from __future__ import annotations

import torch

from longmoe.ops.grouped_mm import GROUPED_MM, grouped_mm_wgrad, wgrad_fn
from longmoe.ops.moe_rows import MOE_ROWS, gather_sum_parts
from longmoe.parallel.routing import RoutePlan, inverse_permutation, source_major_to_expert_major


WGRAD = ("auto", "in_chunks", "delayed")


class ChunkPipeline:
    """One layer's route plan plus how to move rows (transport) and order work (streams)."""

    def __init__(self, plan: RoutePlan, top_k: int, group, transport, streams,
                 rows_impl: str = "auto", wgrad: str = "auto"):
        if wgrad not in WGRAD:
            raise ValueError(f"wgrad must be one of {', '.join(WGRAD)}, got {wgrad!r}")
        self.plan, self.top_k, self.group = plan, top_k, group
        self.transport, self.streams = transport, streams
        self.rows_impl = rows_impl  # the gather/SwiGLU row kernels (ops/moe_rows.py)
        self.wgrad = wgrad
        self._metas = self._table = self._rows = self._em = None
        # An EP group of one: the all-to-alls move nothing (see the module docstring).
        self.local = bool(plan.send) and len(plan.send[0]) == 1

    def wgrad_in_chunks(self) -> bool:
        """Whether each chunk's weight gradient runs right after its dgrad (it writes only its
        own experts' slice: expert chunks, or one chunk) rather than once at the end; "auto" as
        the module docstring says."""
        one = len(self.plan.bounds) == 1
        if self.wgrad == "delayed" or not (self.by_experts or one):
            return False
        return self.wgrad == "in_chunks" or not self.local or one

    def run(self, x_TH, w_TK, w_in, w_out, impl: str = "auto"):
        """The routed output without the last chunk's combine, which is left in flight: call
        `finish` with the work that should run under it (the shared expert)."""
        self.last = None        # (mark, tokens, combined rows, weights) of the pending chunk
        self.bwd_started = None  # gradient dispatches issued early by _FinishCombine.backward
        # w_TK: the combine weights in (token, k) order, flat. Sorted here like the rows, without
        # autograd: the gradient of an autograd index is a scatter-add per layer (on a GPU a
        # sort of the A indices first); the backward returns the token-order gradient by a gather.
        self.w_A = w_TK.detach()[self.plan.order_A]
        # Per chunk where each chunk dispatches its own gradient rows (not one rank: one gather)
        self.w_A_c = None if self.local else self.split_rows(self.w_A, by="a")
        return _PipelinedExperts.apply(x_TH, w_TK, w_in, w_out, self, impl)

    def finish(self, y_partial, y_fill):
        """y_partial + y_fill + the pending last chunk, once its combine has landed."""
        return _FinishCombine.apply(y_partial, y_fill, self)

    def rows(self, x: torch.Tensor):
        """The row kernels (ops/moe_rows.py: TorchRows or TritonRows), chosen once per layer from
        its first row tensor (the choice depends on device and dtype, the layer's for every
        chunk) rather than at each of a chunk's three calls. The pipeline's row tensors are all
        row-major (fresh GEMM outputs, contiguous gradients, dim-0 slices of contiguous
        buffers), which is what the per-call wrappers would otherwise check."""
        if self._rows is None:
            self._rows = MOE_ROWS.select(self.rows_impl, x).fn
        return self._rows

    def dispatch_grads(self, g_TH, metas, recv, marks):
        """The backward's first gradient dispatches (chunks 0 and 1; the rest follow behind
        the combines). One rank: every chunk's rows in one gather, as the forward gathers its
        inputs, split per chunk (the rows are already where the experts read them); that
        buffer is returned (None otherwise). g_TH is contiguous (both callers make it so)."""
        if self.local:
            g_rows, _ = self.rows(g_TH).gather_scale(g_TH, self.tok_A, self.w_A, None)
            recv[:] = self.split_rows(g_rows)
            return g_rows
        for c in range(min(2, len(recv))):
            self.dispatch_grad(g_TH, c, metas, recv, marks)
        return None

    def dispatch_grad(self, g_TH, c: int, metas, recv, marks):
        """Gradient rows of chunk c (scaled by the routing weights) to the experts' ranks."""
        g_rows, _ = self.rows(g_TH).gather_scale(g_TH, metas[c][0], self.w_A_c[c], None)
        recv[c] = g_TH.new_empty((self.table()["nrows"][c], g_TH.shape[1]))
        marks[c] = self.a2a(recv[c], g_rows, c, reverse=False)

    # --- per-chunk index metadata (device tensors; no host sync) --------------------------
    def arange(self, c: int) -> tuple[int, int]:
        """Chunk c's rows of the sorted assignments (order_A)."""
        return self.plan.a_ranges[c]

    @property
    def by_experts(self) -> bool:
        return self.plan.expert_bounds is not None

    def row_slices(self) -> list[slice]:
        """Where each chunk's received rows sit in the layer's chunk-major row buffers."""
        return self.table()["rs"]

    def table(self) -> dict:
        """Per-chunk host values, computed once per layer and shared by forward and backward:
        received rows (`nrows`) and their slice of the chunk-major buffers (`rs`), rows of the
        sorted assignments (`asizes`), and the local experts each chunk's GEMMs use: all of them
        for token chunks (`esizes` None), its own range for expert chunks (the others have no
        rows in it; `esizes` their counts), with the rows per expert (`rows`) and their int32
        end offsets on the device (`offs`)."""
        if self._table is None:
            p = self.plan
            nrows = [sum(r) for r in p.recv]
            rs, base = [], 0
            for n in nrows:
                rs.append(slice(base, base + n))
                base += n
            if p.expert_bounds is None:
                esizes, rows, offs = None, p.expert_rows, p.offs
            else:
                esizes = [e - s for s, e in p.expert_bounds]
                rows = [r[s:e] for r, (s, e) in zip(p.expert_rows, p.expert_bounds)]
                offs = p.offs  # already its own experts' (routing.py)
            self._table = {"nrows": nrows, "rs": rs, "esizes": esizes, "rows": rows,
                           "offs": offs, "asizes": [a1 - a0 for a0, a1 in p.a_ranges]}
        return self._table

    def split_rows(self, t: torch.Tensor, by: str = "recv"):
        """t's rows per chunk (views, one split_with_sizes, without Tensor.split's Python wrapper):
        chunk-major buffers (`recv`, each chunk's experts' rows) or sorted assignments (`a`)."""
        sizes = self.table()["nrows" if by == "recv" else "asizes"]
        return (t,) if len(sizes) == 1 else t.split_with_sizes(sizes)

    def split_experts(self, w: torch.Tensor):
        """w's local-expert slice for each chunk (views: one split, not a slice per chunk)."""
        es = self.table()["esizes"]
        return (w,) * len(self.plan.bounds) if not es or len(es) == 1 else w.split_with_sizes(es)

    def metas(self):
        """Per chunk: (token of each sent row, received->expert-major gather, its inverse, and
        the gather putting the chunk's sorted rows back in (token, k) order for the combine;
        None for expert chunks, which combine all rows at once through `tk_all`, the same gather
        for the whole layer). Built for all chunks at once (a handful of kernels per layer, not
        per chunk) and kept for the backward."""
        if self._metas is None:
            p, K = self.plan, self.top_k
            tok_A = self.tok_A = p.order_A // K
            tk_A = self.tk_all = p.inv_A
            rs = self.row_slices()
            if not self.local:  # one source: received order is expert-major already
                perm_all = source_major_to_expert_major(torch.stack(p.recv_SL), rs[-1].stop)
                inv_all = inverse_permutation(perm_all)
            # One rank gathers every chunk's rows at once (tok_A): no per-chunk token lists.
            tok_c = (None,) * len(rs) if self.local else self.split_rows(tok_A, by="a")
            tk_c = None if self.by_experts else self.split_rows(tk_A, by="a")
            out = []
            for c, r in enumerate(rs):
                perm = None if self.local else (perm_all[r] - r.start, inv_all[r] - r.start)
                out.append((tok_c[c], *(perm or (None, None)),
                            None if tk_c is None else tk_c[c] - self.arange(c)[0]))
            self._metas = out
        return self._metas

    def expert_major(self):
        """(gather from the chunk-major row buffers to expert-major order, rows per local expert
        over all chunks, their int32 end offsets) for the delayed weight gradient: built once
        per layer, for both weights."""
        if self._em is None:
            p = self.plan
            total = sum(sum(r) for r in p.expert_rows)
            # Expert chunks: chunk-major already is expert-major (no gather: None).
            perm = None if self.by_experts else source_major_to_expert_major(p.rows_CL, total)
            sizes = [sum(col) for col in zip(*p.expert_rows)]
            self._em = perm, sizes, p.rows_CL.sum(0).cumsum(0).to(torch.int32)
        return self._em

    def split_tokens(self, t: torch.Tensor):
        """t's rows per token chunk (token order; views from one split)."""
        b = self.plan.bounds
        return (t,) if len(b) == 1 else t.split_with_sizes([e - s for s, e in b])

    def copy_beside(self, pairs, mark: bool = True):
        """out <- inp for each (out, inp), in one go on the comm stream, beside the compute
        stream's next work (one rank, where the comm stream has no all-to-all to run). With
        mark=False no marker is made (the caller waits for all comm work at once later)."""
        st = self.streams
        st.comm_waits_compute()
        for _, inp in pairs:
            st.comm_uses(inp)
        with st.comm():
            for out, inp in pairs:
                out.copy_(inp)
        return st.mark_comm() if mark else None

    def a2a(self, out, inp, c: int, reverse: bool):
        """Dispatch direction (tokens to experts) or, reversed, combine direction. One rank:
        nothing when `out` is `inp`, else a copy on the comm stream."""
        p, st = self.plan, self.streams
        if self.local:  # nothing to move where the rows are already in place
            return None if out.data_ptr() == inp.data_ptr() else self.copy_beside([(out, inp)])
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


class _Gemms:
    """grouped_mm with its implementation chosen once per weight and layer (it depends on the
    device, dtype and widths, the same for every chunk), not at each chunk's call; the route
    plan's row counts match the buffers by construction, so they are not re-checked either."""

    def __init__(self, impl: str):
        self.impl, self.fns = impl, {}

    def __call__(self, key: str, x, w, rows, offs):
        fn = self.fns.get(key)
        if fn is None:
            fn = self.fns[key] = GROUPED_MM.select(self.impl, x, w, rows).fn
        return fn(x, w, rows, offs)


def _experts_fwd(xg, w_in, w_out, rows, offs, mm: _Gemms, pipe: ChunkPipeline):
    if xg.shape[0] == 0:
        return xg.new_empty((0, w_in.shape[2])), xg.new_empty((0, w_out.shape[2]))
    h = mm("in", xg, w_in, rows, offs)
    return h, mm("out", pipe.rows(h).swiglu(h), w_out, rows, offs)


def _chunked_wgrad(operands: list, pipe: "ChunkPipeline", w, impl):
    """dW = sum over chunks of x_c^T dy_c per expert, from chunk-major operands: both operands
    gathered into expert-major order (each expert's rows of every chunk together), then one
    grouped GEMM with a group per expert and the full row count as its depth. The gather is one
    pass over the operands; the alternative, a group per (chunk, expert) and a sum of C
    weight-sized partials, re-reads the weights' size C times (on one H200 rank at 16K tokens,
    256 experts, C = 4: 9.6 ms of sums and fp32 casts plus 1.5 ms of slower small-group GEMMs).

    `operands` = [x_all, dy_all] is emptied: where the caller holds no other reference, each
    buffer is freed once its last read is issued (its gather, or the GEMM). Both are read on the
    compute stream only, so the caching allocator hands their memory to later work on that
    stream, ordered after those reads."""
    x_all, dy_all = operands
    operands.clear()
    plan = pipe.plan
    if x_all.shape[0] == 0:
        return torch.zeros_like(w)
    if len(plan.bounds) == 1:
        return grouped_mm_wgrad(x_all, dy_all, plan.expert_rows[0], w, impl, plan.offs[0])
    perm, sizes, offs = pipe.expert_major()
    if perm is None:
        return grouped_mm_wgrad(x_all, dy_all, sizes, w, impl, offs)
    x_all = x_all.index_select(0, perm)
    dy_all = dy_all.index_select(0, perm)
    return grouped_mm_wgrad(x_all, dy_all, sizes, w, impl, offs)


def _zero_slice(dw, w, dw_c):
    if dw is None:
        return torch.zeros_like(w)
    dw_c.zero_()
    return dw


class _PipelinedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_TK, w_in, w_out, pipe: ChunkPipeline, impl):
        plan, st = pipe.plan, pipe.streams
        C, H, K = len(plan.bounds), x_TH.shape[1], pipe.top_k
        metas, tab = pipe.metas(), pipe.table()
        # The expert-major inputs of all chunks in one chunk-major buffer, so the backward's
        # weight gradient reads them without a copy.
        rs = tab["rs"]
        xg_all = x_TH.new_empty((rs[-1].stop, H))
        xg_c = pipe.split_rows(xg_all)
        if pipe.local:  # every chunk's rows in one gather: the buffer holds them all anyway
            torch.index_select(x_TH, 0, pipe.tok_A, out=xg_all)
        w_in_c, w_out_c = pipe.split_experts(w_in), pipe.split_experts(w_out)
        mm = _Gemms(impl)
        # Combined expert outputs: one buffer per chunk, dropped once accumulated (the router
        # weights' gradient is rebuilt on the expert side in the backward).
        comb = [None] * C
        by_e = pipe.by_experts
        # Expert chunks return each token's rows over several chunks: one buffer for all, reduced
        # once at the end (in _FinishCombine); token chunks reduce each chunk into its slice.
        # (Allocated at the first combine, once that chunk's expert outputs are freed.) Their
        # partial output is zero: a broadcast scalar, never read (not a zero-filled T x H).
        y_A = None
        y_TH = x_TH.new_zeros(()).expand_as(x_TH) if by_e else torch.empty_like(x_TH)
        # Token chunks: each chunk's output rows and combine weights (one split each)
        y_c, w_c = (None, None) if by_e else (pipe.split_tokens(y_TH), pipe.split_rows(w_TK, "a"))
        recv, d_mark, c_mark, hs = [None] * C, [None] * C, [None] * C, []

        def dispatch(c):
            if pipe.local:  # gathered straight into the expert inputs above
                return
            recv[c] = x_TH.new_empty((tab["nrows"][c], H))
            d_mark[c] = pipe.a2a(recv[c], x_TH[metas[c][0]], c, reverse=False)

        def accumulate(c):
            st.compute_waits(c_mark[c])
            pipe.rows(y_TH).gather_sum(comb[c], metas[c][3], w_c[c], K, y_c[c], False)
            comb[c] = None

        for c in range(min(2, C)):
            dispatch(c)
        for c in range(C):
            if not pipe.local:  # one rank dispatches nothing: no mark to wait for
                st.compute_waits(d_mark[c])
            xg = xg_c[c]
            if not pipe.local:
                torch.index_select(recv[c], 0, metas[c][1], out=xg)
            recv[c] = None
            h, yg = _experts_fwd(xg, w_in_c[c], w_out_c[c], tab["rows"][c], tab["offs"][c], mm,
                                 pipe)
            a0, a1 = pipe.arange(c)
            send = yg if pipe.local else yg[metas[c][2]]
            yg = None  # its gathered copy is what the comm stream sends
            if pipe.local:  # one rank: the rows stay where the chunk's GEMM wrote them
                comb[c] = send
            elif by_e:
                if y_A is None:
                    y_A = x_TH.new_empty((plan.order_A.numel(), H))
                comb[c] = y_A[a0:a1]
            else:
                comb[c] = x_TH.new_empty((a1 - a0, H))
            c_mark[c] = pipe.a2a(comb[c], send, c, reverse=True)
            send = None
            if c + 2 < C:
                dispatch(c + 2)
            if c and not by_e:
                accumulate(c - 1)
            hs.append(h)
        if by_e:  # every chunk's combine lands in _FinishCombine, reduced there at once
            pipe.last = (c_mark[C - 1], (0, x_TH.shape[0]), pipe.tk_all,
                         comb if pipe.local else [y_A], w_TK)
        else:
            y_c[C - 1].zero_()  # the last chunk's combine lands in _FinishCombine
            pipe.last = (c_mark[C - 1], plan.bounds[C - 1], metas[C - 1][3], [comb[C - 1]],
                         w_c[C - 1])
        if c_mark[C - 1] is not None:
            st.pending.append(c_mark[C - 1])
        ctx.save_for_backward(w_TK, w_in, w_out, xg_all, *hs)
        ctx.pipe, ctx.impl = pipe, impl
        return y_TH

    @staticmethod
    def backward(ctx, g_TH):
        w_TK, w_in, w_out, xg_all, *hs = ctx.saved_tensors
        pipe, impl = ctx.pipe, ctx.impl
        plan, st = pipe.plan, pipe.streams
        st.flush_pending()  # a recomputed forward may have left its last combine in flight
        C, H, K = len(plan.bounds), g_TH.shape[1], pipe.top_k
        started, pipe.bwd_started = pipe.bwd_started, None
        g_TH = started[0] if started else g_TH.contiguous()
        metas, tab = pipe.metas(), pipe.table()
        gx_TH = torch.empty_like(g_TH)
        gx_c = None if pipe.by_experts else pipe.split_tokens(gx_TH)  # token chunks' dX rows
        acc = torch.float64 if g_TH.dtype == torch.float64 else torch.float32  # fp64 stays fp64
        # Router weights' gradient rows: one rank keeps each chunk's and concatenates them once
        # at the end; otherwise they come back through the combine's all-to-all into gw_A.
        gw_A = [] if pipe.local else torch.empty(w_TK.shape, dtype=acc, device=w_TK.device)
        gw_A_c = None if pipe.local else pipe.split_rows(gw_A, by="a")
        w_in_t, w_out_t = pipe.split_experts(w_in.transpose(1, 2)), \
            pipe.split_experts(w_out.transpose(1, 2))
        xg_c = pipe.split_rows(xg_all) if pipe.wgrad_in_chunks() else None  # dW_in's, per chunk
        recv, d_mark, g_all = started[1:] if started else ([None] * C, [None] * C, None)
        if not started:
            g_all = pipe.dispatch_grads(g_TH, metas, recv, d_mark)
        # One rank: g_all holds every chunk's gradient rows (recv their views); only the delayed
        # schedule keeps it past the chunk loop, as its dY operand.
        started = None
        c_mark = [None] * C
        rs = tab["rs"]
        by_e, now = pipe.by_experts, pipe.wgrad_in_chunks()
        # Combined dX rows: expert chunks return a token's rows over several chunks, so one
        # buffer for the layer (allocated at the first combine); token chunks one per chunk,
        # dropped once reduced into the chunk's tokens.
        gx_A = [None] * C
        if now:  # each chunk's weight gradient right after its dgrad, into its experts' slice
            dw_in = torch.empty_like(w_in) if C > 1 else None
            dw_out = torch.empty_like(w_out) if C > 1 else None
            dw_in_c = pipe.split_experts(dw_in) if C > 1 else (None,)
            dw_out_c = pipe.split_experts(dw_out) if C > 1 else (None,)
        else:
            # Delayed: every chunk's operands, chunk-major, written in place as each chunk's
            # dgrad produces them; one weight-gradient GEMM per weight at the end of the layer.
            # One rank: dY's rows were gathered into one such buffer already.
            gy_all = g_all if pipe.local else g_TH.new_empty((rs[-1].stop, H))
            gh_all = g_TH.new_empty((rs[-1].stop, w_in.shape[2]))
            a_all = g_TH.new_empty((rs[-1].stop, w_out.shape[1]))
            gy_c = recv if pipe.local else pipe.split_rows(gy_all)
            gh_c, a_c = pipe.split_rows(gh_all), pipe.split_rows(a_all)

        g_all = None

        def dispatch(c):
            if not pipe.local:  # one rank: every chunk's rows are in place already
                pipe.dispatch_grad(g_TH, c, metas, recv, d_mark)

        def accumulate(c):
            st.compute_waits(c_mark[c])
            pipe.rows(gx_TH).gather_sum(gx_A[c], metas[c][3], None, K, gx_c[c], False)
            gx_A[c] = None

        def combine_buffer(c, send):
            a0, a1 = pipe.arange(c)
            if pipe.local or not by_e:  # one rank: the dX rows stay where the GEMM wrote them
                gx_A[c] = send if pipe.local else g_TH.new_empty((a1 - a0, H))
                return gx_A[c]
            if gx_A[0] is None:
                gx_A[0] = g_TH.new_empty((plan.order_A.numel(), H))
            return gx_A[0][a0:a1]

        mm = _Gemms(impl)
        wgrads = {}  # the GEMM implementation chosen once per weight, not per chunk (host time)
        moves = []  # one rank: a chunk's dW slice copies, issued together on the comm stream
        comm_used = not pipe.local

        def wgrad_into(dw, dw_c, x, dy, w, rows, offs):
            # x has rows here: `w` gives only the result's dtype (no per-chunk slice of it)
            fn = wgrads.get(id(w))
            if fn is None:
                fn = wgrads[id(w)] = wgrad_fn(impl, x, w, rows)
            d = fn(x, dy, rows, w, offs)
            if dw is None:
                return d
            # torch._grouped_mm has no out=: the chunk's slice is copied in (for 256 local experts
            # 1.5 GiB per layer step in all; one rank runs it beside the chunk's dX GEMM).
            if pipe.local:
                moves.append((dw_c, d))
            else:
                dw_c.copy_(d)
            return dw

        for c in range(C):
            if not pipe.local:  # one rank: every chunk's rows were gathered before the loop
                st.compute_waits(d_mark[c])
            rows, offs = tab["rows"][c], tab["offs"][c]
            if now:
                gy = recv[c] if pipe.local else recv[c].index_select(0, metas[c][1])
                gh = a = None
            else:
                gy, gh, a = gy_c[c], gh_c[c], a_c[c]
                if not pipe.local:  # one rank: recv[c] is gy already
                    torch.index_select(recv[c], 0, metas[c][1], out=gy)
            recv[c] = None
            if gy.shape[0]:
                ga = mm("out_t", gy, w_out_t[c], rows, offs)      # dgrad
                # Router weights: dL/dw = <g, y> with y = a W_out the expert's output. On the
                # expert side gy = w g, so <gy, a W_out> = <gy W_out^T, a> = <ga, a> = w <g, y>:
                # a row dot over F of two tensors the dgrad already made, no GEMM, no kept y
                # (with the Triton rows kernels, in the SwiGLU backward's own pass).
                gh, a, gw_e = pipe.rows(ga).swiglu_backward(hs[c], ga, None if now else (gh, a),
                                                            True)
                ga = None
                if now:  # dW_out now: gy and a are dead before dX's rows are allocated
                    dw_out = wgrad_into(dw_out, dw_out_c[c], a, gy, w_out, rows, offs)
                    gy = a = None
                    if pipe.local:  # no combine to run under: dW_in and both slice copies
                        dw_in = wgrad_into(dw_in, dw_in_c[c], xg_c[c], gh, w_in, rows, offs)
                        if moves:  # beside the dX GEMM below (waited for once, at the end)
                            pipe.copy_beside(moves, mark=False)
                            moves.clear()
                            comm_used = True
                gxg = mm("in_t", gh, w_in_t[c], rows, offs)
            else:  # a fresh empty tensor: a view of gy kept in gx_A would keep gy_all alive
                gxg, gw_e = g_TH.new_empty((0, H)), g_TH.new_zeros((0,), dtype=acc)
                if now:  # no rows for these experts on this rank: their gradients are zero
                    dw_out = _zero_slice(dw_out, w_out, dw_out_c[c])
                    dw_in = _zero_slice(dw_in, w_in, dw_in_c[c])
            send = gxg if pipe.local else gxg[metas[c][2]]
            gxg = None  # only its gathered copy travels
            buf = combine_buffer(c, send)
            if pipe.local:  # the dX rows stay in place; the router weights' rows are small
                gw_A.append(gw_e)
            else:
                c_mark[c] = pipe.a2a(buf, send, c, reverse=True)
                pipe.a2a(gw_A_c[c], gw_e[metas[c][2]], c, reverse=True)
            send = gw_e = buf = None
            if now and gh is not None and not pipe.local:  # dW_in under this chunk's combine
                dw_in = wgrad_into(dw_in, dw_in_c[c], xg_c[c], gh, w_in, rows, offs)
            # Delayed: gy, gh and a are views of the layer's buffers; kept past the loop they
            # would hold those buffers until the backward returns.
            gy = gh = a = None
            if c + 2 < C:
                dispatch(c + 2)
            if c and not by_e:
                accumulate(c - 1)
        if not now:  # the layer's weight gradients run under the last chunk's combine
            # Only these lists hold the operand buffers from here (the per-chunk views are
            # dropped), so each is freed once its last read is issued: dY's rows and the SwiGLU
            # output before dW_in's operands are gathered. None of them reaches the comm stream.
            ops_out, ops_in = [a_all, gy_all], [xg_all, gh_all]
            del a_all, gy_all, gh_all, gy_c, gh_c, a_c
            dw_out = _chunked_wgrad(ops_out, pipe, w_out, impl)
            dw_in = _chunked_wgrad(ops_in, pipe, w_in, impl)
        if by_e:  # each token's dX rows came back over several chunks: sum them now
            st.compute_waits(c_mark[C - 1])
            gather_sum_parts(gx_A if pipe.local else gx_A[:1], pipe.tk_all, None, K, out=gx_TH,
                             impl=pipe.rows_impl)
            gx_A.clear()  # read on the compute stream, after it waited for the last combine
        else:
            accumulate(C - 1)
        if comm_used:  # the router weights' rows and any dW slice copies
            st.compute_waits(st.mark_comm())
        if pipe.local:
            gw_A = gw_A[0] if C == 1 else torch.cat(gw_A)
        # w = 0 only where softmax underflowed; the router's gradient multiplies dL/dw by w
        # there, so any finite value is exact: 0.
        w = w_TK.to(acc)
        g_wTK = (gw_A[pipe.tk_all] / w).masked_fill_(w <= 0, 0).to(w_TK.dtype)
        return gx_TH, g_wTK, dw_in, dw_out, None, None


class _FinishCombine(torch.autograd.Function):
    """Completes the routed output after work that ran under the last combine (forward), and
    starts the first gradient dispatches so the same work's backward runs under them."""

    @staticmethod
    def forward(ctx, y_partial, y_fill, pipe: ChunkPipeline):
        mark, (s, e), tk, y_rows, w_tok = pipe.last  # w_tok: weights in (token, k) order
        pipe.last = None
        st = pipe.streams
        st.compute_waits(mark)
        st.pending.remove(mark) if mark in st.pending else None
        # Expert chunks: y_partial is zero (every row comes back in this combine), so y_fill as is
        out = (y_fill.clone(memory_format=torch.contiguous_format) if pipe.by_experts and
               y_fill.dtype == y_partial.dtype else y_partial + y_fill)
        gather_sum_parts(y_rows, tk, w_tok, pipe.top_k, accumulate=True, impl=pipe.rows_impl,
                         out=out if (s, e) == (0, out.shape[0]) else out[s:e])
        ctx.pipe = pipe
        return out

    @staticmethod
    def backward(ctx, g):
        pipe = ctx.pipe
        C = len(pipe.plan.bounds)
        g = g.contiguous()
        metas = pipe.metas()
        recv, marks = [None] * C, [None] * C
        pipe.bwd_started = (g, recv, marks, pipe.dispatch_grads(g, metas, recv, marks))
        return g, g, None
