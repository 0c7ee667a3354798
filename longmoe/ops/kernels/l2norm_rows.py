"""Fused per-row L2 normalisation with a scale, forward and backward in one pass each: the q/k
norm of the Triton Gated DeltaNet core. Vendor-neutral; tiles come from the backend's kernel
table ("l2norm_rows").

Legend: D the normalised last dim, H the one before it (heads), N the rest flattened (tokens);
M = N * H rows.

  forward:   r = rsqrt(sum(x^2) + eps),  y = (x * r) * scale        r saved, fp32, one per row
  backward:  y = x * r,  g = dy * scale,  dx = r * (g - y * sum(g * y))

All arithmetic in fp32 whatever the storage dtypes, in the order of the eager chain it replaces
(L2Norm on x.float(), then * scale, then the cast to the output dtype), so the two agree up to
the order of the fp32 row sums. Eager, that chain is ~15 memory passes over q and k (fp32 copies,
pow, sum, rsqrt, mul, scale, cast and the backward's), here one read and one write each way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longmoe.backends import active_backend

TABLE_KEY = "l2norm_rows"


@triton.jit
def _offsets(rows, H, stride_n, stride_h, D: tl.constexpr):
    """Of row m in x, and in the contiguous y, dy, dx. x's row m is (n, h) = (m // H, m % H): q
    and k arrive as column slices of the projection's output, heads stride_h apart and tokens
    stride_n, read in place rather than copied. The row index is int32 (the launcher checks M),
    its division too (64-bit division is a long routine on some GPUs: it spilled scalar registers
    in the compile check); the offsets are int64, as a long packed batch's pass 2^31."""
    n, h = (rows // H).to(tl.int64), (rows % H).to(tl.int64)
    cols = tl.arange(0, D)[None, :]
    return (n * stride_n + h * stride_h)[:, None] + cols, rows.to(tl.int64)[:, None] * D + cols


@triton.jit
def l2norm_rows_fwd_kernel(x_ptr, y_ptr, r_ptr, M, H, stride_n, stride_h, scale, eps,
                           D: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < M
    x_offs, offs = _offsets(rows, H, stride_n, stride_h, D)
    x = tl.load(x_ptr + x_offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) + eps)
    y = (x * r[:, None]) * scale
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(r_ptr + rows, r, mask=rmask)


@triton.jit
def l2norm_rows_bwd_kernel(x_ptr, r_ptr, dy_ptr, dx_ptr, M, H, stride_n, stride_h, scale,
                           D: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < M
    x_offs, offs = _offsets(rows, H, stride_n, stride_h, D)
    x = tl.load(x_ptr + x_offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    g = tl.load(dy_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32) * scale
    y = x * r[:, None]
    # the projection term: moving x along itself does not change y
    dx = r[:, None] * (g - y * tl.sum(g * y, 1)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=rmask[:, None])


def _as_NHD(x):
    """x as [N, H, D] with unit column stride, a view where the leading dims merge (a column
    slice of a contiguous tensor does), else a contiguous copy."""
    D, H = x.shape[-1], x.shape[-2] if x.dim() > 1 else 1
    if x.stride(-1) == 1:
        try:
            return x.view(-1, H, D)
        except RuntimeError:
            pass
    return x.contiguous().view(-1, H, D)


def _launch(kernel, M, cfg, *args, **consts):
    if M + cfg["BLOCK_ROWS"] >= 2**31:  # the kernels' int32 row index
        raise ValueError(f"l2norm_rows: {M} rows, more than int32 row indices hold")
    kernel[(triton.cdiv(M, cfg["BLOCK_ROWS"]),)](
        *args, **consts, BLOCK_ROWS=cfg["BLOCK_ROWS"],
        **active_backend().launch_options(cfg, "num_warps"))


class L2NormRows(torch.autograd.Function):
    """Saves x as it came (in its own dtype; a view keeps the tensor it slices alive, which the
    layer holds anyway) and r (4 bytes a row), where the eager chain saves an fp32 copy of x."""

    @staticmethod
    def forward(ctx, x, scale: float, out_dtype: torch.dtype, eps: float):
        D = x.shape[-1]
        M = x.numel() // D
        y = torch.empty(x.shape, device=x.device, dtype=out_dtype)
        r_M = torch.empty(M, device=x.device, dtype=torch.float32)
        x_NHD = _as_NHD(x) if M else x
        if M:
            _launch(l2norm_rows_fwd_kernel, M, active_backend().kernel_config(TABLE_KEY), x_NHD,
                    y, r_M, M, x_NHD.shape[1], x_NHD.stride(0), x_NHD.stride(1), scale, eps, D=D)
        ctx.save_for_backward(x_NHD, r_M)
        ctx.scale, ctx.shape = scale, x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x_NHD, r_M = ctx.saved_tensors
        M, D = r_M.shape[0], ctx.shape[-1]
        dx = torch.empty(ctx.shape, device=dy.device, dtype=x_NHD.dtype)
        if M:
            _launch(l2norm_rows_bwd_kernel, M, active_backend().kernel_config(TABLE_KEY), x_NHD,
                    r_M, dy.contiguous(), dx, M, x_NHD.shape[1], x_NHD.stride(0),
                    x_NHD.stride(1), ctx.scale, D=D)
        return dx, None, None, None


def l2norm_rows(x: torch.Tensor, scale: float = 1.0, out_dtype: torch.dtype | None = None,
                eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(|x|^2 + eps) * scale over the last dim, computed in fp32 and stored in
    `out_dtype` (x's by default). The last dim must be a power of two >= 16 (one tile per row)."""
    D = x.shape[-1]
    if D < 16 or D & (D - 1):
        raise ValueError(f"l2norm_rows: last dim {D} is not a power of two >= 16")
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    out_dtype = out_dtype or x.dtype
    if x.dtype not in dtypes or out_dtype not in dtypes:
        raise ValueError(f"l2norm_rows: takes fp32, bf16 or fp16, got {x.dtype} -> {out_dtype}")
    return L2NormRows.apply(x, float(scale), out_dtype, float(eps))
