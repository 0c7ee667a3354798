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
  reference  the eager functions (longmoe.model.layers.rms_norm and norm_rope,
             longmoe.model.deltanet.gated_rms_norm); the CPU path.

"auto" on a GPU: triton (compiled where the kernels decline the tensors, e.g. fp64); on CPU:
compiled when forced, else the reference, as before the kernels existed.
"""

from __future__ import annotations

import torch

from longmoe.ops.registry import Registry

NORM = Registry("norm")


class ReferenceNorms:
    @staticmethod
    def rms_norm(x, weight, eps, unit_offset):
        from longmoe.model.layers import rms_norm
        return rms_norm(x, weight, eps, unit_offset)

    @staticmethod
    def norm_rope(x_BSND, weight, eps, unit_offset, cos, sin):
        from longmoe.model.layers import norm_rope
        return norm_rope(x_BSND, weight, eps, unit_offset, cos, sin)

    @staticmethod
    def gated_rms_norm(x, gate, weight, eps, dtype=None):
        from longmoe.model.deltanet import gated_rms_norm
        return gated_rms_norm(x, gate, weight, eps, dtype)


class CompiledNorms:
    """The token dims are symbolic in the graphs (ops.compiled's `token_dims`): packed rows of
    any length share them."""

    @staticmethod
    def rms_norm(x, weight, eps, unit_offset):
        from longmoe.model.layers import rms_norm
        from longmoe.ops.compiled import compiled
        return compiled(rms_norm, token_dims={0: -2})(x, weight, eps, unit_offset)

    @staticmethod
    def norm_rope(x_BSND, weight, eps, unit_offset, cos, sin):
        from longmoe.model.layers import norm_rope
        from longmoe.ops.compiled import compiled
        # cos/sin: [S, R] or [B, S, R]
        return compiled(norm_rope, token_dims={0: 1, 4: -2, 5: -2})(x_BSND, weight, eps,
                                                                    unit_offset, cos, sin)

    @staticmethod
    def gated_rms_norm(x, gate, weight, eps, dtype=None):
        from longmoe.model.deltanet import gated_rms_norm
        from longmoe.ops.compiled import compiled
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
    from longmoe.ops.compiled import compile_unavailable
    return compile_unavailable(x.device)


NORM.register("triton", priority=10, check=_triton_check)(TritonNorms)
NORM.register("compiled", priority=5, check=_compiled_check)(CompiledNorms)
NORM.register("reference", priority=0, reference=True)(ReferenceNorms)


def norm_ops(impl: str, x: torch.Tensor, weight: torch.Tensor, gate=None, cos=None, sin=None):
    """The implementation's norms for these tensors: `impl` "auto" or a name (which fails with
    ImplUnavailable if it cannot run on them)."""
    return NORM.select(impl, x, weight, gate, cos, sin, named=impl != "auto").fn
