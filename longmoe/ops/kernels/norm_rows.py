"""Fused RMS norms over rows, forward and backward in one pass each: RMSNorm (the layers' input
and final norms), the q/k norm followed by partial rotary (norm_rope) and the Gated DeltaNet
output's gated norm. Vendor-neutral; tiles come from the backend's kernel table ("norm_rows",
bucket "d<=256" for head-wide rows, "any" for hidden-wide ones).

Legend: D the normalised last dim, H the one before it, N the rest flattened; M = N * H rows.
R rotary dims, P the partner column of the rotate-half (c + R/2 below R/2, c - R/2 above).

  rms_norm:        r = rsqrt(sum(x^2) / D + eps),  y = ((x * r) * w).to(x)     w = 1 + weight
                   with unit_offset
  norm_rope:       u = rms_norm(x) rounded to x's dtype, then for c < R
                   y[c] = u[c] * cos[c] + (c < R/2 ? -u[P] : u[P]) * sin[c], c >= R: y[c] = u[c]
  gated_rms_norm:  x rounded to the output dtype X, n = (x * r).to(X), y = (w * n) * silu(gate)
  backward:        dx = r * (dn - n * sum(dn * n) / D) per row, dweight = sum over rows of
                   dz * n (fp32 partial sums per program, summed once by torch)

All arithmetic in fp32, in the order of the eager functions (rms_norm, norm_rope and
gated_rms_norm in longmoe/ops/norm.py), and every rounding the eager chain makes to a
16-bit dtype on the way (RoPE's products and sum in x's dtype, the gated norm's normalised x)
is made here too, so the two differ only in the order of the fp32 row sums (and the
approximate rsqrt/exp of a GPU). The row index is int32 (the launcher checks M); offsets are
int64. x may be a strided view (q_proj's q beside the output gate, per head): rows that are
[N, H] strides apart are read in place, anything else is copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longmoe.backends import active_backend
from longmoe.ops.kernels.l2norm_rows import _as_NHD

TABLE_KEY = "norm_rows"
MAX_D = 16384  # one tile a row: wider rows would hold more than 64 fp32 values a lane
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' KIND codes


@triton.jit
def _round(v, KIND: tl.constexpr):
    """v (fp32) rounded to bf16 (KIND 1) or fp16 (2) and back, as a torch op in that dtype
    stores its result; 0 leaves fp32."""
    if KIND == 1:
        v = v.to(tl.bfloat16).to(tl.float32)
    if KIND == 2:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def _tile(rows, H, stride_n, stride_h, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Offsets of rows m = (n, h) = (m // H, m % H) in a strided x and in a contiguous [M, D]
    tensor, the columns and their mask. int32 row division (64-bit division is a long routine
    on some GPUs), int64 offsets (a long packed batch's pass 2^31)."""
    n, h = (rows // H).to(tl.int64), (rows % H).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)[None, :]
    return (n * stride_n + h * stride_h)[:, None], rows.to(tl.int64)[:, None] * D, cols, cols < D


@triton.jit
def _partner(cols, R: tl.constexpr):
    """The rotate-half partner of each column below R and its sign; columns >= R map to
    themselves (never read: the rotation masks them)."""
    half: tl.constexpr = R // 2
    lo = cols < half
    p = tl.where(lo, cols + half, tl.where(cols < R, cols - half, cols))
    return p, tl.where(lo, -1.0, 1.0)


@triton.jit
def norm_rows_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, r_ptr, M, H, stride_n,
                         stride_h, CS, eps, D: tl.constexpr, R: tl.constexpr,
                         UNIT_OFFSET: tl.constexpr, ROPE: tl.constexpr, XR: tl.constexpr,
                         PR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < M
    x_base, base, cols, mask = _tile(rows, H, stride_n, stride_h, D, BLOCK_D)
    mask = mask & rmask[:, None]
    x = tl.load(x_ptr + x_base + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        w = w + 1.0
    y = (x * r[:, None]) * w
    if ROPE:
        # the rotation reads the normalised partner column: x and w reloaded there (cached)
        u = _round(y, XR)
        p, sign = _partner(cols, R)
        rot = cols < R
        xp = tl.load(x_ptr + x_base + p, mask=mask & rot, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + p, mask=rot, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            wp = wp + 1.0
        up = _round((xp * r[:, None]) * wp, XR)
        t = ((rows // H) % CS).to(tl.int64)[:, None] * R + cols
        c = tl.load(cos_ptr + t, mask=mask & rot, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t, mask=mask & rot, other=0.0).to(tl.float32)
        y = tl.where(rot, _round(_round(u * c, PR) + _round((sign * up) * s, PR), PR), u)
    tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + rows, r, mask=rmask)


@triton.jit
def norm_rows_bwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, r_ptr, dy_ptr, dx_ptr, dw_ptr, M, H,
                         stride_n, stride_h, CS, D: tl.constexpr, R: tl.constexpr,
                         UNIT_OFFSET: tl.constexpr, ROPE: tl.constexpr, XR: tl.constexpr,
                         PR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                         ROW_TILES: tl.constexpr):
    """ROW_TILES tiles of rows per program; its dweight partial sum in row program_id of dw."""
    pid = tl.program_id(0)
    cols1 = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols1, mask=cols1 < D, other=0.0).to(tl.float32)[None, :]
    if UNIT_OFFSET:
        w = w + 1.0
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(ROW_TILES):
        rows = (pid * ROW_TILES + i) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        rmask = rows < M
        x_base, base, cols, mask = _tile(rows, H, stride_n, stride_h, D, BLOCK_D)
        mask = mask & rmask[:, None]
        x = tl.load(x_ptr + x_base + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=rmask, other=0.0)[:, None]
        g = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        if ROPE:
            # the rotation's adjoint in the eager chain's dtypes: g * cos and g * sin rounded
            # to the output's, then to x's, their sum to x's
            p, sign = _partner(cols, R)
            rot = cols < R
            t = ((rows // H) % CS).to(tl.int64)[:, None] * R
            c = tl.load(cos_ptr + t + cols, mask=mask & rot, other=0.0).to(tl.float32)
            sp = tl.load(sin_ptr + t + p, mask=mask & rot, other=0.0).to(tl.float32)
            gp = tl.load(dy_ptr + base + p, mask=mask & rot, other=0.0).to(tl.float32)
            a = _round(_round(g * c, PR), XR)
            b = _round(_round(gp * sp, PR), XR)
            g = tl.where(rot, _round(a - sign * b, XR), _round(g, XR))
        n = x * r
        dw += tl.sum(g * n, 0)
        dn = g * w
        dx = r * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid.to(tl.int64) * D + cols1, dw, mask=cols1 < D)


@triton.jit
def gated_norm_fwd_kernel(x_ptr, gate_ptr, w_ptr, y_ptr, r_ptr, M, H, stride_xn, stride_xh,
                          stride_gn, stride_gh, eps, D: tl.constexpr, XR: tl.constexpr,
                          ROUND_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < M
    x_base, base, cols, mask = _tile(rows, H, stride_xn, stride_xh, D, BLOCK_D)
    g_base, _, _, _ = _tile(rows, H, stride_gn, stride_gh, D, BLOCK_D)
    mask = mask & rmask[:, None]
    x = _round(tl.load(x_ptr + x_base + cols, mask=mask, other=0.0).to(tl.float32), XR)
    r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    y = w * _round(x * r[:, None], XR)
    if ROUND_Y:  # weight and x of one 16-bit dtype: the product is stored in it
        y = _round(y, XR)
    gf = tl.load(gate_ptr + g_base + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (gf / (1.0 + tl.exp(-gf)))
    tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + rows, r, mask=rmask)


@triton.jit
def gated_norm_bwd_kernel(x_ptr, gate_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dgate_ptr, dw_ptr, M, H,
                          stride_xn, stride_xh, stride_gn, stride_gh, D: tl.constexpr,
                          XR: tl.constexpr, ROUND_Y: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_ROWS: tl.constexpr, ROW_TILES: tl.constexpr):
    pid = tl.program_id(0)
    cols1 = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols1, mask=cols1 < D, other=0.0).to(tl.float32)[None, :]
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(ROW_TILES):
        rows = (pid * ROW_TILES + i) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        rmask = rows < M
        x_base, base, cols, mask = _tile(rows, H, stride_xn, stride_xh, D, BLOCK_D)
        g_base, _, _, _ = _tile(rows, H, stride_gn, stride_gh, D, BLOCK_D)
        mask = mask & rmask[:, None]
        x = _round(tl.load(x_ptr + x_base + cols, mask=mask, other=0.0).to(tl.float32), XR)
        r = tl.load(r_ptr + rows, mask=rmask, other=0.0)[:, None]
        n = x * r
        nr = _round(n, XR)
        y = w * nr
        if ROUND_Y:
            y = _round(y, XR)
        gf = tl.load(gate_ptr + g_base + cols, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-gf))
        go = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        dgate = (go * y) * (sig * (1.0 + gf * (1.0 - sig)))
        tl.store(dgate_ptr + base + cols, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
        dyv = go * (gf * sig)
        if ROUND_Y:
            dw += tl.sum(_round(_round(dyv, XR) * nr, XR), 0)
            dn = _round(_round(dyv, XR) * w, XR)
        else:
            dw += tl.sum(dyv * nr, 0)
            dn = _round(dyv * w, XR)
        dx = r * (dn - n * (tl.sum(dn * n, 1) / D)[:, None])
        tl.store(dx_ptr + base + cols, _round(dx, XR).to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid.to(tl.int64) * D + cols1, dw, mask=cols1 < D)


def _cfg(D: int) -> dict:
    return active_backend().kernel_config(TABLE_KEY, "d<=256" if D <= 256 else None)


def _check_rows(M: int, cfg: dict):
    if M + cfg["BLOCK_ROWS"] * cfg["ROW_TILES"] >= 2**31:  # the kernels' int32 row index
        raise ValueError(f"norm_rows: {M} rows, more than int32 row indices hold")


def _grid(M: int, cfg: dict, backward: bool) -> int:
    return triton.cdiv(M, cfg["BLOCK_ROWS"] * (cfg["ROW_TILES"] if backward else 1))


def _launch(kernel, M, cfg, backward, *args, **consts):
    _check_rows(M, cfg)
    extra = {"ROW_TILES": cfg["ROW_TILES"]} if backward else {}
    kernel[(_grid(M, cfg, backward),)](
        *args, **consts, **extra, BLOCK_D=triton.next_power_of_2(consts["D"]),
        BLOCK_ROWS=cfg["BLOCK_ROWS"],
        **active_backend().launch_options(cfg, "num_warps_bwd" if backward else "num_warps"))


def _partials(M: int, D: int, cfg: dict, device) -> torch.Tensor:
    """The backward programs' dweight partial sums, one fp32 row each (every program writes its
    whole row; with no rows, one row of zeros)."""
    if not M:
        return torch.zeros((1, D), device=device, dtype=torch.float32)
    return torch.empty((_grid(M, cfg, True), D), device=device, dtype=torch.float32)


def _dw(partials: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return partials.sum(0).to(weight.dtype)


class NormRows(torch.autograd.Function):
    """rms_norm, and norm_rope when cos/sin are given. Saves x as it came (a view keeps the
    tensor it slices alive, which the layer holds anyway) and r (4 bytes a row)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, unit_offset: bool, cos, sin):
        D = x.shape[-1]
        M = x.numel() // D
        rope = cos is not None
        out_dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype) \
            if rope else x.dtype
        R = cos.shape[-1] if rope else 0
        cos_c = cos.reshape(-1, R).contiguous() if rope else x.new_empty(0)
        sin_c = sin.reshape(-1, R).contiguous() if rope else x.new_empty(0)
        y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
        r_M = torch.empty(M, device=x.device, dtype=torch.float32)
        x_NHD = _as_NHD(x) if M else x
        consts = dict(D=D, R=R, UNIT_OFFSET=unit_offset, ROPE=rope, XR=_ROUND[x.dtype],
                      PR=_ROUND[out_dtype])
        # per-token cos/sin ([B, S, R]) cover every token: the row's token index m // H is
        # theirs; shared ones ([S, R]) repeat every S tokens
        CS = max(cos_c.shape[0], 1)
        if M:
            _launch(norm_rows_fwd_kernel, M, _cfg(D), False, x_NHD, weight, cos_c, sin_c, y,
                    r_M, M, x_NHD.shape[1], x_NHD.stride(0), x_NHD.stride(1), CS, eps, **consts)
        ctx.save_for_backward(x_NHD, weight, cos_c, sin_c, r_M)
        ctx.consts, ctx.CS, ctx.shape = consts, CS, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_NHD, weight, cos_c, sin_c, r_M = ctx.saved_tensors
        M, D = r_M.shape[0], ctx.shape[-1]
        dx = torch.empty(ctx.shape, device=dy.device, dtype=x_NHD.dtype)
        cfg = _cfg(D)
        partials = _partials(M, D, cfg, dy.device)
        if M:
            _launch(norm_rows_bwd_kernel, M, cfg, True, x_NHD, weight, cos_c, sin_c, r_M,
                    dy.contiguous(), dx, partials, M, x_NHD.shape[1], x_NHD.stride(0),
                    x_NHD.stride(1), ctx.CS, **ctx.consts)
        dw = _dw(partials, weight) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


class GatedNormRows(torch.autograd.Function):
    """gated_rms_norm. Saves x and gate as they came, and r."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps: float, dtype):
        D = x.shape[-1]
        M = x.numel() // D
        out_dtype = dtype or x.dtype
        y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
        r_M = torch.empty(M, device=x.device, dtype=torch.float32)
        x_NHD = _as_NHD(x) if M else x
        g_NHD = _as_NHD(gate) if M else gate
        consts = dict(D=D, XR=_ROUND[out_dtype],
                      ROUND_Y=out_dtype != torch.float32
                      and torch.promote_types(weight.dtype, out_dtype) == out_dtype)
        if M:
            _launch(gated_norm_fwd_kernel, M, _cfg(D), False, x_NHD, g_NHD, weight, y, r_M, M,
                    x_NHD.shape[1], x_NHD.stride(0), x_NHD.stride(1), g_NHD.stride(0),
                    g_NHD.stride(1), eps, **consts)
        ctx.save_for_backward(x_NHD, g_NHD, weight, r_M)
        ctx.consts, ctx.shapes = consts, (x.shape, gate.shape, gate.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        x_NHD, g_NHD, weight, r_M = ctx.saved_tensors
        (x_shape, g_shape, g_dtype), M, D = ctx.shapes, r_M.shape[0], x_NHD.shape[-1]
        dx = torch.empty(x_shape, device=dy.device, dtype=x_NHD.dtype)
        dgate = torch.empty(g_shape, device=dy.device, dtype=g_dtype)
        cfg = _cfg(D)
        partials = _partials(M, D, cfg, dy.device)
        if M:
            _launch(gated_norm_bwd_kernel, M, cfg, True, x_NHD, g_NHD, weight, r_M,
                    dy.contiguous(), dx, dgate, partials, M, x_NHD.shape[1], x_NHD.stride(0),
                    x_NHD.stride(1), g_NHD.stride(0), g_NHD.stride(1), **ctx.consts)
        dw = _dw(partials, weight) if ctx.needs_input_grad[2] else None
        return dx, dgate, dw, None, None


def why_not(x: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    """None when these kernels take x (and the other tensors: weight, gate, cos, sin), else
    why not."""
    D = x.shape[-1] if x.dim() else 0
    if not 1 <= D <= MAX_D:
        return f"rows of {D} values (the kernels take 1 to {MAX_D}, one tile a row)"
    for t in (x, *others):
        if t is not None and t.dtype not in DTYPES:
            return f"takes fp32, bf16 or fp16 tensors, got {t.dtype}"
    return None


def rms_norm_rows(x, weight, eps: float, unit_offset: bool):
    """ops.norm.rms_norm as one kernel each way."""
    return NormRows.apply(x, weight, float(eps), bool(unit_offset), None, None)


def norm_rope_rows(x_BSND, weight, eps: float, unit_offset: bool, cos, sin):
    """ops.norm.norm_rope as one kernel each way: cos/sin [S, R] or [B, S, R]."""
    R = cos.shape[-1]
    if R % 2 or not 0 < R <= x_BSND.shape[-1]:
        raise ValueError(f"norm_rows: {R} rotary dims of a {x_BSND.shape[-1]}-wide head")
    return NormRows.apply(x_BSND, weight, float(eps), bool(unit_offset), cos, sin)


def gated_rms_norm_rows(x, gate, weight, eps: float, dtype=None):
    """ops.norm.gated_rms_norm as one kernel each way."""
    if x.shape != gate.shape:
        raise ValueError(f"norm_rows: x {tuple(x.shape)} and gate {tuple(gate.shape)} differ")
    return GatedNormRows.apply(x, gate, weight, float(eps), dtype)
