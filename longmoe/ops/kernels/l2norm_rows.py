"""Fused per-row L2 normalisation with a scale, forward and backward in one pass each: the q/k
norm of the Triton Gated DeltaNet core. Vendor-neutral; tiles come from the backend's kernel
table ("l2norm_rows").

Legend: M rows (every leading dim flattened), D the normalised last dim.

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
def l2norm_rows_fwd_kernel(x_ptr, y_ptr, r_ptr, M, scale, eps, D: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr):
    # int64 rows: M * D passes 2^31 at long sequences with many heads
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < M
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 1) + eps)
    y = (x * r[:, None]) * scale
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(r_ptr + rows, r, mask=rmask)


@triton.jit
def l2norm_rows_bwd_kernel(x_ptr, r_ptr, dy_ptr, dx_ptr, M, scale, D: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    rmask = rows < M
    offs = rows[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32)
    r = tl.load(r_ptr + rows, mask=rmask, other=0.0)
    g = tl.load(dy_ptr + offs, mask=rmask[:, None], other=0.0).to(tl.float32) * scale
    y = x * r[:, None]
    # the projection term: moving x along itself does not change y
    dx = r[:, None] * (g - y * tl.sum(g * y, 1)[:, None])
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=rmask[:, None])


def _grid(M: int, cfg: dict):
    return (triton.cdiv(M, cfg["BLOCK_ROWS"]),)


class L2NormRows(torch.autograd.Function):
    """Saves x in its own dtype and r (4 bytes a row), where the eager chain saves an fp32 copy
    of x."""

    @staticmethod
    def forward(ctx, x, scale: float, out_dtype: torch.dtype, eps: float):
        D = x.shape[-1]
        x_MD = x.reshape(-1, D).contiguous()  # the kernels address rows as row * D
        M = x_MD.shape[0]
        y_MD = torch.empty(M, D, device=x.device, dtype=out_dtype)
        r_M = torch.empty(M, device=x.device, dtype=torch.float32)
        cfg = active_backend().kernel_config(TABLE_KEY)
        if M:
            l2norm_rows_fwd_kernel[_grid(M, cfg)](
                x_MD, y_MD, r_M, M, scale, eps, D=D, BLOCK_ROWS=cfg["BLOCK_ROWS"],
                **active_backend().launch_options(cfg, "num_warps"))
        ctx.save_for_backward(x_MD, r_M)
        ctx.scale, ctx.shape = scale, x.shape
        return y_MD.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x_MD, r_M = ctx.saved_tensors
        M, D = x_MD.shape
        dy_MD = dy.reshape(-1, D).contiguous()
        dx_MD = torch.empty_like(x_MD)
        cfg = active_backend().kernel_config(TABLE_KEY)
        if M:
            l2norm_rows_bwd_kernel[_grid(M, cfg)](
                x_MD, r_M, dy_MD, dx_MD, M, ctx.scale, D=D, BLOCK_ROWS=cfg["BLOCK_ROWS"],
                **active_backend().launch_options(cfg, "num_warps"))
        return dx_MD.view(ctx.shape), None, None, None


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
