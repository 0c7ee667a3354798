"""Triton kernels of the chunked gated delta rule, backward (the forward and the legend are in
gated_delta_fwd.py). With do the output gradient and dS_{c+1} the gradient of chunk c's end
state, per chunk (first/last/carry the segment masks of gated_delta_fwd.py):

  dv_new = P^T do + k_end dS_{c+1}                     (P^T do: gdn_output_kernel, ADJOINT)
  dS_c   = carry e^gamma_last dS_{c+1} + (q e^gamma first)^T do - w^T dv_new
                                                         (gdn_states_bwd_kernel, reverse pass)
then, independently per chunk (gdn_bwd_wy_kernel; gdn_bwd_qk_kernel, per block of key columns):
  u = Tinv (beta v), w = Tinv (beta e^gamma k):  dw = -dv_new S_c^T,
      dTinv = dv_new (beta v)^T + dw (beta e^gamma k)^T,  dA = -Tinv^T dTinv Tinv^T (strict lower)
  o and S_{c+1} directly:  dq = (e^gamma first) do S_c^T + (dP * decay) k,  dP = do v_new^T,
      dk += (dP * decay)^T q + k_end-scale * v_new dS_{c+1}^T
and dg from d gamma by the reverse cumulative sum of gamma = cumsum(g) within the chunk: every
product that holds e^(gamma_i - gamma_j) passes +X to gamma_i and -X to gamma_j.
"""

from __future__ import annotations

import triton
import triton.language as tl

from longmoe.ops.kernels.gated_delta_fwd import (_chunk_rows, _decay, _load_gamma, _load_rows,
                                                  _segments, _state_block, _state_offs,
                                                  _store_rows)


@triton.jit
def _states_bwd_step(dS, c, q_ptr, k_ptr, w_ptr, gam_ptr, starts_ptr, do_ptr, dvi_ptr, dh_ptr,
                     dvn_ptr, b, h, hk, v0, T, n, Hk, Hv, DK: tl.constexpr, DV: tl.constexpr,
                     C: tl.constexpr, BV: tl.constexpr, HAS_STARTS: tl.constexpr,
                     PRECISION: tl.constexpr):
    """Chunk c of the reverse pass: stores dS_{c+1} and dv_new, returns dS_c."""
    t, ok = _chunk_rows(c, T, C)
    tl.store(dh_ptr + _state_offs(b, c, n, h, Hv, DK, DV, v0, BV),
             dS.to(dh_ptr.dtype.element_ty))
    gam, g_last = _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C)
    seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
    k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    dt = k.dtype
    k_end = k * (tl.exp(g_last - gam) * last.to(tl.float32))[:, None]
    dvn = _load_rows(dvi_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(tl.float32)
    dvn += tl.dot(k_end.to(dt), dS.to(dt), input_precision=PRECISION)
    _store_rows(dvn_ptr, dvn, b, t, ok, T, Hv, h, DV, v0, BV)
    q = _load_rows(q_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    q_dec = q * (tl.exp(gam) * first.to(tl.float32))[:, None]
    do = _load_rows(do_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(dt)
    w = _load_rows(w_ptr, b, t, ok, T, Hv, h, DK, 0, DK)
    dS = dS * (tl.exp(g_last) * carry.to(tl.float32))
    dS += tl.dot(tl.trans(q_dec.to(dt)), do, input_precision=PRECISION)
    dS -= tl.dot(tl.trans(w), dvn.to(dt), input_precision=PRECISION)
    return dS


@triton.jit
def gdn_states_bwd_kernel(q_ptr, k_ptr, w_ptr, gam_ptr, starts_ptr, do_ptr, dvi_ptr, dht_ptr,
                          dh_ptr, dvn_ptr, dh0_ptr, T, n, Hk, Hv, DK: tl.constexpr,
                          DV: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                          HAS_STARTS: tl.constexpr, HAS_DHT: tl.constexpr,
                          PRECISION: tl.constexpr, COUNTED: tl.constexpr):
    """Per (BV value columns, value head): the reverse pass over chunks, dS in fp32 registers;
    writes every chunk's end-state gradient (dh), dv_new and the initial state's gradient.
    COUNTED as in gdn_states_kernel."""
    v0 = tl.program_id(0) * BV
    bh = tl.program_id(1)
    b, h = bh // Hv, bh % Hv
    hk = h // (Hv // Hk)
    kr = tl.arange(0, DK)
    vc = v0 + tl.arange(0, BV)
    fin = bh.to(tl.int64) * DK * DV + kr[:, None] * DV + vc[None, :]
    if HAS_DHT:
        dS = tl.load(dht_ptr + fin).to(tl.float32)
    else:
        dS = tl.zeros([DK, BV], dtype=tl.float32)
    if COUNTED:
        for i in range(n):
            dS = _states_bwd_step(dS, n - 1 - i, q_ptr, k_ptr, w_ptr, gam_ptr, starts_ptr,
                                  do_ptr, dvi_ptr, dh_ptr, dvn_ptr, b, h, hk, v0, T, n, Hk, Hv,
                                  DK, DV, C, BV, HAS_STARTS, PRECISION)
    else:
        c = n - 1
        while c >= 0:
            dS = _states_bwd_step(dS, c, q_ptr, k_ptr, w_ptr, gam_ptr, starts_ptr, do_ptr,
                                  dvi_ptr, dh_ptr, dvn_ptr, b, h, hk, v0, T, n, Hk, Hv, DK, DV,
                                  C, BV, HAS_STARTS, PRECISION)
            c -= 1
    tl.store(dh0_ptr + fin, dS)


@triton.jit
def gdn_bwd_wy_kernel(k_ptr, v_ptr, beta_ptr, gam_ptr, starts_ptr, tinv_ptr, h_ptr, dvn_ptr,
                      dv_ptr, dk_ptr, dbeta_ptr, dgam_ptr, T, n, Hk, Hv, DK: tl.constexpr,
                      DV: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                      HAS_STARTS: tl.constexpr, PRECISION: tl.constexpr):
    """Per (chunk, value head): the gradients through w, u and Tinv = (I + A)^-1: dv, dbeta,
    and the WY parts of dk (per value head, fp32) and of d gamma."""
    c = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // Hv, bh % Hv
    hk = h // (Hv // Hk)
    t, ok = _chunk_rows(c, T, C)
    tok = (b * T + t) * Hv + h
    gam, g_last = _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C)
    seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
    beta = tl.load(beta_ptr + tok, mask=ok, other=0.0).to(tl.float32)
    cc = tl.arange(0, C)
    k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, 0, DK)
    dt = k.dtype
    # Tinv^T read as such (every product takes it transposed); in the inputs' dtype, as the
    # forward took it for w and u
    tinv_td = tl.load(tinv_ptr + tok.to(tl.int64)[None, :] * C + cc[:, None], mask=ok[None, :],
                      other=0.0).to(dt)
    kscale = beta * tl.exp(gam) * first.to(tl.float32)
    neg_dw = tl.zeros([C, DK], dtype=tl.float32)
    dtinv = tl.zeros([C, C], dtype=tl.float32)
    dbeta = tl.zeros([C], dtype=tl.float32)
    for v0 in range(0, DV, BV):
        S = tl.load(h_ptr + _state_offs(b, c, n, h, Hv, DK, DV, v0, BV)).to(dt)
        dvn = _load_rows(dvn_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(dt)
        v = _load_rows(v_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(tl.float32)
        neg_dw += tl.dot(dvn, tl.trans(S), input_precision=PRECISION)
        dtinv += tl.dot(dvn, tl.trans((v * beta[:, None]).to(dt)), input_precision=PRECISION)
        dvb = tl.dot(tinv_td, dvn, input_precision=PRECISION)          # d(beta v)
        _store_rows(dv_ptr, dvb * beta[:, None], b, t, ok, T, Hv, h, DV, v0, BV)
        dbeta += tl.sum(dvb * v, 1)
    # dw = -neg_dw, w = Tinv kb with kb = beta e^gamma k: the tiles live one after another
    # (the kernel sits at the register limit). The products take their fp32 factors rounded to
    # the inputs' dtype, as the forward's do: fp32 factors held twice the shared memory (110
    # against 57 KiB in the compile check) and ran in IEEE fp32 at torch's default precision
    ndw = neg_dw.to(dt)
    dkb = -tl.dot(tinv_td, ndw, input_precision=PRECISION)             # d kb
    dtinv -= tl.dot(ndw, tl.trans((k * kscale[:, None]).to(dt)), input_precision=PRECISION)
    r = tl.sum(dkb * k.to(tl.float32), 1)
    dk = dkb * kscale[:, None]
    dgam = r * kscale
    dbeta += r * tl.exp(gam) * first.to(tl.float32)
    # d(I + A) = -Tinv^T dTinv Tinv^T; only A's strict lower part (same segment) is a variable
    dA = -tl.dot(tl.dot(tinv_td, dtinv.to(dt), input_precision=PRECISION).to(dt), tinv_td,
                 input_precision=PRECISION)
    # A_ij = beta_i (k_i.k_j) e^(gamma_i - gamma_j)
    dAE = dA * _decay(gam, seg, C, True)
    kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
    dbeta += tl.sum(dAE * kk, 1)
    dAB = dAE * beta[:, None]
    dk += tl.dot(dAB.to(dt), k, input_precision=PRECISION)
    dk += tl.dot(tl.trans(dAB).to(dt), k, input_precision=PRECISION)
    G = dAB * kk
    dgam += tl.sum(G, 1) - tl.sum(G, 0)
    _store_rows(dk_ptr, dk, b, t, ok, T, Hv, h, DK, 0, DK)
    tl.store(dbeta_ptr + tok, dbeta, mask=ok)
    tl.store(dgam_ptr + tok, dgam, mask=ok)


@triton.jit
def _qk_head(q, k, b, h, c, k0, kb, t, ok, seg, first, last, carry, gam_ptr, h_ptr, dh_ptr,
             do_ptr, vn_ptr, dkw_ptr, dgw_ptr, dg_ptr, T, n, Hv, DK: tl.constexpr,
             DV: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
             PRECISION: tl.constexpr):
    """Value head h's share of dq and dk on the block's key columns (fp32); stores its dg.
    q k^T is formed per head again rather than kept across the heads: the registers it would
    hold through the loop push the kernel into spills."""
    dt = q.dtype
    gam, g_last = _load_gamma(gam_ptr, b, h, c, t, ok, T, Hv, C)
    dq = tl.zeros([C, BK], dtype=tl.float32)
    dke = tl.zeros([C, BK], dtype=tl.float32)
    dP = tl.zeros([C, C], dtype=tl.float32)
    s_ds = tl.full([], 0.0, tl.float32)     # sum(S_c * dS_{c+1}): gamma_last's carry term
    for v0 in range(0, DV, BV):
        offs = _state_block(b, c, n, h, Hv, DK, DV, k0, BK, v0, BV)
        S = tl.load(h_ptr + offs)
        dS = tl.load(dh_ptr + offs)
        do = _load_rows(do_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(dt)
        vn = _load_rows(vn_ptr, b, t, ok, T, Hv, h, DV, v0, BV).to(dt)
        dq += tl.dot(do, tl.trans(S.to(dt)), input_precision=PRECISION)
        dke += tl.dot(vn, tl.trans(dS.to(dt)), input_precision=PRECISION)
        dP += tl.dot(do, tl.trans(vn), input_precision=PRECISION)
        s_ds += tl.sum(tl.sum(S.to(tl.float32) * dS.to(tl.float32), 1), 0)
    dq = dq * (tl.exp(gam) * first.to(tl.float32))[:, None]
    dgam = tl.sum(q.to(tl.float32) * dq, 1)
    dPD = dP * _decay(gam, seg, C, False)
    dq += tl.dot(dPD.to(dt), k, input_precision=PRECISION)
    dk = tl.dot(tl.trans(dPD).to(dt), q, input_precision=PRECISION)
    Pm = dPD * tl.dot(q, tl.trans(k), input_precision=PRECISION)
    dgam += tl.sum(Pm, 1) - tl.sum(Pm, 0)
    dke = dke * tl.where(ok, tl.exp(g_last - gam) * last.to(tl.float32), 0.0)[:, None]
    dk += dke
    R = tl.sum(k.to(tl.float32) * dke, 1)
    dgam -= R
    # gamma_last (the chunk's last real token) also scales the carried state
    g_last_grad = tl.sum(R, 0) + tl.exp(g_last) * carry.to(tl.float32) * s_ds
    last_t = tl.minimum(c * C + C - 1, T - 1)
    dgam += tl.where(t == last_t, g_last_grad, 0.0)
    tok = (b * T + t) * Hv + h
    dgam += tl.where(kb == 0, tl.load(dgw_ptr + tok, mask=ok, other=0.0), 0.0)
    dgam = tl.where(ok, dgam, 0.0)
    # gamma_i = sum_{s <= i} g_s, so dg_s = sum_{i >= s} dgamma_i
    dg = tl.sum(dgam, 0) - tl.cumsum(dgam, 0) + dgam
    tl.store(dg_ptr + tok, dg, mask=ok)   # dg_ptr: this key-column block's share
    dk += _load_rows(dkw_ptr, b, t, ok, T, Hv, h, DK, k0, BK)
    return dq, dk


@triton.jit
def gdn_bwd_qk_kernel(q_ptr, k_ptr, gam_ptr, starts_ptr, h_ptr, dh_ptr, do_ptr, vn_ptr,
                      dkw_ptr, dgw_ptr, dq_ptr, dk_ptr, dg_ptr, T, n, Hk, G: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BV: tl.constexpr,
                      BK: tl.constexpr, HAS_STARTS: tl.constexpr, PRECISION: tl.constexpr):
    """Per (BK key columns, chunk, key head): those columns of dq and dk, summed over the key
    head's G value heads in fp32 and stored once in q's dtype; each head adds the direct parts
    (the output and the end state) to its WY part (dkw) and stores its share of dg, the reverse
    cumulative sum of d gamma (every d gamma term is a sum over key columns, so the shares add
    up; the first block adds the WY part dgw). Only dP = do v_new^T, a sum over value columns,
    is formed by every block: BK < DK buys programs (parallelism) and fewer accumulator
    registers for one C x C x DV product more per block."""
    kb = tl.program_id(0)
    k0 = kb * BK
    c = tl.program_id(1)
    bk = tl.program_id(2)
    b, hk = bk // Hk, bk % Hk
    Hv = Hk * G
    t, ok = _chunk_rows(c, T, C)
    seg, first, last, carry = _segments(starts_ptr, b, t, ok, T, HAS_STARTS)
    q = _load_rows(q_ptr, b, t, ok, T, Hk, hk, DK, k0, BK)
    k = _load_rows(k_ptr, b, t, ok, T, Hk, hk, DK, k0, BK)
    dq = tl.zeros([C, BK], dtype=tl.float32)
    dk = tl.zeros([C, BK], dtype=tl.float32)
    # unrolled: as a loop, the carried accumulators spill on some targets (gfx942, gfx950)
    for j in tl.static_range(G):
        dq_h, dk_h = _qk_head(q, k, b, hk * G + j, c, k0, kb, t, ok, seg, first, last,
                              carry, gam_ptr, h_ptr, dh_ptr, do_ptr, vn_ptr, dkw_ptr, dgw_ptr,
                              dg_ptr + kb.to(tl.int64) * (tl.num_programs(2) * G * T), T, n,
                              Hv, DK, DV, C, BV, BK, PRECISION)
        dq += dq_h
        dk += dk_h
    _store_rows(dq_ptr, dq, b, t, ok, T, Hk, hk, DK, k0, BK)
    _store_rows(dk_ptr, dk, b, t, ok, T, Hk, hk, DK, k0, BK)
