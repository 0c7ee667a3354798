"""Triton kernels of the chunked gated delta rule, forward (longmoe/ops/gated_delta.py has the
definition; gated_delta_chunk.py launches these and holds the backward's autograd seam).

Legend: B batch, T tokens, Hk/Hv key/value heads (a key head serves Hv/Hk value heads), C chunk
length, n = ceil(T / C) chunks, DK/DV head dims (powers of two >= 16: compile-time sizes, so no
feature masks), BV a block of value columns. Token tensors are [B, T, H, D] contiguous; chunk
states [B, n, Hv, DK, DV].

Per chunk and value head, with gamma the cumulative log decay from the chunk start (fp32; only
exponentials of differences <= 0 are formed, so g ~ -20 per token never overflows):
  A = strict-lower beta_i e^(gamma_i - gamma_j) k_i.k_j,   Tinv = (I + A)^-1
  w = Tinv (beta e^gamma k),  u = Tinv (beta v)                      (gdn_prep_kernel)
  v_new = u - w S_c,  S_{c+1} = e^gamma_last S_c + (k e^(gamma_last - gamma))^T v_new
                                                                    (gdn_states_kernel)
  o = (q e^gamma) S_c + (q k^T * e^(gamma_i - gamma_j) * causal) v_new   (gdn_output_kernel)
Sample starts cut a chunk into segments: pairs across segments drop out of every decay matrix,
only the first segment sees S_c (`first`), only the last one writes S_{c+1} (`last`), and a chunk
holding a start carries nothing of S_c across (`carry`), so the chunk grid stays fixed.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_rows(c, T, C: tl.constexpr):
    t = c * C + tl.arange(0, C)
    return t, t < T


@triton.jit
def _segments(starts_ptr, b, t, ok, T, HAS_STARTS: tl.constexpr):
    """(seg, first, last, carry): the segment of each token inside its chunk, whether it reads
    the chunk's start state, whether its write reaches the chunk's end state, and whether the
    start state survives the chunk at all."""
    if HAS_STARTS:
        st = tl.load(starts_ptr + b * T + t, mask=ok, other=0).to(tl.int32)
        seg = tl.cumsum(st, 0)
    else:
        seg = (t * 0).to(tl.int32)
    top = tl.max(seg, 0)
    return seg, seg == 0, seg == top, top == 0


@triton.jit
def _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C: tl.constexpr):
    """gamma of the chunk's tokens and of its last real token; padded rows take the last one,
    so every causal difference stays <= 0."""
    last_t = tl.minimum(c * C + C - 1, T - 1)
    g_last = tl.load(gam_ptr + (b * T + last_t) * Hv + h)
    gam = tl.load(gam_ptr + (b * T + t) * Hv + h, mask=ok, other=0.0)
    return tl.where(ok, gam, g_last), g_last


@triton.jit
def _load_rows(ptr, b, t, ok, T, H, h, D: tl.constexpr, col0, W: tl.constexpr):
    """[C, W] block of a [B, T, H, D] tensor: columns col0..col0+W of head h."""
    cols = col0 + tl.arange(0, W)
    offs = ((b * T + t) * H + h).to(tl.int64)[:, None] * D + cols[None, :]
    return tl.load(ptr + offs, mask=ok[:, None], other=0.0)


@triton.jit
def _store_rows(ptr, val, b, t, ok, T, H, h, D: tl.constexpr, col0, W: tl.constexpr):
    cols = col0 + tl.arange(0, W)
    offs = ((b * T + t) * H + h).to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(ptr + offs, val.to(ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _state_offs(b, c, n, h, Hv, DK: tl.constexpr, DV: tl.constexpr, col0, BV: tl.constexpr):
    base = ((b * n + c) * Hv + h).to(tl.int64) * DK * DV
    return base + tl.arange(0, DK)[:, None] * DV + col0 + tl.arange(0, BV)[None, :]


@triton.jit
def _decay(gam, seg, C: tl.constexpr, STRICT: tl.constexpr):
    """e^(gamma_i - gamma_j) for j < i (STRICT) or j <= i within one segment, else 0."""
    rows = tl.arange(0, C)
    if STRICT:
        m = rows[:, None] > rows[None, :]
    else:
        m = rows[:, None] >= rows[None, :]
    m = m & (seg[:, None] == seg[None, :])
    return tl.exp(tl.where(m, gam[:, None] - gam[None, :], float("-inf")))


@triton.jit
def _unit_lower_inverse(A, C: tl.constexpr):
    """(I + A)^-1 of a strictly lower-triangular A by forward substitution in fp32:
    row i = e_i - sum_{j<i} A_ij row j (rows above i are final when row i is formed)."""
    rows = tl.arange(0, C)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    inv = eye
    for i in range(1, C):
        pick = rows[:, None] == i
        a_i = tl.sum(tl.where(pick, A, 0.0), 0)              # A[i, :], indexed by j
        row = tl.sum(a_i[:, None] * inv, 0)                  # sum_j A_ij inv[j, :]
        inv = tl.where(pick, eye - row[None, :], inv)
    return inv


@triton.jit
def gdn_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, starts_ptr, gam_ptr, tinv_ptr, w_ptr, u_ptr,
                    T, Hk, Hv, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                    BV: tl.constexpr, HAS_STARTS: tl.constexpr, PRECISION: tl.constexpr):
    """Per (chunk, value head): gamma, Tinv = (I + A)^-1 (fp32, kept for the backward), w, u."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // Hv, bh % Hv
    hk = h // (Hv // Hk)
    t, ok = _chunk_rows(c, T, C)
    tok = (b * T + t) * Hv + h
    # padded steps: no decay (g = 0), no write (beta = 0)
    g = tl.load(g_ptr + tok, mask=ok, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok, mask=ok, other=0.0).to(tl.float32)
    gam = tl.cumsum(g, 0)
    tl.store(gam_ptr + tok, gam, mask=ok)
    seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
    k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    A = beta[:, None] * kk * _decay(gam, seg, C, True)
    tinv = _unit_lower_inverse(A, C)
    cc = tl.arange(0, C)
    tinv_offs = tok.to(tl.int64)[:, None] * C + cc[None, :]
    tl.store(tinv_ptr + tinv_offs, tinv, mask=ok[:, None])
    dt = k.dtype
    tinv_d = tinv.to(dt)
    kb = k * (beta * tl.exp(gam) * first.to(tl.float32))[:, None]
    w = tl.dot(tinv_d, kb.to(dt), input_precision=PRECISION)
    _store_rows(w_ptr, w, b, t, ok, T, Hv, h, DK, 0, DK)
    for v0 in range(0, DV, BV):
        v = _load_rows(v_ptr, b, t, ok, T, Hv, h, DV, v0, BV)
        u = tl.dot(tinv_d, (v * beta[:, None]).to(dt), input_precision=PRECISION)
        _store_rows(u_ptr, u, b, t, ok, T, Hv, h, DV, v0, BV)


@triton.jit
def gdn_states_kernel(k_ptr, w_ptr, u_ptr, gam_ptr, starts_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr,
                      T, n, Hk, Hv, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                      BV: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_H0: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Per (BV value columns, value head): the pass over chunks, S in fp32 registers; writes
    every chunk's start state (h, input dtype), v_new and the final state (fp32)."""
    v0 = tl.program_id(0) * BV
    bh = tl.program_id(1)
    b, h = bh // Hv, bh % Hv
    hk = h // (Hv // Hk)
    kr = tl.arange(0, DK)
    vc = v0 + tl.arange(0, BV)
    fin = bh.to(tl.int64) * DK * DV + kr[:, None] * DV + vc[None, :]
    if HAS_H0:
        S = tl.load(h0_ptr + fin).to(tl.float32)
    else:
        S = tl.zeros([DK, BV], dtype=tl.float32)
    for c in range(n):
        t, ok = _chunk_rows(c, T, C)
        tl.store(h_ptr + _state_offs(b, c, n, h, Hv, DK, DV, v0, BV), S.to(h_ptr.dtype.element_ty))
        w = _load_rows(w_ptr, b, t, ok, T, Hv, h, DK, 0, DK)
        dt = w.dtype
        u = _load_rows(u_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(tl.float32)
        vn = u - tl.dot(w, S.to(dt), input_precision=PRECISION)
        _store_rows(vn_ptr, vn, b, t, ok, T, Hv, h, DV, v0, BV)
        gam, g_last = _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C)
        seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
        k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
        k_end = k * (tl.exp(g_last - gam) * last.to(tl.float32))[:, None]
        S = S * (tl.exp(g_last) * carry.to(tl.float32)) + tl.dot(
            tl.trans(k_end.to(dt)), vn.to(dt), input_precision=PRECISION)
    tl.store(ht_ptr + fin, S)


@triton.jit
def gdn_output_kernel(q_ptr, k_ptr, gam_ptr, starts_ptr, h_ptr, x_ptr, out_ptr, T, n, Hk, Hv,
                      DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                      HAS_STARTS: tl.constexpr, ADJOINT: tl.constexpr, PRECISION: tl.constexpr):
    """Per (chunk, value head, BV columns), with P = q k^T * decay * causal (same segment):
      forward (x = v_new)  o = (q e^gamma first) S_c + P v_new
      adjoint (x = do)     out = P^T do   (the intra-chunk part of dv_new)"""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    b, h = bh // Hv, bh % Hv
    hk = h // (Hv // Hk)
    t, ok = _chunk_rows(c, T, C)
    gam, g_last = _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C)
    seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
    q = _load_rows(q_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    dt = q.dtype
    P = tl.dot(q, tl.trans(k), input_precision=PRECISION) * _decay(gam, seg, C, False)
    x = _load_rows(x_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(dt)
    if ADJOINT:
        out = tl.dot(tl.trans(P.to(dt)), x, input_precision=PRECISION)
    else:
        S = tl.load(h_ptr + _state_offs(b, c, n, h, Hv, DK, DV, v0, BV))
        q_dec = q * (tl.exp(gam) * first.to(tl.float32))[:, None]
        out = tl.dot(q_dec.to(dt), S.to(dt), input_precision=PRECISION)
        out += tl.dot(P.to(dt), x, input_precision=PRECISION)
    _store_rows(out_ptr, out, b, t, ok, T, Hv, h, DV, v0, BV)
