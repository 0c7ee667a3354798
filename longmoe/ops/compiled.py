"""torch.compile for the plain-PyTorch pieces that run as chains of small elementwise ops on a
GPU, where a run asks for them. Inductor turns each chain into fused Triton kernels for
whichever GPU is present; the eager function stays the reference and the CPU path. One compiled
callable per function, shape mode and process.

What runs compiled, and when: the RMS norms (rms_norm, norm_rope, gated_rms_norm) only with
`impl.norm=compiled` (ops/norm.py; by default GPUs run our Triton kernels, ops/kernels/
norm_rows.py, which compile nothing on a run's first step); the causal conv where our conv
kernels cannot run or beside the compiled core; the Gated DeltaNet core's batched parts with
`impl.gated_delta: chunked_compiled`; FlexAttention with `impl.attention: flex` (or auto where
varlen cannot run). With the defaults on a GPU with Triton none of them runs. The GPU step time
and first-step compile time of the Triton norms against these compiled ones are not yet measured.

Shapes are static (`dynamic=False`) except the dims a caller names in `token_dims`, which
dynamo then traces as one symbolic size (`torch._dynamo.maybe_mark_dynamic`), so packed rows of
a new length reuse the graph instead of compiling it again. Per compiled function, what a
packed run compiles per row length:

  rms_norm, norm_rope   (impl.norm=compiled) token dim named: one graph each way for every
                        length (norm_rope one per head count: q's and k's)
  gated_rms_norm        (impl.norm=compiled) token dim named: one graph each way
  causal_conv_silu      token dims of x and the packed-row history named (the halo's K-1
                        tokens stay static): one graph each way, two with context
                        parallelism's halo (a halo or none). GPUs run it beside the compiled
                        core; elsewhere the Triton conv (ops/kernels/causal_conv.py) takes its
                        place
  _chunk_terms,         static: one graph each way per row length (the compiled Gated DeltaNet
  _chunk_output         core, `impl.gated_delta: chunked_compiled`). Its math is not per token:
                        it pads T to whole 64-token chunks, and every reshape, batched GEMM and
                        triangular solve takes the chunk count; inductor's GPU kernels for a
                        symbolic chunk count have been neither compiled nor timed on a GPU
                        (the static core's: 68.6 ms at 64K tokens, ops/gated_delta.py)
  flex_attention        static: one forward graph per row length, whatever its samples
                        (`impl.attention` flex, GPUs; varlen comes first): attention is not per
                        token, its block mask counts 128-token blocks, and torch has no
                        FlexAttention backward on CPU to check a symbolic form against

Counted on CPU through the partitioner inductor uses (tests/test_compiled_rows.py: the tiny
hybrid model, forward and backward under full recompute, packed rows of 128, 192 and 256 tokens;
flex's forward alone); GPU compile times per graph have not been measured. A static-shaped piece
keeps up to RECOMPILE_LIMIT lengths. Torch's automatic dynamic shapes (`dynamic=None`, every dim
that changes between calls made symbolic) stopped inside Triton 3.6's compiler in a packed run
on an H200, so the model does not ask for it.
LONGMOE_COMPILE_SHAPES=static in the environment ignores `token_dims`: every row length then
compiles its own graphs (the comparison for the first step's compile time in docs/packing.md).
The conv's symbolic row length is checked on CPU only (inductor's CPU code included,
tests/test_compiled_shapes.py); this switch gives it one graph per length again.

`forced(backend)` (or LONGMOE_FORCE_COMPILE=<backend> in the environment, which reaches spawned
ranks) runs the compiled path on any device with another torch.compile backend: tests use it on
CPU with "aot_eager_decomp_partition", which partitions forward and backward (what gets saved)
the way inductor does, without generating kernels. On CPU the norms' `impl.norm` auto then takes
the compiled norms, as it did before they had kernels of their own."""

from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch

_CACHE: dict[tuple, Callable] = {}
# Graphs one compiled function may keep (dynamo's default is 8, past which every new shape runs
# eagerly): static-shaped pieces meet one length per packed row length, up to
# data.max_tokens_per_micro_batch / data.row_multiple of them (32 at a 32K budget in 1K steps).
RECOMPILE_LIMIT = 64
_FORCED: list[str] = []


def _forced() -> str | None:
    return _FORCED[-1] if _FORCED else os.environ.get("LONGMOE_FORCE_COMPILE") or None


def static_shapes() -> bool:
    """True when LONGMOE_COMPILE_SHAPES=static asks for one graph per row length."""
    return os.environ.get("LONGMOE_COMPILE_SHAPES", "") == "static"


def compile_unavailable(device: torch.device) -> str | None:
    """None when compiled pieces can run on `device`, else why not. LONGMOE_COMPILE=0 turns
    them all off (eager everywhere: for debugging, or a GPU where inductor misbehaves)."""
    if _forced():
        return None
    if os.environ.get("LONGMOE_COMPILE", "1") == "0":
        return "turned off by LONGMOE_COMPILE=0"
    if device.type == "cpu":
        return "compiled pieces are for GPUs (CPU runs the eager form)"
    try:
        import triton  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"torch.compile needs Triton here ({type(e).__name__})"
    return None


def compiled(fn: Callable, dynamic: bool | None = False,
             token_dims: dict[int, int] | None = None) -> Callable:
    """`fn` under torch.compile. `token_dims` {positional argument: dim}: the dims that hold the
    tokens of a row, traced as one symbolic size (a tensor argument only; None is skipped)."""
    backend = _forced() or "inductor"
    key = (fn, backend, dynamic)
    if key not in _CACHE:
        import torch._dynamo.config as dynamo_config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
        _CACHE[key] = torch.compile(fn, backend=backend, dynamic=dynamic)
    compiled_fn = _CACHE[key]
    if not token_dims:
        return compiled_fn
    dims = tuple(token_dims.items())

    def call(*args, **kwargs):
        if not static_shapes():
            for i, d in dims:
                t = args[i] if i < len(args) else None
                # a length of 1 stays static: dynamo specialises sizes 0 and 1 anyway
                if isinstance(t, torch.Tensor) and t.shape[d] > 1:
                    torch._dynamo.maybe_mark_dynamic(t, d % t.dim())
        return compiled_fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def forced(backend: str):
    _FORCED.append(backend)
    try:
        yield
    finally:
        _FORCED.pop()
