"""Mixed precision when FSDP2 is off: the model holds compute-dtype (bf16) parameters and
gradients, the optimizer steps fp32 master copies (the arrangement of Megatron's fp16/bf16
optimizer). With FSDP2 on, its MixedPrecisionPolicy does this job and this class is not used.
"""

from __future__ import annotations

import torch
from torch import nn


class MasterWeights:
    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        with torch.no_grad():
            for p in model.parameters():
                master = nn.Parameter(p.detach().to(torch.float32, copy=True))
                p.data = p.data.to(dtype)
                self.pairs.append((p, master))
        self._master_of = {id(p): m for p, m in self.pairs}

    def parameters(self) -> list[nn.Parameter]:
        return [m for _, m in self.pairs]

    def grad_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """The fp32 gradient the optimizer will apply for model parameter p."""
        return self._master_of[id(p)].grad

    @torch.no_grad()
    def grads_to_master(self):
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def master_to_model(self):
        for p, m in self.pairs:
            p.copy_(m)


@torch.no_grad()
def store_parameters_as(model: nn.Module, dtype: torch.dtype) -> None:
    """Store the model's floating-point parameters in `dtype` (a forward-only policy in the
    dtype its forward computes with: FSDP2's mixed precision casts to it at every gather, the
    fp32-master layout keeps the model's copy in it). Buffers keep their dtype and values. Under
    FSDP2, module.to swaps each sharded parameter in place and FSDP re-reads its shard, so this
    runs before the first forward."""
    buffers = [(m, n, b) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    model.to(dtype)
    for m, n, b in buffers:
        m._buffers[n] = b
