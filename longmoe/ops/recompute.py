"""Activation recompute: per-block policy `none | selective | full`.

`full` stores only each block's input and re-runs the whole block in its backward, trading ~1/3
more FLOPs for activation memory, so a GPU can hold a longer local sequence. `selective` keeps the
outputs of the matmul-class ops (projections, expert GEMMs, attention) and recomputes only the
memory-bound ops between them (norms, RoPE, activations, softmax, gathers): almost no extra FLOPs,
a smaller saving.

Implementations (registry "recompute"):
  checkpoint  torch.utils.checkpoint, non-reentrant (composes with FSDP2 hooks and autograd
              collectives; the reentrant variant does not); `selective` through its
              selective-checkpoint contexts.
  none        store activations; the reference.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from longmoe.ops.registry import Registry

RECOMPUTE = Registry("recompute")
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


class Recompute(nn.Module):
    """Wraps one block; its forward re-runs (all of it, or the cheap ops) in backward. Wrap
    before fully_shard."""

    def __init__(self, block: nn.Module, selective: bool = False):
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, *args, **kw):
        if self.selective:
            ctx = functools.partial(create_selective_checkpoint_contexts,
                                    functools.partial(_selective_policy, _saved_ops()))
            return checkpoint(self.block, *args, use_reentrant=False, context_fn=ctx, **kw)
        return checkpoint(self.block, *args, use_reentrant=False, **kw)


@RECOMPUTE.register("checkpoint", priority=10)
def _checkpoint(block: nn.Module, policy: str = "full") -> nn.Module:
    return Recompute(block, selective=policy == "selective")


@RECOMPUTE.register("none", priority=0, reference=True)
def _none(block: nn.Module, policy: str = "full") -> nn.Module:
    return block


def apply_recompute(block: nn.Module, policy: str, impl: str = "auto") -> nn.Module:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    if policy == "none":
        return block
    name = "checkpoint" if impl == "auto" else impl
    return RECOMPUTE.select(name, block).fn(block, policy)
