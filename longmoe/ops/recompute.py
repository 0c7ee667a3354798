"""Activation recompute: per-block policy `none | selective | full`.

`full` stores only each block's input and re-runs the whole block in its backward, trading ~1/3
more FLOPs for activation memory, so a GPU can hold a longer local sequence. `selective` keeps the
outputs of the matmul-class ops (projections, expert GEMMs, attention) and recomputes only the
memory-bound ops between them (norms, RoPE, activations, softmax, gathers): almost no extra FLOPs,
a smaller saving. `full` with `keep_attention` (parallel.keep_attention) recomputes a
full-attention block as two regions around its attention kernel and keeps the kernel's tensors
(q, k, v, output, log-sum-exp) and the output gate: at long context the kernel is the block's
most expensive forward op per byte it keeps (at 32K tokens on an H200, 12.8 ms for ~0.8 GiB).

Implementations (registry "recompute"):
  checkpoint  torch.utils.checkpoint, non-reentrant (composes with FSDP2 hooks and autograd
              collectives; the reentrant variant does not); `selective` through its
              selective-checkpoint contexts.
  reference   store activations (no recompute, whatever the policy).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from longmoe.ops.registry import Registry

RECOMPUTE = Registry("recompute", renamed={"none": "reference"})
POLICIES = ("none", "selective", "full")


def _saved_ops() -> set:
    """Ops whose outputs `selective` keeps: the FLOP-heavy ones."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_scaled_mm"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _selective_policy(saved, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _profiler_ops() -> set:
    """Profiler markers (record_function): FSDP2's hooks emit a different number of them in the
    recompute than in the forward (no all-gather to wait for the second time), and selective
    checkpointing matches every op by invocation count. They compute nothing: run them through."""
    prof = getattr(torch.ops, "profiler", None)
    out = set()
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        op = getattr(prof, name, None) if prof is not None else None
        if op is not None:
            out.update(getattr(op, o) for o in op.overloads())
    return out


def _selective_contexts(policy_fn):
    """torch's selective-checkpoint modes, with profiler markers passed through untracked."""
    try:
        from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode
    except ImportError:  # a torch without these classes: its own contexts (markers tracked)
        return create_selective_checkpoint_contexts(policy_fn)
    skip = _profiler_ops()

    class Caching(_CachingTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in skip:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    class Cached(_CachedTorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in skip:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    # The storage's shape differs across torch versions (defaultdict of lists in 2.11, of dicts
    # later): take the one torch's own contexts build. torch 2.11 also requires
    # allow_cache_entry_mutation; later versions default it (same meaning).
    storage = create_selective_checkpoint_contexts(policy_fn)[0].storage
    extra = ({"allow_cache_entry_mutation": False}
             if "allow_cache_entry_mutation" in inspect.signature(Cached.__init__).parameters else {})
    return Caching(policy_fn, storage), Cached(policy_fn, storage, **extra)


class Recompute(nn.Module):
    """Wraps one block; its forward re-runs (all of it, or the cheap ops) in backward. Wrap
    before fully_shard. `keep_attention` (full policy): a block that offers
    `forward_around_attention` (a full-attention layer) keeps its attention kernel's tensors
    and recomputes only the two regions around it."""

    def __init__(self, block: nn.Module, selective: bool = False, keep_attention: bool = False):
        super().__init__()
        self.block = block
        self.selective = selective
        self.keep_attention = (keep_attention and not selective
                               and getattr(block, "has_attention_kernel", False))

    def forward(self, *args, **kw):
        if self.keep_attention:
            return self.block.forward_around_attention(*args, recompute=_recomputed, **kw)
        if self.selective:
            ctx = functools.partial(_selective_contexts,
                                    functools.partial(_selective_policy, _saved_ops()))
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=ctx, **kw)
        return checkpoint(self.block, *args, use_reentrant=False, **kw)


def _recomputed(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


@RECOMPUTE.register("checkpoint", priority=10)
def _checkpoint(block: nn.Module, policy: str = "full", keep_attention: bool = False) -> nn.Module:
    return Recompute(block, selective=policy == "selective", keep_attention=keep_attention)


@RECOMPUTE.register("reference", priority=0, reference=True)
def _reference(block: nn.Module, policy: str = "full", keep_attention: bool = False) -> nn.Module:
    return block


def apply_recompute(block: nn.Module, policy: str, impl: str = "auto",
                    keep_attention: bool = False) -> nn.Module:
    """`keep_attention`: under `full`, full-attention blocks keep their attention kernel's
    tensors (parallel.keep_attention); other blocks and policies are unaffected."""
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    if policy == "none":
        return block
    name = "checkpoint" if impl == "auto" else impl
    return RECOMPUTE.select(name, block).fn(block, policy, keep_attention=keep_attention)
