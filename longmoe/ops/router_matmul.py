"""The router's logits x W^T in fp32 from 16-bit operands, and their gradients (registry
"router_matmul", setting impl.router_matmul).

Legend: T tokens, H hidden, E experts.

Implementations:
  fp32   (reference; runs everywhere) casts x and W to fp32 (fp64 stays fp64) and multiplies; at
         impl.fp32_matmul "high" a GPU runs these GEMMs on TF32 (the backward's fp32 gradient
         rounded to 11 bits). Both keep x and W as they came for the backward, not their fp32
         casts (an fp32 copy of x is 4 bytes a token and hidden unit: 0.5 GiB a layer at 64K).
  mixed  bf16 operands on a device with a 16-bit GEMM that writes fp32 (torch.mm(...,
         out_dtype=float32)). Forward: one such GEMM. The product of two bf16 numbers is exact in
         fp32, so this is the fp32 GEMM of the same values up to summation order, without the
         casts. Backward at "high": the fp32 gradient g is split into two bf16 terms, hi = bf16(g)
         and lo = bf16(g - hi) (16 of fp32's 24 mantissa bits, finer than TF32's 11), stacked
         along the reduction for dx ([hi | lo] [W; W]) and along the rows for dW, so each
         gradient is one 16-bit GEMM. At "highest" the backward is the fp32 path's.

On one H200 at 64K tokens, H 2048, 256 experts (bench/router_gemm_probe.py): the fp32 GEMMs at
"high" take 0.59 / 0.28 / 0.67 ms (logits / dx / dW, casts included), the 16-bit GEMM with fp32
output 0.11 ms for the logits.
"""

from __future__ import annotations

import torch

from longmoe.ops.registry import Registry

ROUTER_MATMUL = Registry("router_matmul")

_native: dict[str, str | None] = {}  # device type -> None if mm(out_dtype=float32) runs, else why


def _native_reason(device: torch.device) -> str | None:
    if device.type not in _native:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            torch.mm(a, a, out_dtype=torch.float32)
            _native[device.type] = None
        except Exception as e:  # noqa: BLE001 - any failure means "not on this device"
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _native[device.type] = f"no bf16 GEMM with fp32 output on {device.type}: {first[:80]}"
    return _native[device.type]


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 a and b, as fp32: one 16-bit GEMM with fp32 output where the device has it,
    else the same products on fp32 casts (exact either way; only the order of the sums differs)."""
    if _native_reason(a.device) is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def split_bf16(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) in bf16 with hi + lo = g to about 2^-16 of |g| (fp32 g)."""
    hi = g.to(torch.bfloat16)
    return hi, (g - hi.float()).to(torch.bfloat16)


def _fp32_grads(ctx, g_TE, x_TH, w_EH):
    g = g_TE.to(torch.promote_types(x_TH.dtype, torch.float32))
    dx = (g @ w_EH.to(g.dtype)).to(x_TH.dtype) if ctx.needs_input_grad[0] else None
    dw = (g.t() @ x_TH.to(g.dtype)).to(w_EH.dtype) if ctx.needs_input_grad[1] else None
    return dx, dw


class _Fp32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)
        acc = torch.promote_types(x_TH.dtype, torch.float32)
        return torch.nn.functional.linear(x_TH.to(acc), w_EH.to(acc))

    @staticmethod
    def backward(ctx, g_TE):
        return _fp32_grads(ctx, g_TE, *ctx.saved_tensors)


class _MixedLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)
        return mm_fp32(x_TH, w_EH.t())

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        if torch.get_float32_matmul_precision() == "highest":
            return _fp32_grads(ctx, g_TE, x_TH, w_EH)
        dx, dw = split_grads(g_TE, x_TH, w_EH, *ctx.needs_input_grad)
        return (dx.to(x_TH.dtype) if dx is not None else None,
                dw.to(w_EH.dtype) if dw is not None else None)


def split_grads(g_TE, x_TH, w_EH, need_dx: bool = True, need_dw: bool = True):
    """(g W, g^T x) in fp32 from bf16 x and W: g as hi + lo bf16 terms, one GEMM each."""
    E = g_TE.shape[1]
    hi, lo = split_bf16(g_TE.float())
    dx = mm_fp32(torch.cat([hi, lo], 1), torch.cat([w_EH, w_EH], 0)) if need_dx else None
    dw = None
    if need_dw:
        d2 = mm_fp32(torch.cat([hi.t(), lo.t()], 0), x_TH)
        dw = d2[:E] + d2[E:]
    return dx, dw


def _mixed_check(x_TH, w_EH):
    if x_TH.dtype != torch.bfloat16 or w_EH.dtype != torch.bfloat16:
        return f"needs bf16 operands, got {x_TH.dtype} and {w_EH.dtype}"
    return _native_reason(x_TH.device)


@ROUTER_MATMUL.register("mixed", priority=10, check=_mixed_check)
def _mixed(x_TH, w_EH):
    return _MixedLogits.apply(x_TH, w_EH)


@ROUTER_MATMUL.register("fp32", priority=0, reference=True)
def _fp32(x_TH, w_EH):
    return _Fp32Logits.apply(x_TH, w_EH)


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x W^T in fp32 (fp64 for fp64 operands), differentiable in both."""
    return ROUTER_MATMUL.select(impl, x_TH, w_EH).fn(x_TH, w_EH)
