"""Depthwise causal conv + SiLU, forward and backward, for the Gated DeltaNet layer: the Triton
form of `causal_conv_silu` (longmoe/model/deltanet.py, the reference). Vendor-neutral; tiles come
from the backend's kernel table ("causal_conv").

Legend: B rows, S tokens, C channels, K taps; xp = the K-1 halo tokens (zeros without a halo)
then x; v_b = w[:, K-1-b], the weight of the tap that reads b tokens back.

  forward:   a[u] = sum_b v_b * m_b[u] * xp[u-b]   (fp32, b = K-1 .. 0),  y = a * sigmoid(a)
  backward:  ds[u] = dy[u] * silu'(a[u]),  c_b[s] = m_b[s+b] * ds[s+b],
             dx[s] = sum_b v_b * c_b[s],  dw[:, K-1-b] = sum_s xp[s] * c_b[s],  dhalo = dx[s < 0]
m_b[u] = (history[u] >= b) with packed rows' `history`, else 1: no sample reads another's
inputs, the halo's included (the kernels read it as reach_bits, one int per token).

A program owns BLOCK_C channels of BLOCK_T consecutive tokens and walks them one token at a
time: each input row is loaded once and adds its terms to the pre-activations of the K tokens
it reaches (K-1 partial sums carried in registers, a token's terms in the reference's order);
the backward carries the last K ds as well and finishes row s = u-K+1 once ds[u] is known,
reading xp[s] again from cache. So x, dy, y and dx each cross memory once (a program also reads
the K-1 rows before its first), and nothing is shifted within a tile: Triton has no register
shift, and the tile forms tried for the backward were slow (shifting ds with tl.gather, through
shared memory, took 1.6-4 ms at 32K tokens x 8192 channels on an H200; recomputing ds for each
shift 3-9 ms). The loop's loads are software-pipelined (num_stages). Neither pass copies x:
tokens before 0 read the halo pointer (or zero) in the kernel, and x is read in place whatever
its token stride (the layer hands over column slices in context parallelism). The backward
recomputes a from x (saved: x, w, the halo, the reach bits); dw is summed per program in fp32
registers and the partial sums are reduced by one torch sum: deterministic, no atomics. Up to
8 taps: the carried rows are named slots, the ones from K on compiled away.

On one H200 (bf16, 32K tokens x 8192 channels, 4 taps; backends/cuda/kernels.json has the
tiles' numbers): forward 0.32 ms (0.43 with halo and history), backward 0.62 (0.92), autograd
forward+backward 0.93 (1.34), where inductor's compiled reference took 4.0 (4.5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from longmoe.backends import active_backend

TABLE_KEY = "causal_conv"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HISTORY_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
MAX_TAPS = 8


@triton.jit
def _row(x_ptr, h_ptr, b, u, S, C, cols, stride_xb, stride_xt, stride_hb, stride_ht,
         K: tl.constexpr, HAS_HALO: tl.constexpr):
    """xp at token u, one row of channels in fp32: x from token 0, the halo's K-1 tokens before
    it, zero before those and from S on. The token is int32 (the launcher checks S), the
    offsets int64: S * C passes 2^31 in long packed rows. Row conditions are folded into the
    channel bound, `cols < where(ok, C, 0)`, here and below: the interpreter turns a bool
    tensor & a bool scalar into integers, which a mask may not be."""
    at = x_ptr + (b * stride_xb + u.to(tl.int64) * stride_xt)
    ok = (u >= 0) & (u < S)
    if HAS_HALO:
        at = tl.where(u >= 0, at, h_ptr + (b * stride_hb + (u + K - 1).to(tl.int64) * stride_ht))
        ok = (u >= 1 - K) & (u < S)
    return tl.load(at + cols, mask=cols < tl.where(ok, C, 0), other=0.0).to(tl.float32)


@triton.jit
def _reach(reach_ptr, b, u, S, stride_rb, K: tl.constexpr, HAS_HISTORY: tl.constexpr):
    """The reach bits of input token u (see reach_bits), an int32; without history a
    placeholder never read."""
    r = u * 0
    if HAS_HISTORY:
        r = tl.load(reach_ptr + b * stride_rb + (u + K - 1), mask=(u >= 1 - K) & (u < S),
                    other=0)
    return r


@triton.jit
def _weight(w_ptr, cols, cmask, stride_wc, stride_wk, BACK: tl.constexpr, K: tl.constexpr):
    """v_BACK = w[:, K-1-BACK] in fp32; zeros for a slot past K (never read)."""
    v = tl.zeros_like(cols).to(tl.float32)
    if BACK < K:
        v = tl.load(w_ptr + cols * stride_wc + (K - 1 - BACK) * stride_wk, mask=cmask,
                    other=0.0).to(tl.float32)
    return v


@triton.jit
def _weights(w_ptr, cols, cmask, stride_wc, stride_wk, K: tl.constexpr):
    return (_weight(w_ptr, cols, cmask, stride_wc, stride_wk, 0, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 1, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 2, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 3, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 4, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 5, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 6, K),
            _weight(w_ptr, cols, cmask, stride_wc, stride_wk, 7, K))


@triton.jit
def _advance(x, q0, q1, q2, q3, q4, q5, q6, v0, v1, v2, v3, v4, v5, v6, v7, r,
             K: tl.constexpr, HAS_HISTORY: tl.constexpr):
    """x = xp[u] into the pre-activations: q_c holds the partial sum of token u+c (c < K-1);
    returns a[u] = q0 + v0 x and the partial sums of tokens u+1 .. u+K-1, each with x's term
    v_c * x added where bit c of u's reach bits `r` is set. A token's terms arrive oldest
    first, the eager reference's order (its tap j reads back K-1-j)."""
    z = x * 0.0
    a = q0 + x * v0
    q0 = (q1 if K > 2 else z) + (tl.where((r & 2) != 0, x, 0.0) if HAS_HISTORY else x) * v1
    if K > 2:
        q1 = (q2 if K > 3 else z) + (tl.where((r & 4) != 0, x, 0.0) if HAS_HISTORY else x) * v2
    if K > 3:
        q2 = (q3 if K > 4 else z) + (tl.where((r & 8) != 0, x, 0.0) if HAS_HISTORY else x) * v3
    if K > 4:
        q3 = (q4 if K > 5 else z) + (tl.where((r & 16) != 0, x, 0.0) if HAS_HISTORY else x) * v4
    if K > 5:
        q4 = (q5 if K > 6 else z) + (tl.where((r & 32) != 0, x, 0.0) if HAS_HISTORY else x) * v5
    if K > 6:
        q5 = (q6 if K > 7 else z) + (tl.where((r & 64) != 0, x, 0.0) if HAS_HISTORY else x) * v6
    if K > 7:
        q6 = z + (tl.where((r & 128) != 0, x, 0.0) if HAS_HISTORY else x) * v7
    return a, q0, q1, q2, q3, q4, q5, q6


@triton.jit
def _prologue(x_ptr, h_ptr, reach_ptr, b, u, S, C, cols, stride_xb, stride_xt, stride_hb,
              stride_ht, stride_rb, v0, v1, v2, v3, v4, v5, v6, v7,
              K: tl.constexpr, HAS_HALO: tl.constexpr, HAS_HISTORY: tl.constexpr):
    """The partial sums of tokens u .. u+K-2 from the K-1 inputs before u."""
    z = tl.zeros_like(v0)
    q0, q1, q2, q3, q4, q5, q6 = z, z, z, z, z, z, z
    for back in tl.static_range(K - 1, 0, -1):
        x = _row(x_ptr, h_ptr, b, u - back, S, C, cols, stride_xb, stride_xt, stride_hb,
                 stride_ht, K, HAS_HALO)
        r = _reach(reach_ptr, b, u - back, S, stride_rb, K, HAS_HISTORY)
        _, q0, q1, q2, q3, q4, q5, q6 = _advance(x, q0, q1, q2, q3, q4, q5, q6, v0, v1, v2, v3,
                                                 v4, v5, v6, v7, r, K, HAS_HISTORY)
    return q0, q1, q2, q3, q4, q5, q6


@triton.jit
def _store_parts(p0, p1, p2, row, v, cols, bound, C1, C2, C):
    """Row `row` of three contiguous outputs holding channels [0, C1), [C1, C2) and [C2, C);
    `bound` is C, or 0 for a row outside the sequence."""
    tl.store(p0 + (row * C1 + cols), v, mask=cols < tl.minimum(bound, C1))
    tl.store(p1 + (row * (C2 - C1) + (cols - C1)), v,
             mask=(cols >= C1) & (cols < tl.minimum(bound, C2)))
    tl.store(p2 + (row * (C - C2) + (cols - C2)), v, mask=(cols >= C2) & (cols < bound))


@triton.jit
def _load_parts(p0, p1, p2, row, cols, bound, C1, C2, C):
    """_store_parts' row read back in fp32 (the three masks are disjoint)."""
    v = tl.load(p0 + (row * C1 + cols), mask=cols < tl.minimum(bound, C1), other=0.0)
    v1 = tl.load(p1 + (row * (C2 - C1) + (cols - C1)),
                 mask=(cols >= C1) & (cols < tl.minimum(bound, C2)), other=0.0)
    v2 = tl.load(p2 + (row * (C - C2) + (cols - C2)), mask=(cols >= C2) & (cols < bound),
                 other=0.0)
    return v.to(tl.float32) + v1.to(tl.float32) + v2.to(tl.float32)


@triton.jit
def causal_conv_fwd_kernel(x_ptr, w_ptr, h_ptr, reach_ptr, y_ptr, y1_ptr, y2_ptr, S, C, C1, C2,
                           stride_xb, stride_xt, stride_wc, stride_wk, stride_hb, stride_ht,
                           stride_rb,
                           K: tl.constexpr, HAS_HALO: tl.constexpr, HAS_HISTORY: tl.constexpr,
                           SPLIT: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """y, or with SPLIT its channels [0, C1), [C1, C2), [C2, C) as three contiguous outputs
    (y_ptr, y1_ptr, y2_ptr): the layer's q, k and v, so that no consumer copies a column slice
    and the backward needs no concatenation of their gradients."""
    b = tl.program_id(2).to(tl.int64)
    t0 = tl.program_id(0) * BLOCK_T
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    v0, v1, v2, v3, v4, v5, v6, v7 = _weights(w_ptr, cols, cols < C, stride_wc, stride_wk, K)
    q0, q1, q2, q3, q4, q5, q6 = _prologue(x_ptr, h_ptr, reach_ptr, b, t0, S, C, cols,
                                           stride_xb, stride_xt, stride_hb, stride_ht,
                                           stride_rb, v0, v1, v2, v3, v4, v5, v6, v7,
                                           K, HAS_HALO, HAS_HISTORY)
    for i in tl.range(0, BLOCK_T, num_stages=STAGES):
        u = t0 + i
        x = _row(x_ptr, h_ptr, b, u, S, C, cols, stride_xb, stride_xt, stride_hb, stride_ht,
                 K, HAS_HALO)
        r = _reach(reach_ptr, b, u, S, stride_rb, K, HAS_HISTORY)
        a, q0, q1, q2, q3, q4, q5, q6 = _advance(x, q0, q1, q2, q3, q4, q5, q6, v0, v1, v2, v3,
                                                 v4, v5, v6, v7, r, K, HAS_HISTORY)
        y = (a * tl.sigmoid(a)).to(y_ptr.dtype.element_ty)
        if SPLIT:
            _store_parts(y_ptr, y1_ptr, y2_ptr, b * S + u, y, cols, tl.where(u < S, C, 0),
                         C1, C2, C)
        else:
            tl.store(y_ptr + ((b * S + u) * C + cols), y, mask=cols < tl.where(u < S, C, 0))


@triton.jit
def _finish(xs, ds, n0, n1, n2, n3, n4, n5, n6, v0, v1, v2, v3, v4, v5, v6, v7,
            d0, d1, d2, d3, d4, d5, d6, d7, r, K: tl.constexpr, HAS_HISTORY: tl.constexpr):
    """Row s = u-K+1 complete, xs its input, r its reach bits. Slot n_b holds ds[s+b] for
    b < K-1, `ds` is ds[u] = ds[s+K-1]. Its terms c_b = ds[s+b] where bit b of r is set give
    dx[s] = sum_b v_b c_b and add xs * c_b to the dw sums; the slots move one token on."""
    c1 = n1 if K > 2 else ds
    c2 = n2 if K > 3 else ds
    c3 = n3 if K > 4 else ds
    c4 = n4 if K > 5 else ds
    c5 = n5 if K > 6 else ds
    c6 = n6 if K > 7 else ds
    c7 = ds
    if HAS_HISTORY:
        c1 = tl.where((r & 2) != 0, c1, 0.0)
        if K > 2:
            c2 = tl.where((r & 4) != 0, c2, 0.0)
        if K > 3:
            c3 = tl.where((r & 8) != 0, c3, 0.0)
        if K > 4:
            c4 = tl.where((r & 16) != 0, c4, 0.0)
        if K > 5:
            c5 = tl.where((r & 32) != 0, c5, 0.0)
        if K > 6:
            c6 = tl.where((r & 64) != 0, c6, 0.0)
        if K > 7:
            c7 = tl.where((r & 128) != 0, c7, 0.0)
    dx = n0 * v0 + c1 * v1
    d0 += xs * n0
    d1 += xs * c1
    if K > 2:
        dx += c2 * v2
        d2 += xs * c2
    if K > 3:
        dx += c3 * v3
        d3 += xs * c3
    if K > 4:
        dx += c4 * v4
        d4 += xs * c4
    if K > 5:
        dx += c5 * v5
        d5 += xs * c5
    if K > 6:
        dx += c6 * v6
        d6 += xs * c6
    if K > 7:
        dx += c7 * v7
        d7 += xs * c7
    # One token on: slot b takes ds[s+1+b], unmasked. The "+ 0.0" (exact, and not folded:
    # it turns -0.0 into +0.0) keeps each step from being a plain copy: Triton 3.9 leaves a
    # loop's loads out of the software pipelining when a value made from them is passed on
    # through two or more loop-carried copies.
    n0 = (n1 if K > 2 else ds) + 0.0
    if K > 2:
        n1 = (n2 if K > 3 else ds) + 0.0
    if K > 3:
        n2 = (n3 if K > 4 else ds) + 0.0
    if K > 4:
        n3 = (n4 if K > 5 else ds) + 0.0
    if K > 5:
        n4 = (n5 if K > 6 else ds) + 0.0
    if K > 6:
        n5 = (n6 if K > 7 else ds) + 0.0
    if K > 7:
        n6 = ds + 0.0
    return dx, d0, d1, d2, d3, d4, d5, d6, d7, n0, n1, n2, n3, n4, n5, n6


@triton.jit
def causal_conv_bwd_kernel(x_ptr, w_ptr, h_ptr, reach_ptr, dy_ptr, dy1_ptr, dy2_ptr, dx_ptr,
                           dh_ptr, dw_ptr, S, C, C1, C2, n_t, stride_xb, stride_xt, stride_wc,
                           stride_wk, stride_hb, stride_ht, stride_rb, stride_dyb, stride_dyt,
                           K: tl.constexpr, HAS_HALO: tl.constexpr, HAS_HISTORY: tl.constexpr,
                           SPLIT: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, STAGES: tl.constexpr):
    """One program: dx of the xp positions s0 .. s0+BLOCK_T-1 (dhalo for those before 0;
    s0 = program * BLOCK_T, less K-1 with a halo) and the dw sums of the pairs (xp[s], ds[s+b])
    over those s (dw_ptr[b * n_t + program, K-1-b, c]). Walks u = s0 .. s0+BLOCK_T+K-2: a[u]
    and ds[u] as the forward makes a, then row s = u-K+1, whose K ds are known by then. Its
    input is read again there, from cache: carried K-1 steps in registers instead, the loads
    were left out of the software pipelining."""
    pid_t = tl.program_id(0)
    b = tl.program_id(2).to(tl.int64)
    s0 = pid_t * BLOCK_T
    if HAS_HALO:
        s0 -= K - 1
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    v0, v1, v2, v3, v4, v5, v6, v7 = _weights(w_ptr, cols, cols < C, stride_wc, stride_wk, K)
    q0, q1, q2, q3, q4, q5, q6 = _prologue(x_ptr, h_ptr, reach_ptr, b, s0, S, C, cols,
                                           stride_xb, stride_xt, stride_hb, stride_ht,
                                           stride_rb, v0, v1, v2, v3, v4, v5, v6, v7,
                                           K, HAS_HALO, HAS_HISTORY)
    z = tl.zeros_like(v0)
    n0, n1, n2, n3, n4, n5, n6 = z, z, z, z, z, z, z
    d0, d1, d2, d3, d4, d5, d6, d7 = z, z, z, z, z, z, z, z
    for i in tl.range(0, BLOCK_T + K - 1, num_stages=STAGES):
        u = s0 + i
        x = _row(x_ptr, h_ptr, b, u, S, C, cols, stride_xb, stride_xt, stride_hb, stride_ht,
                 K, HAS_HALO)
        r = _reach(reach_ptr, b, u, S, stride_rb, K, HAS_HISTORY)
        a, q0, q1, q2, q3, q4, q5, q6 = _advance(x, q0, q1, q2, q3, q4, q5, q6, v0, v1, v2, v3,
                                                 v4, v5, v6, v7, r, K, HAS_HISTORY)
        if SPLIT:  # dy in three contiguous parts, as the forward wrote y
            dy = _load_parts(dy_ptr, dy1_ptr, dy2_ptr, b * S + u, cols,
                             tl.where((u >= 0) & (u < S), C, 0), C1, C2, C)
        else:
            dy = tl.load(dy_ptr + (b * stride_dyb + u.to(tl.int64) * stride_dyt) + cols,
                         mask=cols < tl.where((u >= 0) & (u < S), C, 0),
                         other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        ds = dy * sig * (1.0 + a * (1.0 - sig))  # zero outside [0, S): dy is
        s = u - (K - 1)
        mine = i >= K - 1  # rows before s0 are the previous program's
        xs = _row(x_ptr, h_ptr, b, s, S, tl.where(mine, C, 0), cols, stride_xb, stride_xt,
                  stride_hb, stride_ht, K, HAS_HALO)
        rs = _reach(reach_ptr, b, s, S, stride_rb, K, HAS_HISTORY)
        dx, d0, d1, d2, d3, d4, d5, d6, d7, n0, n1, n2, n3, n4, n5, n6 = _finish(
            xs, ds, n0, n1, n2, n3, n4, n5, n6, v0, v1, v2, v3, v4, v5, v6, v7,
            d0, d1, d2, d3, d4, d5, d6, d7, rs, K, HAS_HISTORY)
        if HAS_HALO:  # rows before token 0 are the halo's
            tl.store(dh_ptr + ((b * (K - 1) + s + K - 1) * C + cols),
                     dx.to(dh_ptr.dtype.element_ty), mask=cols < tl.where(mine & (s < 0), C, 0))
        tl.store(dx_ptr + ((b * S + s) * C + cols), dx.to(dx_ptr.dtype.element_ty),
                 mask=cols < tl.where(mine & (s >= 0) & (s < S), C, 0))
    part = dw_ptr + ((b * n_t + pid_t) * K + K - 1) * C + cols  # dw[:, K-1-back] at -back * C
    cmask = cols < C
    tl.store(part, d0, mask=cmask)
    tl.store(part - C, d1, mask=cmask)
    if K > 2:
        tl.store(part - 2 * C, d2, mask=cmask)
    if K > 3:
        tl.store(part - 3 * C, d3, mask=cmask)
    if K > 4:
        tl.store(part - 4 * C, d4, mask=cmask)
    if K > 5:
        tl.store(part - 5 * C, d5, mask=cmask)
    if K > 6:
        tl.store(part - 6 * C, d6, mask=cmask)
    if K > 7:
        tl.store(part - 7 * C, d7, mask=cmask)


def _unit_channel(t):
    """t as it is where channels are adjacent (any token stride), else a contiguous copy."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _strides(t):
    return (0, 0) if t is None else (t.stride(0), t.stride(1))


def _launch(kernel, grid, cfg, warps_key, *args, **consts):
    kernel[grid](*args, **consts, **active_backend().launch_options(cfg, warps_key))


def reach_bits(history_BS: torch.Tensor, K: int) -> torch.Tensor:
    """[B, S+K-1] int32 over xp (the K-1 positions before token 0, then the tokens): bit c of
    position p (token u = p-K+1) is set where token u+c lies in [0, S) and its sample began at
    least c tokens before it (history >= c), i.e. where tap c carries input u forward. The
    kernels read one of these a step instead of K-1 histories (each is a load inside the
    token loop). A few elementwise launches on [B, S] integers, once per forward."""
    B, S = history_BS.shape
    h = F.pad(history_BS.to(torch.int32), (K - 1, K - 1), value=-1)
    ahead = h.unfold(1, K, 1)[..., 1:]                     # [B, S+K-1, K-1]: history at u+c
    c = torch.arange(1, K, device=h.device, dtype=torch.int32)
    return torch.where(ahead >= c, 1 << c, 0).sum(-1, dtype=torch.int32)


class CausalConvSiLU(torch.autograd.Function):
    """Saves x, w and the halo as they came (x a view where it was one: the layer holds the
    projection's output anyway) and the history's reach bits. `bounds` (C1, C2): y as three
    contiguous outputs, channels [0, C1), [C1, C2), [C2, C); None: one."""

    @staticmethod
    def forward(ctx, x, w, halo, history, bounds=None):
        B, S, C = x.shape
        K = w.shape[1]
        C1, C2 = bounds or (C, C)
        ys = [torch.empty((B, S, n), device=x.device, dtype=x.dtype)
              for n in ((C1, C2 - C1, C - C2) if bounds else (C,))]
        reach = None if history is None else reach_bits(history, K)
        if B * S * C:
            cfg = active_backend().kernel_config(TABLE_KEY)
            BT, BC = cfg["BLOCK_T"], cfg["BLOCK_C"]
            grid = (triton.cdiv(S, BT), triton.cdiv(C, BC), B)
            y0, y1, y2 = (ys * 3)[:3]
            _launch(causal_conv_fwd_kernel, grid, cfg, "num_warps", x, w, _ptr(halo, x),
                    _ptr(reach, x), y0, y1, y2, S, C, C1, C2, *_strides(x), *w.stride(),
                    *_strides(halo), 0 if reach is None else reach.stride(0), K=K,
                    HAS_HALO=halo is not None, HAS_HISTORY=reach is not None,
                    SPLIT=bounds is not None, BLOCK_T=BT, BLOCK_C=BC,
                    STAGES=cfg.get("num_stages", 1))
        ctx.save_for_backward(x, w, halo, reach)
        ctx.bounds = bounds
        return tuple(ys) if bounds else ys[0]

    @staticmethod
    def backward(ctx, *dys):
        x, w, halo, reach = ctx.saved_tensors
        B, S, C = x.shape
        K = w.shape[1]
        C1, C2 = ctx.bounds or (C, C)
        if ctx.bounds:  # the parts' gradients, contiguous as the forward wrote them
            dys = [g.contiguous() for g in dys]
            dy, dy1, dy2 = dys
        else:
            dy = _unit_channel(dys[0])
            dy1 = dy2 = dy
        dx = torch.empty((B, S, C), device=x.device, dtype=x.dtype)
        dh = None if halo is None else torch.empty((B, K - 1, C), device=x.device,
                                                   dtype=halo.dtype)
        if not B * C:
            return dx, torch.zeros_like(w), dh, None, None
        cfg = active_backend().kernel_config(TABLE_KEY)
        BT, BC = cfg["BLOCK_T_BWD"], cfg["BLOCK_C_BWD"]
        lead = K - 1 if halo is not None else 0  # xp positions before token 0 get a gradient
        n_t = triton.cdiv(S + lead, BT)
        part = torch.empty((B * n_t, K, C), device=x.device, dtype=torch.float32)
        if n_t:
            _launch(causal_conv_bwd_kernel, (n_t, triton.cdiv(C, BC), B), cfg, "num_warps_bwd",
                    x, w, _ptr(halo, x), _ptr(reach, x), dy, dy1, dy2, dx, _ptr(dh, x), part,
                    S, C, C1, C2, n_t, *_strides(x), *w.stride(), *_strides(halo),
                    0 if reach is None else reach.stride(0), *_strides(dy), K=K,
                    HAS_HALO=halo is not None, HAS_HISTORY=reach is not None,
                    SPLIT=ctx.bounds is not None, BLOCK_T=BT, BLOCK_C=BC,
                    STAGES=cfg.get("num_stages_bwd", cfg.get("num_stages", 1)))
        dw = part.sum(0).t().to(w.dtype)
        return dx, dw, dh, None, None


def _ptr(t, like):
    """A pointer for an absent optional tensor (the kernel never reads it)."""
    return like if t is None else t


def causal_conv_silu_triton(x_BSC: torch.Tensor, w_CK: torch.Tensor,
                            halo_BKC: torch.Tensor | None = None,
                            history_BS: torch.Tensor | None = None,
                            split: tuple[int, int, int] | None = None):
    """SiLU(depthwise causal conv) of x [B, S, C] with w [C, K], the halo [B, K-1, C] (the K-1
    inputs before x; zeros without) and `history` [B, S] (integers, packed rows: tokens since
    each token's sample began; a tap reaching further back reads zero): `causal_conv_silu` of
    deltanet.py, summed in fp32, y in x's dtype; dw in w's, dhalo in the halo's. `split`
    (three channel counts summing to C): y's column blocks as three contiguous tensors
    [B, S, n] instead of one, for the layer's q, k and v."""
    if x_BSC.dim() != 3 or w_CK.dim() != 2 or w_CK.shape[0] != x_BSC.shape[2]:
        raise ValueError(f"causal_conv: x [B, S, C] and w [C, K], got {tuple(x_BSC.shape)} and "
                         f"{tuple(w_CK.shape)}")
    B, S, C = x_BSC.shape
    K = w_CK.shape[1]
    if not 2 <= K <= MAX_TAPS:
        raise ValueError(f"causal_conv: {K} taps; the kernels take 2 to {MAX_TAPS}")
    if halo_BKC is not None and tuple(halo_BKC.shape) != (B, K - 1, C):
        raise ValueError(f"causal_conv: halo {tuple(halo_BKC.shape)}, expected {(B, K - 1, C)}")
    if history_BS is not None and (tuple(history_BS.shape) != (B, S)
                                   or history_BS.dtype not in HISTORY_DTYPES):
        raise ValueError(f"causal_conv: history must be integers of shape {(B, S)}, got "
                         f"{history_BS.dtype} {tuple(history_BS.shape)}")
    for name, t in (("x", x_BSC), ("w", w_CK), ("halo", halo_BKC)):
        if t is not None and t.dtype not in DTYPES:
            raise ValueError(f"causal_conv: takes fp32, bf16 or fp16, got {name} {t.dtype}")
    if S >= 2**30:  # the kernels' int32 token index, a tile or two past S included
        raise ValueError(f"causal_conv: {S} tokens, more than int32 token indices hold")
    bounds = None
    if split is not None:
        if len(split) != 3 or min(split) < 0 or sum(split) != C:
            raise ValueError(f"causal_conv: split {tuple(split)} must be three channel counts "
                             f"summing to {C}")
        bounds = (split[0], split[0] + split[1])
    return CausalConvSiLU.apply(_unit_channel(x_BSC), w_CK, _unit_channel(halo_BKC), history_BS,
                                bounds)
