"""Portable Triton grouped GEMM: out[rows of group g] = x[rows of g] @ w[g], for the routed experts.

Legend: M rows (grouped contiguously by expert), K in features, N out features, G groups,
BM/BN/BK tile sizes (from the backend's "grouped_gemm" table, keyed by arch and shape bucket).

Forward and dX run one kernel over a host-built tile list (each tile: its group and first row), so
no program straddles two groups and empty groups cost nothing; dX is the same kernel with w's last
two strides swapped (w^T). dW[g] = x_g^T @ dy_g runs a second kernel, a program per (g, K tile,
N tile) looping over the group's rows. All accumulation is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longmoe.backends import active_backend


@triton.jit
def grouped_mm_kernel(x_ptr, w_ptr, out_ptr, tile_group_ptr, tile_row_ptr, group_end_ptr,
                      K, N, stride_xm, stride_wg, stride_wk, stride_wn, stride_om,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    g = tl.load(tile_group_ptr + t)
    row0 = tl.load(tile_row_ptr + t)
    end = tl.load(group_end_ptr + g)
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tl.max_contiguous(tl.multiple_of(tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N),
                                            BLOCK_N), BLOCK_N)
    ks = tl.max_contiguous(tl.arange(0, BLOCK_K), BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_g = w_ptr + g.to(tl.int64) * stride_wg
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
                    mask=(rows[:, None] < end) & ((k0 + ks)[None, :] < K), other=0.0)
        b = tl.load(w_g + (k0 + ks)[:, None] * stride_wk + cols[None, :] * stride_wn,
                    mask=((k0 + ks)[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < end) & (cols[None, :] < N))


@triton.jit
def grouped_mm_dw_kernel(x_ptr, dy_ptr, dw_ptr, group_start_ptr, group_end_ptr, K, N,
                         stride_xm, stride_dym, stride_dwg, stride_dwk,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    g = tl.program_id(0)
    kk = tl.max_contiguous(tl.multiple_of(tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K),
                                          BLOCK_K), BLOCK_K)
    cols = tl.max_contiguous(tl.multiple_of(tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N),
                                            BLOCK_N), BLOCK_N)
    start = tl.load(group_start_ptr + g)
    end = tl.load(group_end_ptr + g)
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + ms
        # x read row-major (its natural layout) and transposed in registers/shared memory for
        # the dot: loading x^T directly ran the H200 at 120-154 TFLOP/s.
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rows[:, None] < end) & (kk[None, :] < K), other=0.0)
        dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * stride_dym + cols[None, :],
                     mask=(rows[:, None] < end) & (cols[None, :] < N), other=0.0)
        acc += tl.dot(tl.trans(x), dy)
    tl.store(dw_ptr + g.to(tl.int64) * stride_dwg + kk[:, None] * stride_dwk + cols[None, :],
             acc.to(dw_ptr.dtype.element_ty), mask=(kk[:, None] < K) & (cols[None, :] < N))


def tile_schedule(sizes: list[int], block_m: int, device):
    """(tile_group, tile_row, group_start, group_end) as int32 tensors."""
    groups, rows, starts, ends, s = [], [], [], [], 0
    for g, n in enumerate(sizes):
        starts.append(s)
        ends.append(s + n)
        for r in range(s, s + n, block_m):
            groups.append(g)
            rows.append(r)
        s += n
    mk = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
    return mk(groups), mk(rows), mk(starts), mk(ends)


def _launch_mm(x_MK, w_GKN, stride_wk, stride_wn, N, sched, cfg):
    tile_group, tile_row, _, group_end = sched
    out = x_MK.new_empty(x_MK.shape[0], N)
    if tile_group.numel():
        grid = (tile_group.numel(), triton.cdiv(N, cfg["BLOCK_N"]))
        grouped_mm_kernel[grid](x_MK, w_GKN, out, tile_group, tile_row, group_end, x_MK.shape[1], N,
                                x_MK.stride(0), w_GKN.stride(0), stride_wk, stride_wn, out.stride(0),
                                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                                BLOCK_K=cfg["BLOCK_K"], **_opts(cfg))
    return out


def _opts(cfg: dict, num_warps_key: str = "num_warps") -> dict:
    return active_backend().launch_options(cfg, num_warps_key)


class GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GKN, sizes, cfg):
        x_MK, w_GKN = x_MK.contiguous(), w_GKN.contiguous()
        sched = tile_schedule(sizes, cfg["BLOCK_M"], x_MK.device)
        ctx.save_for_backward(x_MK, w_GKN, *sched)
        ctx.cfg = cfg
        return _launch_mm(x_MK, w_GKN, w_GKN.stride(1), w_GKN.stride(2), w_GKN.shape[2], sched, cfg)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GKN, *sched = ctx.saved_tensors
        cfg = ctx.cfg
        dy_MN = dy_MN.contiguous()
        G, K, N = w_GKN.shape
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX = dY @ w^T: swap w's K and N strides
            dx = _launch_mm(dy_MN, w_GKN, w_GKN.stride(2), w_GKN.stride(1), K, sched, cfg)
        if ctx.needs_input_grad[1]:
            dw = _launch_dw(x_MK, dy_MN, torch.empty_like(w_GKN), sched, cfg)
        return dx, dw, None, None


def dw_tiles(cfg: dict) -> dict:
    """The dW kernel's tiles: DW_BLOCK_{M,N,K} and num_warps_dw where the table sets them (its
    output tile is K x N and its loop runs over rows, so it wants other shapes than the forward),
    else the forward's."""
    out = {k: cfg.get(f"DW_{k}", cfg[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    return {**out, "num_warps": cfg.get("num_warps_dw", cfg["num_warps"])}


def _launch_dw(x_MK, dy_MN, dw_GKN, sched, cfg):
    G, K, N = dw_GKN.shape
    t = dw_tiles(cfg)
    grid = (G, triton.cdiv(K, t["BLOCK_K"]), triton.cdiv(N, t["BLOCK_N"]))
    grouped_mm_dw_kernel[grid](x_MK, dy_MN, dw_GKN, sched[2], sched[3], K, N, x_MK.stride(0),
                               dy_MN.stride(0), dw_GKN.stride(0), dw_GKN.stride(1),
                               BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
                               BLOCK_K=t["BLOCK_K"], **_opts(cfg, "num_warps_dw"))
    return dw_GKN


def grouped_dw(x_MK, dy_MN, sizes: list[int], cfg: dict, out_dtype=None):
    """dW[g] = x_g^T @ dy_g for every group (zeros where a group has no rows), without autograd."""
    x_MK, dy_MN = x_MK.contiguous(), dy_MN.contiguous()
    sched = tile_schedule(sizes, cfg["BLOCK_M"], x_MK.device)
    dw = x_MK.new_empty((len(sizes), x_MK.shape[1], dy_MN.shape[1]), dtype=out_dtype or x_MK.dtype)
    return _launch_dw(x_MK, dy_MN, dw, sched, cfg)
