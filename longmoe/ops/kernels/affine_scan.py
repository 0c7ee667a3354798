"""Triton kernel of the Gated DeltaNet core's state recurrence (longmoe/ops/gated_delta.py,
AffineScan): the whole scan of n steps in one launch instead of n GEMM launches.

Legend: n steps (chunks), B batch of independent scans (batch x value heads), D state rows (dk, a
power of two >= 16: a compile-time size, so no row masks), V state columns (dv). All fp32,
contiguous.

  forward   out[c + 1] = M[c] @ out[c] + add[c]           c = 0 .. n-1   (out[0] preset)
  adjoint   out[c]     = M[c]^T @ out[c + 1] + add[c]     c = n-1 .. 0   (out[n] preset)

One program per (scan, block of BLOCK_V columns): columns evolve independently, so a program owns
its columns for all n steps. Each step reads the previous state back from `out` (just written by
this program, so a barrier orders it) in BLOCK_K-row slices against the matching columns of M:
the state never has to fit in registers or shared memory whole, so the kernel stays inside the
smallest shared-memory budget of the compile targets (64 KiB). Tiles come from the backend's
table ("affine_scan").
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def affine_scan_kernel(m_ptr, add_ptr, out_ptr, n_steps, B, V,
                       D: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                       ADJOINT: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, D)
    ks = tl.arange(0, BLOCK_K)
    col_ok = cols < V
    tile = col_ok[None, :]
    state_step = B.to(tl.int64) * D * V   # elements between out[c] and out[c + 1]
    m_step = B.to(tl.int64) * D * D
    # Pointers walk one step per iteration: forward c = 0, 1, ..; adjoint c = n-1, n-2, ..
    if ADJOINT:
        c0 = n_steps - 1
        state_step = -state_step
        m_step = -m_step
    else:
        c0 = 0
    m_cur = m_ptr + b * D * D + c0 * tl.abs(m_step)
    add_cur = add_ptr + b * D * V + c0 * tl.abs(state_step)
    if ADJOINT:
        src_cur = out_ptr + b * D * V + (c0 + 1) * tl.abs(state_step)
    else:
        src_cur = out_ptr + b * D * V
    tile_offs = rows[:, None] * V + cols[None, :]
    for _ in range(n_steps):
        dst_cur = src_cur + state_step
        acc = tl.load(add_cur + tile_offs, mask=tile, other=0.0)
        for k0 in range(0, D, BLOCK_K):
            kk = k0 + ks
            if ADJOINT:   # M^T[r, k] = M[k, r]
                m = tl.load(m_cur + kk[None, :] * D + rows[:, None])
            else:
                m = tl.load(m_cur + rows[:, None] * D + kk[None, :])
            s = tl.load(src_cur + kk[:, None] * V + cols[None, :], mask=tile, other=0.0)
            acc += tl.dot(m, s, input_precision=PRECISION)
        tl.store(dst_cur + tile_offs, acc, mask=tile)
        tl.debug_barrier()   # the next step reads this state back from out
        src_cur = dst_cur
        m_cur += m_step
        add_cur += state_step


def affine_scan(trans, add, out, adjoint: bool, cfg: dict, precision: str):
    """Run the scan in place on `out` ([n + 1, B, D, V], out[0] or out[n] preset) with
    trans [n, B, D, D] and add [>= n, B, D, V]; all fp32 and contiguous."""
    n, B, D, _ = trans.shape
    V = out.shape[-1]
    block_v = min(cfg["BLOCK_V"], max(16, triton.next_power_of_2(V)))
    grid = (B, triton.cdiv(V, block_v))
    affine_scan_kernel[grid](trans, add, out, n, B, V, D=D, BLOCK_K=min(cfg["BLOCK_K"], D),
                             BLOCK_V=block_v, ADJOINT=adjoint, PRECISION=precision,
                             num_warps=cfg["num_warps"],
                             **({"num_stages": cfg["num_stages"]} if "num_stages" in cfg else {}))
    return out
