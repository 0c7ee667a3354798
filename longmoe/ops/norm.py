"""The model's RMS norms behind one interface (registry "norm", setting impl.norm): RMSNorm
(`rms_norm`), the q/k norm followed by partial RoPE (`norm_rope`) and the Gated DeltaNet
output's gated norm (`gated_rms_norm`).

Implementations:
  triton     one kernel each way per norm (ops/kernels/norm_rows.py), fp32 inside, the eager
             chain's roundings kept; tiles per vendor from backends. No torch.compile: nothing
             to compile on a run's first step. "auto" takes it on GPUs; on CPU only when named
             (under TRITON_INTERPRET=1, for tests).
  compiled   the eager functions under torch.compile (ops/compiled.py): inductor fuses each
             into one Triton kernel each way, compiled on first use (and per new shape where
             the token dim is not symbolic). Where torch.compile runs: GPUs, or any device
             under ops.compiled.forced / LONGMOE_FORCE_COMPILE (the CPU tests of the compiled
             graphs).
  reference  the eager functions below (longmoe.model.layers and longmoe.model.deltanet,
             where they were first, re-export them); the CPU path.

"auto" on a GPU: triton (compiled where the kernels decline the tensors, e.g. fp64); on CPU:
compiled when forced, else the reference, as before the kernels existed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longmoe.ops.compiled import compile_unavailable, compiled
from longmoe.ops.registry import Registry

NORM = Registry("norm")


def rms_norm(x, weight, eps: float, unit_offset: bool):
    """x / rms(x) * weight (or * (1 + weight) with `unit_offset`), in x's dtype. Normalised in
    fp32: a bf16 mean of squares loses ~3 digits at H=2048; fp64 stays fp64 (references)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(xf.dtype) + 1.0 if unit_offset else weight.to(xf.dtype)
    return (y * w).to(x.dtype)


def apply_rope(x_BSND, cos, sin):
    """Rotate the first R dims of each head; the remaining D - R pass through (partial rotary).
    cos/sin: [S, R] or [B, S, R] (rope_cos_sin)."""
    r = cos.shape[-1]
    rot, rest = x_BSND[..., :r], x_BSND[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = (t[..., None, :] if t.dim() == 3 else t[None, :, None, :] for t in (cos, sin))
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def norm_rope(x_BSND, weight, eps: float, unit_offset: bool, cos, sin):
    """rms_norm over the head dim, then apply_rope."""
    return apply_rope(rms_norm(x_BSND, weight, eps, unit_offset), cos, sin)


def gated_rms_norm(x, gate, weight, eps: float, dtype=None):
    """RMSNorm(x) * weight * SiLU(gate) in the dtype of `gate`; x is first rounded to `dtype`
    when given (the core's fp32 output enters the norm as the model dtype, as in HF)."""
    x = x if dtype is None else x.to(dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


class ReferenceNorms:
    rms_norm = staticmethod(rms_norm)
    norm_rope = staticmethod(norm_rope)
    gated_rms_norm = staticmethod(gated_rms_norm)


class CompiledNorms:
    """The token dims are symbolic in the graphs (ops.compiled's `token_dims`): packed rows of
    any length share them."""

    @staticmethod
    def rms_norm(x, weight, eps, unit_offset):
        return compiled(rms_norm, token_dims={0: -2})(x, weight, eps, unit_offset)

    @staticmethod
    def norm_rope(x_BSND, weight, eps, unit_offset, cos, sin):
        # cos/sin: [S, R] or [B, S, R]
        return compiled(norm_rope, token_dims={0: 1, 4: -2, 5: -2})(x_BSND, weight, eps,
                                                                    unit_offset, cos, sin)

    @staticmethod
    def gated_rms_norm(x, gate, weight, eps, dtype=None):
        return compiled(gated_rms_norm, token_dims={0: 1, 1: 1})(x, gate, weight, eps, dtype)


class TritonNorms:
    @staticmethod
    def rms_norm(x, weight, eps, unit_offset):
        from longmoe.ops.kernels.norm_rows import rms_norm_rows
        return rms_norm_rows(x, weight, eps, unit_offset)

    @staticmethod
    def norm_rope(x_BSND, weight, eps, unit_offset, cos, sin):
        from longmoe.ops.kernels.norm_rows import norm_rope_rows
        return norm_rope_rows(x_BSND, weight, eps, unit_offset, cos, sin)

    @staticmethod
    def gated_rms_norm(x, gate, weight, eps, dtype=None):
        from longmoe.ops.kernels.norm_rows import gated_rms_norm_rows
        return gated_rms_norm_rows(x, gate, weight, eps, dtype)


def _triton_check(x: torch.Tensor, *others: torch.Tensor | None, named: bool = True):
    from longmoe.ops.kernels import triton_ready
    why = triton_ready(x.device)
    if why:
        return why
    if x.device.type == "cpu" and not named:
        return "on CPU the interpreter runs them only when named (tests); auto keeps the eager form"
    if any(t is not None and t.requires_grad for t in others[2:]):  # cos/sin
        return "cos/sin that require gradients (the kernels return none for them)"
    from longmoe.ops.kernels.norm_rows import why_not
    return why_not(x, *others)


def _compiled_check(x: torch.Tensor, *others, named: bool = True):
    return compile_unavailable(x.device)


NORM.register("triton", priority=10, check=_triton_check)(TritonNorms)
NORM.register("compiled", priority=5, check=_compiled_check)(CompiledNorms)
NORM.register("reference", priority=0, reference=True)(ReferenceNorms)


def norm_ops(impl: str, x: torch.Tensor, weight: torch.Tensor, gate=None, cos=None, sin=None):
    """The implementation's norms for these tensors: `impl` "auto" or a name (which fails with
    ImplUnavailable if it cannot run on them)."""
    return NORM.select(impl, x, weight, gate, cos, sin, named=impl != "auto").fn
