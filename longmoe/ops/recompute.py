"""Activation recompute: per-block policy `none | full` (selective arrives with issue D).

`full` stores only each block's input and re-runs the block's forward inside its backward, trading
~1/3 more FLOPs for activation memory, so a GPU can hold a longer local sequence.

Implementations (registry "recompute"):
  checkpoint  torch.utils.checkpoint, non-reentrant (composes with FSDP2 hooks and autograd
              collectives; the reentrant variant does not).
  none        store activations; the reference.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from longmoe.ops.registry import Registry

RECOMPUTE = Registry("recompute")
POLICIES = ("none", "full")


class Recompute(nn.Module):
    """Wraps one block; its forward re-runs in backward. Wrap before fully_shard."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kw):
        return checkpoint(self.block, *args, use_reentrant=False, **kw)


@RECOMPUTE.register("checkpoint", priority=10)
def _checkpoint(block: nn.Module) -> nn.Module:
    return Recompute(block)


@RECOMPUTE.register("none", priority=0, reference=True)
def _none(block: nn.Module) -> nn.Module:
    return block


def apply_recompute(block: nn.Module, policy: str, impl: str = "auto") -> nn.Module:
    if policy not in POLICIES:
        raise ValueError(f"recompute policy must be one of {POLICIES}, got {policy!r}")
    if policy == "none":
        return block
    name = "checkpoint" if impl == "auto" else impl
    return RECOMPUTE.select(name, block).fn(block)
