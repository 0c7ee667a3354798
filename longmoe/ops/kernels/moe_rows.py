"""Triton row kernels of the MoE layer's memory-bound work: the combine, the dispatch gradient and
SwiGLU, each one pass where eager PyTorch makes two to five. Vendor-neutral; tiles come from the
backend's kernel table ("moe_rows").

Legend: T tokens, K top-k, A = T*K assignments (rows), H hidden, M rows, F expert FFN.
All arithmetic in fp32; results rounded once to the output's dtype.

  gather_sum     out[t] (+)= sum_k w[t*K + k] * src[idx[t*K + k]]    programs over (t, H block)
                 (the combine; unweighted, the dispatch's gradient)
  gather_sum_parts  the same over rows left in up to four buffers, read in place (one rank's
                 chunks)
  gather_scale   out[i] = w[i] * src[idx[i]], and dot[i] = <src[idx[i]], y[i]>   a program per row
                 (the combine's gradient: rows for the experts and the router weights' gradient)
  swiglu         a = silu(gate) * up over h = [gate | up]                programs over (M, F) tiles
  swiglu_bwd     d gate, d up and a from h and d a, and dot[m] = <d a[m], a[m]> (the router
                 weight's gradient on the expert side)            programs over M tiles, F looped
"""

from __future__ import annotations

import triton
import triton.language as tl

from longmoe.backends import active_backend


@triton.jit
def gather_sum_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, H, stride_src, stride_out,
                      K: tl.constexpr, BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr,
                      ACCUMULATE: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k in tl.static_range(K):
        r = tl.load(idx_ptr + t * K + k).to(tl.int64)
        v = tl.load(src_ptr + r * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += v
    out = out_ptr + t.to(tl.int64) * stride_out + cols
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Row buffers one gather_sum_parts launch reads (more fall back to one buffer: a copy).
MAX_PARTS = 4


@triton.jit(do_not_specialize=["s1", "s2", "s3"])
def gather_sum_parts_kernel(p0, p1, p2, p3, s1, s2, s3, idx_ptr, w_ptr, out_ptr, H, stride_src,
                            stride_out, K: tl.constexpr, BLOCK_H: tl.constexpr,
                            WEIGHTED: tl.constexpr, ACCUMULATE: tl.constexpr):
    """gather_sum over rows that sit in up to four buffers, row r of the whole in buffer p_i
    (row r - s_i) for s_i <= r < s_{i+1} (s_0 = 0; unused buffers get s_i past every row)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for k in tl.static_range(K):
        r = tl.load(idx_ptr + t * K + k).to(tl.int64)
        src = p0 + r * stride_src
        src = tl.where(r >= s1, p1 + (r - s1) * stride_src, src)
        src = tl.where(r >= s2, p2 + (r - s2) * stride_src, src)
        src = tl.where(r >= s3, p3 + (r - s3) * stride_src, src)
        v = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            v = v * tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += v
    out = out_ptr + t.to(tl.int64) * stride_out + cols
    if ACCUMULATE:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gather_scale_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, y_ptr, dot_ptr, H, stride_src,
                        stride_out, stride_y, BLOCK_H: tl.constexpr, WITH_DOT: tl.constexpr):
    i = tl.program_id(0)
    r = tl.load(idx_ptr + i).to(tl.int64)
    w = tl.load(w_ptr + i).to(tl.float32)
    i64 = i.to(tl.int64)
    dot = tl.zeros((BLOCK_H,), tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        g = tl.load(src_ptr + r * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + i64 * stride_out + cols, (w * g).to(out_ptr.dtype.element_ty),
                 mask=mask)
        if WITH_DOT:
            y = tl.load(y_ptr + i64 * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
            dot += g * y
    if WITH_DOT:
        tl.store(dot_ptr + i, tl.sum(dot, 0))


@triton.jit
def swiglu_kernel(h_ptr, a_ptr, M, F, stride_h, stride_a,
                  BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    h = h_ptr + rows.to(tl.int64)[:, None] * stride_h + cols[None, :]
    g = tl.load(h, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h + F, mask=mask, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :],
             a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(h_ptr, ga_ptr, gh_ptr, a_ptr, dot_ptr, M, F, stride_h, stride_ga,
                      stride_gh, stride_a, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                      WITH_DOT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    r64 = rows.to(tl.int64)[:, None]
    dot = tl.zeros((BLOCK_M,), tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = rmask[:, None] & (cols < F)[None, :]
        h = h_ptr + r64 * stride_h + cols[None, :]
        g = tl.load(h, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h + F, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(ga_ptr + r64 * stride_ga + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        silu = g * s
        a = (silu * u).to(a_ptr.dtype.element_ty)
        tl.store(a_ptr + r64 * stride_a + cols[None, :], a, mask=mask)
        gh = gh_ptr + r64 * stride_gh + cols[None, :]
        tl.store(gh, (d * u * s * (1.0 + g * (1.0 - s))).to(gh_ptr.dtype.element_ty), mask=mask)
        tl.store(gh + F, (d * silu).to(gh_ptr.dtype.element_ty), mask=mask)
        if WITH_DOT:  # against a as stored: the rows that the weight gradient reads
            dot += tl.sum(d * a.to(tl.float32), 1)
    if WITH_DOT:
        tl.store(dot_ptr + rows, dot, mask=rmask)


def launch_gather_sum(src, idx, w, out, K: int, accumulate: bool, cfg: dict):
    T, H = out.shape
    if T == 0:
        return out
    block = min(cfg["BLOCK_H"], triton.next_power_of_2(H))
    gather_sum_kernel[(T, triton.cdiv(H, block))](
        src, idx, w if w is not None else idx, out, H, src.stride(0), out.stride(0), K=K,
        BLOCK_H=block, WEIGHTED=w is not None, ACCUMULATE=accumulate,
        **active_backend().launch_options(cfg, "num_warps"))
    return out


def launch_gather_sum_parts(parts, idx, w, out, K: int, accumulate: bool, cfg: dict):
    """`parts`: at most MAX_PARTS row buffers of one dtype and width, unit column stride, one row
    stride, read as their concatenation."""
    T, H = out.shape
    if T == 0:
        return out
    live = [p for p in parts if p.shape[0]] or parts[:1]
    ptrs, starts, n = [], [], 0
    for p in parts:
        if p.shape[0]:
            ptrs.append(p)
            starts.append(n)
        n += p.shape[0]
    ptrs += [live[0]] * (MAX_PARTS - len(ptrs))
    starts += [2**31 - 1] * (MAX_PARTS - len(starts))
    block = min(cfg["BLOCK_H"], triton.next_power_of_2(H))
    gather_sum_parts_kernel[(T, triton.cdiv(H, block))](
        *ptrs, *starts[1:], idx, w if w is not None else idx, out, H, live[0].stride(0),
        out.stride(0), K=K, BLOCK_H=block, WEIGHTED=w is not None, ACCUMULATE=accumulate,
        **active_backend().launch_options(cfg, "num_warps"))
    return out


def launch_gather_scale(src, idx, w, out, y, dot, cfg: dict):
    M, H = out.shape
    if M == 0:
        return
    block = min(cfg["BLOCK_H_ROW"], triton.next_power_of_2(H))
    with_dot = y is not None
    gather_scale_kernel[(M,)](
        src, idx, w, out, y if with_dot else out, dot if with_dot else w, H, src.stride(0),
        out.stride(0), y.stride(0) if with_dot else 0, BLOCK_H=block, WITH_DOT=with_dot,
        **active_backend().launch_options(cfg, "num_warps_row"))


def launch_swiglu(h, a, cfg: dict):
    M, F = a.shape
    if M == 0:
        return
    bf = min(cfg["BLOCK_F"], triton.next_power_of_2(F))
    swiglu_kernel[(triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(F, bf))](
        h, a, M, F, h.stride(0), a.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_F=bf,
        **active_backend().launch_options(cfg, "num_warps_swiglu"))


def launch_swiglu_bwd(h, ga, gh, a, dot, cfg: dict):
    M, F = a.shape
    if M == 0:
        return
    bf = min(cfg["BLOCK_F"], triton.next_power_of_2(F))
    with_dot = dot is not None
    swiglu_bwd_kernel[(triton.cdiv(M, cfg["BLOCK_M"]),)](
        h, ga, gh, a, dot if with_dot else a, M, F, h.stride(0), ga.stride(0), gh.stride(0),
        a.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_F=bf, WITH_DOT=with_dot,
        **active_backend().launch_options(cfg, "num_warps_swiglu"))
