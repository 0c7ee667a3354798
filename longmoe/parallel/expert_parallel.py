"""Chunked expert parallelism: dispatch tokens to the ranks owning their experts, run the grouped
expert GEMMs, combine the results back; the layer's tokens are split into `chunks` pieces.

Legend: T tokens, t tokens in a chunk, K top-k, A = t*K assignments, H hidden, E experts,
L local experts (E / ep), S ranks in the EP group, C chunks.

Expert ownership is contiguous: EP rank r owns experts [r*L, (r+1)*L). Routing for all chunks is
planned at once so the layer pays one host synchronisation (the split sizes all_to_all_single
needs on the host), not one per chunk. The chunks run one after another here; issue C overlaps one
chunk's all-to-all with another's GEMMs on a communication stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def all_to_all(x, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class RoutePlan:
    bounds: list[tuple[int, int]]    # token range of each chunk
    send: list[list[int]]            # per chunk: rows sent to each EP rank
    recv: list[list[int]]            # per chunk: rows received from each EP rank
    expert_rows: list[list[int]]     # per chunk: rows for each local expert (all sources)
    recv_SL: list[torch.Tensor]      # per chunk: [S, L] rows per (source, local expert), on device


def chunk_bounds(num_tokens: int, chunks: int) -> list[tuple[int, int]]:
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if chunks > num_tokens:
        raise ValueError(f"chunks={chunks} exceeds the layer's {num_tokens} tokens")
    base, extra = divmod(num_tokens, chunks)
    out, s = [], 0
    for c in range(chunks):
        e = s + base + (1 if c < extra else 0)
        out.append((s, e))
        s = e
    return out


def plan_routes(idx_TK: torch.Tensor, num_experts: int, chunks: int, group=None) -> RoutePlan:
    T, _ = idx_TK.shape
    S = dist.get_world_size(group) if group is not None else 1
    L = num_experts // S
    bounds = chunk_bounds(T, chunks)
    C = len(bounds)
    chunk_T = torch.repeat_interleave(
        torch.arange(C, device=idx_TK.device),
        torch.tensor([e - s for s, e in bounds], device=idx_TK.device))
    key = chunk_T[:, None] * num_experts + idx_TK
    counts_CE = torch.bincount(key.reshape(-1), minlength=C * num_experts).view(C, num_experts)
    if S > 1:
        send_SCL = counts_CE.view(C, S, L).transpose(0, 1).contiguous()
        recv_SCL = torch.empty_like(send_SCL)
        dist.all_to_all_single(recv_SCL, send_SCL, group=group)
    else:
        send_SCL = recv_SCL = counts_CE.view(C, 1, L).transpose(0, 1)
    # The one host synchronisation of the layer.
    both = torch.stack([send_SCL, recv_SCL]).tolist()
    send_h, recv_h = both
    plan = RoutePlan(bounds, [], [], [], [])
    for c in range(C):
        plan.send.append([sum(send_h[s][c]) for s in range(S)])
        plan.recv.append([sum(recv_h[s][c]) for s in range(S)])
        plan.expert_rows.append([sum(recv_h[s][c][l] for s in range(S)) for l in range(L)])
        plan.recv_SL.append(recv_SCL[:, c])
    return plan


def source_major_to_expert_major(recv_SL: torch.Tensor, total: int) -> torch.Tensor:
    """Gather index turning the received [source][expert] row order into [expert][source]."""
    flat = recv_SL.reshape(-1)
    start_recv_SL = (torch.cumsum(flat, 0) - flat).view_as(recv_SL)
    len_LS = recv_SL.T.reshape(-1)
    start_target_LS = torch.cumsum(len_LS, 0) - len_LS
    shift = torch.repeat_interleave(start_recv_SL.T.reshape(-1) - start_target_LS, len_LS,
                                    output_size=total)
    return shift + torch.arange(total, device=recv_SL.device)


class ExpertDispatcher:
    """Routes one MoE layer's tokens through its (possibly remote) experts, chunk by chunk."""

    def __init__(self, num_experts: int, group=None, chunks: int = 1):
        S = dist.get_world_size(group) if group is not None else 1
        if num_experts % S:
            raise ValueError(f"EP size {S} does not divide num_experts={num_experts}")
        self.num_experts, self.group, self.chunks, self.ep_size = num_experts, group, chunks, S

    def __call__(self, x_TH, idx_TK, w_TK, experts) -> torch.Tensor:
        plan = plan_routes(idx_TK, self.num_experts, self.chunks, self.group)
        outs = [self._chunk(x_TH[s:e], idx_TK[s:e], w_TK[s:e], plan, c, experts)
                for c, (s, e) in enumerate(plan.bounds)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _chunk(self, x_tH, idx_tK, w_tK, plan: RoutePlan, c: int, experts) -> torch.Tensor:
        t, K = idx_tK.shape
        order_A = torch.argsort(idx_tK.reshape(-1), stable=True)
        tok_A = order_A // K
        x_AH = x_tH[tok_A]
        if self.ep_size > 1:
            x_rH = all_to_all(x_AH, plan.recv[c], plan.send[c], self.group)
            perm = source_major_to_expert_major(plan.recv_SL[c], x_rH.shape[0])
            y_gH = experts(x_rH[perm], plan.expert_rows[c])
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(perm.numel(), device=perm.device)
            y_AH = all_to_all(y_gH[inv], plan.send[c], plan.recv[c], self.group)
        else:
            y_AH = experts(x_AH, plan.expert_rows[c])
        w_A = w_tK.reshape(-1)[order_A].to(y_AH.dtype)
        return torch.zeros_like(x_tH).index_add(0, tok_A, y_AH * w_A[:, None])
