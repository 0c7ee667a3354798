"""The router's logits x W^T in fp32 from 16-bit operands, and their gradients (registry
"router_matmul", setting impl.router_matmul).

Legend: T tokens, H hidden, E experts.

Implementations:
  reference  (runs everywhere) casts x and W to fp32 (fp64 stays fp64) and multiplies; at
         impl.fp32_matmul "high" a GPU runs these GEMMs on TF32. It keeps x and W as they came for
         the backward, not their fp32 casts (an fp32 copy of x is 4 bytes a token and hidden
         unit: 0.5 GiB a layer at 64K tokens, H = 2048).
  mixed  bf16 operands on a device with a 16-bit GEMM that writes fp32 (torch.mm(...,
         out_dtype=float32)): the forward is one such GEMM, with no fp32 copy of x. A product of
         two bf16 numbers is exact in fp32, so only the accumulation differs from the fp32 GEMM
         (H200: 2.1e-6 relative to fp64, IEEE fp32 3.9e-7, TF32 3.3e-6). The backward is the
         fp32 path's: its gradient g is fp32, and a bf16 g would round it to 8 bits.

On one H200 at 64K tokens, H 2048, 256 experts (bench/router_gemm.py, casts included):
the logits take 0.58 ms at "high" (TF32) and 0.11 ms as the bf16 GEMM; the backward's dx and dW
0.27 and 0.67 ms at "high". Splitting g into two bf16 terms (hi + lo, 16 bits) for bf16 GEMMs
was measured too (dx 0.45, dW 0.58 ms): no faster, and its extra precision is lost in the bf16
gradients it produces, so the backward stays fp32.
"""

from __future__ import annotations

import torch

from longmoe.backends import active_backend
from longmoe.ops.registry import Registry

ROUTER_MATMUL = Registry("router_matmul", renamed={"fp32": "reference"})


def _native_reason(device: torch.device) -> str | None:
    return active_backend().fp32_output_gemm(device)


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for bf16 a and b, as fp32: one 16-bit GEMM with fp32 output where the device has it,
    else the same products on fp32 casts (exact either way; only the order of the sums differs)."""
    if _native_reason(a.device) is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _Fp32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)
        acc = torch.promote_types(x_TH.dtype, torch.float32)
        return torch.nn.functional.linear(x_TH.to(acc), w_EH.to(acc))

    @staticmethod
    def backward(ctx, g_TE):
        x_TH, w_EH = ctx.saved_tensors
        g = g_TE.to(torch.promote_types(x_TH.dtype, torch.float32))
        dx = (g @ w_EH.to(g.dtype)).to(x_TH.dtype) if ctx.needs_input_grad[0] else None
        dw = (g.t() @ x_TH.to(g.dtype)).to(w_EH.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw


class _MixedLogits(_Fp32Logits):
    """The reference's backward; only the forward differs."""

    @staticmethod
    def forward(ctx, x_TH, w_EH):
        ctx.save_for_backward(x_TH, w_EH)
        return mm_fp32(x_TH, w_EH.t())


def _mixed_check(x_TH, w_EH):
    if x_TH.dtype != torch.bfloat16 or w_EH.dtype != torch.bfloat16:
        return f"needs bf16 operands, got {x_TH.dtype} and {w_EH.dtype}"
    return _native_reason(x_TH.device)


@ROUTER_MATMUL.register("mixed", priority=10, check=_mixed_check)
def _mixed(x_TH, w_EH):
    return _MixedLogits.apply(x_TH, w_EH)


@ROUTER_MATMUL.register("reference", priority=0, reference=True)
def _reference(x_TH, w_EH):
    return _Fp32Logits.apply(x_TH, w_EH)


def router_logits(x_TH: torch.Tensor, w_EH: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x W^T in fp32 (fp64 for fp64 operands), differentiable in both."""
    return ROUTER_MATMUL.select(impl, x_TH, w_EH).fn(x_TH, w_EH)
