"""Routes of one MoE layer whose experts are all on this rank (EP = 1, no chunk pipeline), built
on the device with no host synchronisation.

Legend: T tokens, K top-k, A = T*K assignments, E experts.

With every expert local nothing is sent, so the host needs no count: the grouped GEMM takes each
expert's end row as a device tensor (torch._grouped_mm's `offs`), the row gathers take the sort
order and its inverse. plan_routes (routing.py) reads its counts back to the host because the
all-to-all's split sizes live there; at EP = 1 that read only drains the device queue once per
MoE layer (twice a step under full recompute) and leaves the device idle while the host issues
the layer's next small kernels (results/h200/sync_cost.json: 0.07 ms after the read at 16K
tokens, 0.28 ms at 64K; the rest of the layer's idle time, 0.9 to 1.6 ms a layer step, follows
the host's pace after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from longmoe.parallel.routing import check_expert_index, count_ids, inverse_permutation


@dataclass
class LocalRoutes:
    order_A: torch.Tensor  # assignments sorted by expert (stable: token order within an expert)
    inv_A: torch.Tensor    # the row of each (token, k) in that order
    offs_E: torch.Tensor   # int32 end row of each expert's rows, on the device


def local_routes(idx_TK: torch.Tensor, num_experts: int) -> LocalRoutes:
    """The same order as plan_routes(idx_TK, num_experts, 1) and its group ends, without reading
    anything back to the host."""
    check_index_on_device(idx_TK, num_experts)
    key_A = idx_TK.reshape(-1).clamp(0, num_experts - 1)
    order_A = torch.argsort(key_A, stable=True)
    offs_E = count_ids(key_A, num_experts).cumsum(0).to(torch.int32)
    return LocalRoutes(order_A, inverse_permutation(order_A), offs_E)


def check_index_on_device(idx_TK: torch.Tensor, num_experts: int):
    """An expert id outside [0, E) (a router bug) is an error naming the value on the CPU, where
    reading it costs nothing; an accelerator asserts on the device instead of synchronising."""
    if idx_TK.device.type == "cpu":
        check_expert_index(idx_TK, num_experts)
    else:
        torch._assert_async(((idx_TK >= 0) & (idx_TK < num_experts)).all(),
                            "routing produced an expert index outside [0, num_experts)")
