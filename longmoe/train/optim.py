"""AdamW stepped on the local shards of DTensor parameters.

torch.optim.AdamW given FSDP2's DTensor parameters hands whole lists of DTensors to its fused or
foreach kernels, and DTensor's dispatch then works out a sharding for every tensor of every list
on the host, each step, while the device waits (the step follows the gradient clip's host read).
For the 653 parameters of the 40-layer Qwen3.5 preset on a one-rank mesh, a fused step took
17.5 ms of host time through DTensor and 8.2 ms here (foreach: 14.9 and 10.1; two busy CPU cores,
results/cpu/adamw_host.json, bench/adamw_host.py).

The update is elementwise: each rank applying it to its local shards does the same arithmetic
DTensor's dispatch would have done. LocalShardAdamW is torch's AdamW with its state and param
groups as torch keeps them (DTensor moments, the same state_dict and checkpoints); only step()
unwraps the tensors before calling torch's functional AdamW. A parameter whose gradient is
sharded differently from it (or is a partial sum) is stepped through DTensor as before.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw


def _scalar_dtype() -> torch.dtype:
    # The dtype torch's Adam gives its step counts.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _same_layout(p: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether p and its gradient can be stepped on their local tensors: both plain, or both
    DTensors on one mesh with the same placements, none of them a pending sum."""
    if not isinstance(p, DTensor) and not isinstance(g, DTensor):
        return True
    if not (isinstance(p, DTensor) and isinstance(g, DTensor)):
        return False
    return (p.device_mesh == g.device_mesh and p.placements == g.placements
            and not any(pl.is_partial() for pl in p.placements))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class LocalShardAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, state and checkpoints) whose step runs on the local
    tensors of DTensor parameters. Plain tensors are stepped as torch's AdamW steps them."""

    def _state_of(self, p: torch.Tensor, group: dict) -> dict:
        """p's state, created as torch's AdamW creates it on the first step."""
        state = self.state[p]
        if not state:
            on_device = group["capturable"] or group["fused"]
            state["step"] = (torch.zeros((), dtype=_scalar_dtype(), device=p.device) if on_device
                             else torch.tensor(0.0, dtype=_scalar_dtype()))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        if any(g["differentiable"] for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            local, dispatched = [[] for _ in range(6)], [[] for _ in range(6)]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self._state_of(p, group)
                own = _same_layout(p, p.grad)
                lists = local if own else dispatched
                unwrap = _local if own else (lambda t: t)
                lists[0].append(unwrap(p))
                lists[1].append(unwrap(p.grad))
                lists[2].append(unwrap(state["exp_avg"]))
                lists[3].append(unwrap(state["exp_avg_sq"]))
                if group["amsgrad"]:
                    lists[4].append(unwrap(state["max_exp_avg_sq"]))
                lists[5].append(_local(state["step"]) if own else state["step"])
            for lists in (local, dispatched):
                if lists[0]:
                    self._apply(group, *lists)
        return loss

    def _apply(self, group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps):
        beta1, beta2 = group["betas"]
        adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
              foreach=group["foreach"], capturable=group["capturable"],
              differentiable=False, fused=group["fused"],
              grad_scale=getattr(self, "grad_scale", None),
              found_inf=getattr(self, "found_inf", None),
              has_complex=any(torch.is_complex(p) for p in params),
              amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
