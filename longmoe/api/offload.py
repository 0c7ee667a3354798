"""The policy's state between the device and the host, for a rollout engine that shares the GPUs
(a colocated vLLM or SGLang takes the memory while the trainer waits).

`move(pt, "host" | "device", params, optimizer)`:
  params     the model's parameters and buffers (FSDP2 shards, expert shards, fp32 masters
             where the model keeps them beside low-precision parameters); gradients, where a
             forward_backward left some, travel with their parameters
  optimizer  AdamW's moments (the step counts stay where torch keeps them)
The parameter objects stay the same (FSDP2 swaps a sharded parameter's storage in place, plain
parameters get new `.data`), so the optimizer's state and any reference a caller holds still
point at them. Host copies are made without blocking into page-locked memory and the move ends
with one synchronisation, so the host tensors are readable and a reload copies asynchronously;
after moving to the host the device's cached blocks are released for the other engine. Under
FSDP2's own CPU offload (parallel.cpu_offload) the shards and moments live on the host already
and nothing moves.
"""

from __future__ import annotations

import torch

from longmoe.errors import UserError

WHERE = ("host", "device")


def _move_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t if t.device == device else t.to(device, non_blocking=True)


def move(pt, where: str, params: bool = True, optimizer: bool = True) -> None:
    if where not in WHERE:
        raise UserError(f"move: where must be one of {', '.join(WHERE)}, got {where!r}")
    par = pt.run.parallel
    if par.fsdp and par.cpu_offload and pt.layout.dp_mesh is not None:
        return  # FSDP2's CPU offload keeps the shards and AdamW's moments on the host already
    target = torch.device("cpu") if where == "host" else pt.device
    with torch.no_grad():
        if params:
            pt.model.to(target, non_blocking=True)
            if pt.master is not None:
                for m in pt.master.parameters():
                    m.data = _move_tensor(m.data, target)
                    if m.grad is not None:
                        m.grad = _move_tensor(m.grad, target)
            pt._load = [_move_tensor(t, target) for t in pt._load]
            if pt._loss is not None:
                pt._loss = _move_tensor(pt._loss, target)
        if optimizer:
            for state in pt.optim.state.values():
                for k, v in state.items():
                    if torch.is_tensor(v) and k != "step":
                        state[k] = _move_tensor(v, target)
    if pt.backend.device_type != "cpu":
        pt.backend.synchronize()
        if where == "host":
            pt.backend.empty_cache()
    if params:
        pt.params_on_host = where == "host"
    if optimizer:
        pt.optimizer_on_host = where == "host"
