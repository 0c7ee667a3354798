"""Triton kernels of the chunked gated delta rule, forward (longmoe/ops/gated_delta.py has the
definition; gated_delta_chunk.py launches these and holds the backward's autograd seam).

Legend: B batch, T tokens, Hk/Hv key/value heads (a key head serves Hv/Hk value heads), C chunk
length (a power of two >= 16), n = ceil(T / C) chunks, DK/DV head dims (powers of two >= 16:
compile-time sizes, so no feature masks), BV / BK a block of value / key columns. Token tensors
are [B, T, H, D] contiguous; chunk states [B, n, Hv, DK, DV].

Per chunk and value head, with gamma the cumulative log decay from the chunk start (fp32; only
exponentials of differences <= 0 are formed, so g ~ -20 per token never overflows):
  A = strict-lower beta_i e^(gamma_i - gamma_j) k_i.k_j,   Tinv = (I + A)^-1 (16 x 16 blocks)
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
    return _state_block(b, c, n, h, Hv, DK, DV, 0, DK, col0, BV)


@triton.jit
def _state_block(b, c, n, h, Hv, DK: tl.constexpr, DV: tl.constexpr, row0, BK: tl.constexpr,
                 col0, BV: tl.constexpr):
    """Offsets of rows row0..row0+BK, columns col0..col0+BV of chunk c's state."""
    base = ((b * n + c) * Hv + h).to(tl.int64) * DK * DV
    return (base + (row0 + tl.arange(0, BK))[:, None] * DV + col0
            + tl.arange(0, BV)[None, :])


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
def _invert_in_place(rows_ptr, row_stride, c, T, C: tl.constexpr):
    """(I + A)^-1 of the strictly lower-triangular C x C matrix A stored row by row at rows_ptr
    (row i of the chunk at rows_ptr + i * row_stride; rows past T are absent and read as 0),
    overwritten in place, in 16 x 16 blocks and fp32: the C / 16 diagonal blocks by forward
    substitution side by side (row i = e_i - sum_{j<i} A_ij row j: 15 dependent steps for all
    of them), then block row r's off-diagonal blocks T_rc = -T_rr sum_{c<=m<r} A_rm T_mc.
    Block rows read what earlier ones wrote, so each ends with a barrier. The substitution
    holds the blocks transposed, so that its sum over j runs along the tile's last axis (within
    a warp) and row i of A comes from memory: with the sum across the tile's rows, and row i
    picked out by a second reduction, the warps met at a barrier twice a step, and the
    substitution took half of the prep kernel's time on an H200."""
    NB: tl.constexpr = C // 16
    r16 = tl.arange(0, 16)
    eye = (r16[:, None] == r16[None, :]).to(tl.float32)
    b16 = tl.arange(0, NB) * 16                                             # [NB] block starts
    # inv_t[b, x, j] = (block b's inverse)[j, x]
    inv_t = tl.zeros([NB, 16, 16], dtype=tl.float32) + eye[None, :, :]
    for i in range(1, 16):
        row = b16 + i
        a_i = tl.load(rows_ptr + row.to(tl.int64)[:, None] * row_stride + b16[:, None]
                      + r16[None, :], mask=(c * C + row < T)[:, None], other=0.0)  # [NB, 16]
        new = (r16 == i).to(tl.float32)[None, :] - tl.sum(a_i[:, None, :] * inv_t, 2)
        inv_t = tl.where(r16[None, None, :] == i, new[:, :, None], inv_t)
    tl.debug_barrier()      # every warp is done reading A's diagonal blocks
    diag_t = (rows_ptr + (b16[:, None, None] + r16[None, None, :]).to(tl.int64) * row_stride
              + b16[:, None, None] + r16[None, :, None])
    tl.store(diag_t, inv_t, mask=(c * C + b16[:, None, None] + r16[None, None, :] < T))
    tl.debug_barrier()
    for bi in tl.static_range(1, NB):
        ok = c * C + bi * 16 + r16 < T
        row_ptrs = rows_ptr + (bi * 16 + r16).to(tl.int64)[:, None] * row_stride + r16[None, :]
        t_rr = tl.load(row_ptrs + bi * 16, mask=ok[:, None], other=0.0)
        for cj in tl.static_range(bi):
            acc = tl.zeros([16, 16], dtype=tl.float32)
            for m in tl.static_range(cj, bi):
                a_rm = tl.load(row_ptrs + m * 16, mask=ok[:, None], other=0.0)
                m_ok = c * C + m * 16 + r16 < T
                t_mc = tl.load(rows_ptr + (m * 16 + r16).to(tl.int64)[:, None] * row_stride
                               + cj * 16 + r16[None, :], mask=m_ok[:, None], other=0.0)
                acc += tl.dot(a_rm, t_mc, input_precision="ieee")
            # A_r,cj is not read again (later columns start at m > cj), so it can be replaced
            tl.store(row_ptrs + cj * 16, -tl.dot(t_rr, acc, input_precision="ieee"),
                     mask=ok[:, None])
        tl.debug_barrier()


@triton.jit
def gdn_prep_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, starts_ptr, gam_ptr, tinv_ptr, w_ptr, u_ptr,
                    T, Hk, Hv, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                    BV: tl.constexpr, BK: tl.constexpr, HAS_STARTS: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Per (chunk, value head): gamma, Tinv = (I + A)^-1 (fp32, kept for the backward), w (by
    blocks of BK key columns), u (of BV value columns)."""
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
    # A goes through the Tinv rows of this chunk (their final home) to be inverted block-wise
    cc = tl.arange(0, C)
    tinv_offs = tok.to(tl.int64)[:, None] * C + cc[None, :]
    tl.store(tinv_ptr + tinv_offs, A, mask=ok[:, None])
    tl.debug_barrier()
    _invert_in_place(tinv_ptr + ((b * T + c * C) * Hv + h).to(tl.int64) * C, Hv * C, c, T, C)
    dt = k.dtype
    tinv_d = tl.load(tinv_ptr + tinv_offs, mask=ok[:, None], other=0.0).to(dt)
    kscale = beta * tl.exp(gam) * first.to(tl.float32)
    if BK == DK:
        w = tl.dot(tinv_d, (k * kscale[:, None]).to(dt), input_precision=PRECISION)
        _store_rows(w_ptr, w, b, t, ok, T, Hv, h, DK, 0, DK)
    else:
        # w by blocks of key columns, k read again (from cache): less of k, w and their fp32
        # products alive at once, fewer registers where those bound the occupancy
        for k0 in range(0, DK, BK):
            kc = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, k0, BK)
            w = tl.dot(tinv_d, (kc * kscale[:, None]).to(dt), input_precision=PRECISION)
            _store_rows(w_ptr, w, b, t, ok, T, Hv, h, DK, k0, BK)
    for v0 in range(0, DV, BV):
        v = _load_rows(v_ptr, b, t, ok, T, Hv, h, DV, v0, BV)
        u = tl.dot(tinv_d, (v * beta[:, None]).to(dt), input_precision=PRECISION)
        _store_rows(u_ptr, u, b, t, ok, T, Hv, h, DV, v0, BV)


@triton.jit
def _states_step(S, c, k_ptr, w_ptr, u_ptr, gam_ptr, starts_ptr, h_ptr, vn_ptr, b, h, hk, v0, T,
                 n, Hk, Hv, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                 BV: tl.constexpr, HAS_STARTS: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c of the forward state pass: stores S_c and v_new, returns S_{c+1}."""
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
    return S * (tl.exp(g_last) * carry.to(tl.float32)) + tl.dot(
        tl.trans(k_end.to(dt)), vn.to(dt), input_precision=PRECISION)


@triton.jit
def gdn_states_kernel(k_ptr, w_ptr, u_ptr, gam_ptr, starts_ptr, h0_ptr, h_ptr, vn_ptr, ht_ptr,
                      T, n, Hk, Hv, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                      BV: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_H0: tl.constexpr,
                      PRECISION: tl.constexpr, COUNTED: tl.constexpr):
    """Per (BV value columns, value head): the pass over chunks, S in fp32 registers; writes
    every chunk's start state (h, input dtype), v_new and the final state (fp32). COUNTED: a
    for loop over the chunks (Triton pipelines the loads of for loops only); otherwise the same
    steps in a while loop, for interpreters that cannot take a run-time loop bound."""
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
    if COUNTED:
        for c in range(n):
            S = _states_step(S, c, k_ptr, w_ptr, u_ptr, gam_ptr, starts_ptr, h_ptr, vn_ptr, b, h,
                             hk, v0, T, n, Hk, Hv, DK, DV, C, BV, HAS_STARTS, PRECISION)
    else:
        c = 0
        while c < n:
            S = _states_step(S, c, k_ptr, w_ptr, u_ptr, gam_ptr, starts_ptr, h_ptr, vn_ptr, b, h,
                             hk, v0, T, n, Hk, Hv, DK, DV, C, BV, HAS_STARTS, PRECISION)
            c += 1
    tl.store(ht_ptr + fin, S)


@triton.jit
def gdn_output_kernel(q_ptr, k_ptr, gam_ptr, starts_ptr, h_ptr, x_ptr, out_ptr, T, n, Hk,
                      G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                      BV: tl.constexpr, HAS_STARTS: tl.constexpr, ADJOINT: tl.constexpr,
                      PRECISION: tl.constexpr):
    """Per (BV columns, chunk, key head), for each of the key head's G value heads, with
    P = q k^T * decay * causal (same segment):
      forward (x = v_new)  o = (q e^gamma first) S_c + P v_new
      adjoint (x = do)     out = P^T do   (the intra-chunk part of dv_new)
    The G heads share q, k and q k^T: one program reads and forms them once."""
    v0 = tl.program_id(0) * BV
    c = tl.program_id(1)
    bk = tl.program_id(2)
    b, hk = bk // Hk, bk % Hk
    Hv = Hk * G
    t, ok = _chunk_rows(c, T, C)
    seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
    q = _load_rows(q_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    dt = q.dtype
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    for j in range(G):
        h = hk * G + j
        gam, g_last = _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C)
        P = (qk * _decay(gam, seg, C, False)).to(dt)
        x = _load_rows(x_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(dt)
        if ADJOINT:
            out = tl.dot(tl.trans(P), x, input_precision=PRECISION)
        else:
            S = tl.load(h_ptr + _state_offs(b, c, n, h, Hv, DK, DV, v0, BV))
            q_dec = q * (tl.exp(gam) * first.to(tl.float32))[:, None]
            out = tl.dot(q_dec.to(dt), S.to(dt), input_precision=PRECISION)
            out += tl.dot(P, x, input_precision=PRECISION)
        _store_rows(out_ptr, out, b, t, ok, T, Hv, h, DV, v0, BV)
