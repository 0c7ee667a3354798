"""The MoE layer's memory-bound row work behind one interface (registry "moe_rows"): the combine
(gather each token's K expert rows and sum them weighted), its gradient, the dispatch's gradient,
and SwiGLU forward and backward.

Legend: T tokens, K top-k, A = T*K assignments, H hidden, M rows, F expert FFN.

Implementations:
  reference  eager PyTorch; runs everywhere. A combine is a gather that writes an A x H copy
             plus a batched product; SwiGLU's backward five elementwise kernels.
  triton     one pass each (ops/kernels/moe_rows.py), fp32 inside; tiles per vendor from backends.

Every op takes `impl` ("auto" picks triton where Triton can run on the tensors' device).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longmoe.ops.registry import Registry

MOE_ROWS = Registry("moe_rows", renamed={"torch": "reference"})


def row_dot(a_MH: torch.Tensor, b_MH: torch.Tensor) -> torch.Tensor:
    """sum_h a[m, h] * b[m, h], accumulated in fp32 (fp64 stays fp64)."""
    return (a_MH * b_MH).sum(-1, dtype=torch.promote_types(a_MH.dtype, torch.float32))


def swiglu(h_MF2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in plain autograd-able torch (h = [gate | up])."""
    gate, up = h_MF2.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchRows:
    """The reference."""

    @staticmethod
    def gather_sum(src, idx, w, K, out, accumulate):
        rows = src[idx].view(-1, K, src.shape[1])
        if w is not None:  # elementwise, not a batched product: the combine is row work
            rows = rows * w.view(-1, K, 1).to(rows.dtype)
        r = rows.sum(1)  # low-precision sums accumulate in fp32 inside
        return out.add_(r) if accumulate else out.copy_(r)

    @staticmethod
    def gather_sum_parts(parts, idx, w, K, out, accumulate):
        return TorchRows.gather_sum(torch.cat(parts), idx, w, K, out, accumulate)

    @staticmethod
    def gather_scale(src, idx, w, y):
        g = src[idx]
        out = g * w[:, None].to(g.dtype)
        return out, (row_dot(g, y) if y is not None else None)

    @staticmethod
    def swiglu(h):
        return swiglu(h)

    @staticmethod
    def swiglu_backward(h, ga, out, with_dot):
        """Five elementwise kernels in h's dtype (each computes in fp32 inside, as torch's opmath
        does): an fp32 round trip of the [M, 2F] tensors cost 8 passes over them."""
        gate, up = h.chunk(2, dim=-1)
        Fh = gate.shape[-1]
        gh, a = out if out is not None else (torch.empty_like(h), torch.empty_like(up))
        silu = F.silu(gate)
        torch.mul(ga, silu, out=gh[:, Fh:])
        gh[:, :Fh] = torch.ops.aten.silu_backward(ga * up, gate)
        torch.mul(silu, up, out=a)
        return gh, a, (row_dot(ga, a) if with_dot else None)


class TritonRows:
    """ops/kernels/moe_rows.py with the active backend's tiles."""

    @staticmethod
    def _cfg():
        from longmoe.backends import active_backend
        return active_backend().kernel_config("moe_rows")

    @staticmethod
    def gather_sum(src, idx, w, K, out, accumulate):
        from longmoe.ops.kernels.moe_rows import launch_gather_sum
        return launch_gather_sum(src, idx.contiguous(), None if w is None else w.contiguous(),
                                 out, K, accumulate, TritonRows._cfg())

    @staticmethod
    def gather_sum_parts(parts, idx, w, K, out, accumulate):
        from longmoe.ops.kernels.moe_rows import MAX_PARTS, launch_gather_sum_parts
        strides = {p.stride(0) for p in parts if p.shape[0]}
        if len(parts) > MAX_PARTS or len(strides) > 1:
            return TritonRows.gather_sum(torch.cat(parts), idx, w, K, out, accumulate)
        return launch_gather_sum_parts(parts, idx.contiguous(),
                                       None if w is None else w.contiguous(), out, K, accumulate,
                                       TritonRows._cfg())

    @staticmethod
    def gather_scale(src, idx, w, y):
        from longmoe.ops.kernels.moe_rows import launch_gather_scale
        out = src.new_empty((idx.numel(), src.shape[1]))
        dot = torch.empty(idx.numel(), device=src.device, dtype=torch.float32) \
            if y is not None else None
        launch_gather_scale(src, idx.contiguous(), w.contiguous(), out, y, dot, TritonRows._cfg())
        return out, dot

    @staticmethod
    def swiglu(h):
        from longmoe.ops.kernels.moe_rows import launch_swiglu
        a = h.new_empty((h.shape[0], h.shape[1] // 2))
        launch_swiglu(h, a, TritonRows._cfg())
        return a

    @staticmethod
    def swiglu_backward(h, ga, out, with_dot):
        from longmoe.ops.kernels.moe_rows import launch_swiglu_bwd
        gh, a = out if out is not None else (torch.empty_like(h), h.new_empty(ga.shape))
        dot = torch.empty(h.shape[0], device=h.device, dtype=torch.float32) if with_dot else None
        launch_swiglu_bwd(h, ga, gh, a, dot, TritonRows._cfg())
        return gh, a, dot


def _triton_check(x: torch.Tensor) -> str | None:
    from longmoe.ops.kernels import triton_ready
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"the Triton row kernels take bf16/fp16/fp32, not {x.dtype}"
    return triton_ready(x.device)


MOE_ROWS.register("triton", priority=5, check=_triton_check)(TritonRows)
MOE_ROWS.register("reference", priority=0, reference=True)(TorchRows)


def _ops(x: torch.Tensor, impl: str):
    return MOE_ROWS.select(impl, x).fn


def _rowwise(*ts: torch.Tensor) -> bool:
    return all(t.dim() == 2 and (t.shape[0] == 0 or t.stride(1) == 1) for t in ts)


def gather_sum(src_MH, idx_A, w_A=None, top_k: int = 1, out=None, accumulate: bool = False,
               impl: str = "auto") -> torch.Tensor:
    """out[t] (+)= sum_k w[t*K + k] * src[idx[t*K + k]] (w = 1 when None); `out` is [A/K, H] with
    unit column stride, fresh when None. No autograd."""
    if idx_A.numel() % top_k:
        raise ValueError(f"gather_sum: {idx_A.numel()} indices are not a multiple of top_k={top_k}")
    if out is None:
        out = src_MH.new_empty((idx_A.numel() // top_k, src_MH.shape[1]))
    if not _rowwise(src_MH, out):
        src_MH = src_MH.contiguous()
    ops = _ops(src_MH, impl) if _rowwise(out) else TorchRows
    return ops.gather_sum(src_MH, idx_A, w_A, top_k, out, accumulate)


def gather_sum_parts(parts: list[torch.Tensor], idx_A, w_A=None, top_k: int = 1, out=None,
                     accumulate: bool = False, impl: str = "auto") -> torch.Tensor:
    """gather_sum over the concatenation of `parts` (row buffers of one width and dtype), read
    where they are: the Triton kernel takes up to four buffers (more are concatenated first, as
    the reference does). The chunk pipeline's combine on one rank, whose chunks' rows stay where
    their GEMMs wrote them."""
    if len(parts) == 1:
        return gather_sum(parts[0], idx_A, w_A, top_k, out, accumulate, impl)
    if out is None:
        out = parts[0].new_empty((idx_A.numel() // top_k, parts[0].shape[1]))
    if not _rowwise(out, *parts):
        return gather_sum(torch.cat(parts), idx_A, w_A, top_k, out, accumulate, impl)
    return _ops(parts[0], impl).gather_sum_parts(parts, idx_A, w_A, top_k, out, accumulate)


def gather_scale(src_TH, idx_M, w_M, y_MH=None, impl: str = "auto"):
    """(out, dot): out[i] = w[i] * src[idx[i]], dot[i] = <src[idx[i]], y[i]> in fp32 (None
    without y). No autograd."""
    src_TH = src_TH if _rowwise(src_TH) else src_TH.contiguous()
    y_MH = y_MH if y_MH is None or _rowwise(y_MH) else y_MH.contiguous()
    return _ops(src_TH, impl).gather_scale(src_TH, idx_M, w_M, y_MH)


def swiglu_forward(h_MF2: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """silu(gate) * up without autograd."""
    h_MF2 = h_MF2 if _rowwise(h_MF2) else h_MF2.contiguous()
    return _ops(h_MF2, impl).swiglu(h_MF2)


def swiglu_backward(h_MF2, ga_MF, out=None, with_dot: bool = False, impl: str = "auto"):
    """(d h, a, dot) for a = silu(gate) * up given d a; written into `out` = (d h, a) when given;
    dot[m] = <d a[m], a[m]> in fp32 when `with_dot` (else None)."""
    h_MF2 = h_MF2 if _rowwise(h_MF2) else h_MF2.contiguous()
    ga_MF = ga_MF if _rowwise(ga_MF) else ga_MF.contiguous()
    ops = _ops(h_MF2, impl)
    if out is not None and not _rowwise(*out):
        ops = TorchRows
    return ops.swiglu_backward(h_MF2, ga_MF, out, with_dot)


class SwiGLU(torch.autograd.Function):
    """a = silu(gate) * up keeping only h for the backward (autograd over the eager ops keeps
    silu(gate) and up's views as well: an extra M x F at 64K tokens x top-8 is 0.5 GiB in bf16)."""

    @staticmethod
    def forward(ctx, h_MF2, impl):
        ctx.save_for_backward(h_MF2)
        ctx.impl = impl
        return swiglu_forward(h_MF2, impl)

    @staticmethod
    def backward(ctx, ga_MF):
        (h,) = ctx.saved_tensors
        gh, _, _ = swiglu_backward(h, ga_MF.contiguous(), impl=ctx.impl)
        return gh, None


class Combine(torch.autograd.Function):
    """y[t] = sum_k w[t, k] * rows[inv[t*K + k]] for rows in sorted order (row i holds
    assignment order[i]; inv its inverse). The backward gathers each row's token gradient scaled
    by its weight (rows for the experts) and, in the same pass, the weight's gradient
    <g[t], rows[i]>: no A x H copies beyond the gradient itself, no atomics."""

    @staticmethod
    def forward(ctx, rows_AH, w_A, order_A, inv_A, top_k, impl):
        ctx.save_for_backward(rows_AH, w_A, order_A)
        ctx.top_k, ctx.impl = top_k, impl
        return gather_sum(rows_AH, inv_A, w_A, top_k, impl=impl)

    @staticmethod
    def backward(ctx, g_TH):
        rows, w_A, order_A = ctx.saved_tensors
        need_w = ctx.needs_input_grad[1]
        d_rows, dot = gather_scale(g_TH.contiguous(), order_A // ctx.top_k, w_A[order_A],
                                   rows if need_w else None, impl=ctx.impl)
        g_w = None
        if need_w:
            g_w = torch.empty_like(w_A)
            g_w[order_A] = dot.to(w_A.dtype)
        return d_rows, g_w, None, None, None, None


class DispatchRows(torch.autograd.Function):
    """Row i = x[token of assignment order[i]]. The backward sums each token's K gradient rows
    through the inverse order (gather_sum), not by the scatter-add autograd would use for an
    index with repeats (atomics, nondeterministic)."""

    @staticmethod
    def forward(ctx, x_TH, order_A, inv_A, top_k, impl):
        ctx.save_for_backward(inv_A)
        ctx.top_k, ctx.impl = top_k, impl
        return x_TH[order_A // top_k]

    @staticmethod
    def backward(ctx, g_AH):
        (inv_A,) = ctx.saved_tensors
        return gather_sum(g_AH.contiguous(), inv_A, None, ctx.top_k, impl=ctx.impl), \
            None, None, None, None
