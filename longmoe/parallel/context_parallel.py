"""Context parallelism: each of `cp` ranks holds 1/cp of every sequence, split zigzag so causal
attention work is balanced; attention all-gathers K/V over the CP group (their gradients are
reduce-scattered back) and masks lower-right-aligned per local piece.

Legend: B batch, S sequence, s = S / cp local tokens, P = S / (2 cp) piece length, N heads,
K kv heads, D head dim.

Zigzag: the sequence is cut into 2*cp pieces; CP rank r holds pieces r and 2*cp - 1 - r, so every
rank gets one early (cheap) and one late (expensive) piece of the causal triangle. RoPE positions,
labels, advantages and old log-probs are sliced with the same index, so everything per token
stays aligned; the MoE and the LM head are per-token and need nothing else.

Packed rows split the same way: each rank takes its share of the per-token sample ids, positions
and segment starts (local_packing); attention masks every piece by the whole rows' segments, and
Gated DeltaNet (longmoe.model.deltanet) restarts its state and convolution where a sample begins
inside a piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from longmoe.ops.attention import Attention


# torch 2.13 renames the tensor collectives; 2.11 (the GPU image) has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def zigzag_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions of this CP rank's tokens, in its local order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible into 2*cp={2 * cp} pieces")
    P = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * P, (first + 1) * P, device=device),
                      torch.arange(second * P, (second + 1) * P, device=device)])


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 of a [s, ...] tensor over the CP group; backward reduce-scatters
    (sums) the gradient, since every rank's queries read every rank's keys."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        world = dist.get_world_size(ctx.group)
        gx = g.new_empty((g.shape[0] // world,) + tuple(g.shape[1:]))
        _reduce_scatter(gx, g.contiguous(), group=ctx.group)
        return gx, None


class ContextParallel:
    """What one attention layer needs to run over a CP group."""

    def __init__(self, group, seq_len: int):
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.seq_len = seq_len
        # Rank-major gathered order -> global sequence order.
        order = torch.cat([zigzag_positions(seq_len, self.cp, r) for r in range(self.cp)])
        self.to_global = torch.argsort(order)

    def gather_kv(self, k_BsKD: torch.Tensor) -> torch.Tensor:
        """[B, s, K, D] local keys (or values) -> [B, S, K, D] in global order."""
        k_sBKD = _GatherSeq.apply(k_BsKD.transpose(0, 1), self.group)
        return k_sBKD[self.to_global.to(k_sBKD.device)].transpose(0, 1)

    def gather_pieces(self, t_2X: torch.Tensor) -> torch.Tensor:
        """[2, ...] (this rank's two pieces) -> [2*cp, ...] for every piece in sequence order.
        Differentiable: each piece's gradient is summed over the ranks that read it."""
        g = _GatherSeq.apply(t_2X.contiguous(), self.group).view((self.cp, 2) + tuple(t_2X.shape[1:]))
        order = [g[j, 0] if j < self.cp else g[2 * self.cp - 1 - j, 1] for j in range(2 * self.cp)]
        return torch.stack(order)

    def local_pieces(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    def attention(self, q_BsND, k_BSKD, v_BSKD, enable_gqa: bool, sdpa=None,
                  packing=None) -> torch.Tensor:
        """Causal attention of the two local query pieces [B, s, N, D] against the global keys/
        values [B, S, K, D]; [B, s, N, D] out. `sdpa`: the layer's
        longmoe.ops.attention.Attention (default torch's backend order). With `packing` (this
        rank's share of packed rows, PackedRows.select) the attention is document-causal: each
        piece's span over the whole rows' segments keeps every query inside its own sample."""
        P = self.seq_len // (2 * self.cp)
        whole = None if packing is None else packing.whole
        if packing is not None and (whole is None or whole.shape[1] != self.seq_len):
            raise ValueError("context parallel attention takes this rank's share of packed rows "
                             f"of {self.seq_len} tokens (local_packing)")
        outs = []
        for piece, j in ((0, self.rank), (1, 2 * self.cp - 1 - self.rank)):
            q = q_BsND[:, piece * P:(piece + 1) * P]
            end = (j + 1) * P  # keys at global positions < end; the last P align with q
            k, v = k_BSKD[:, :end], v_BSKD[:, :end]
            if packing is not None:
                outs.append((sdpa or Attention()).packed(q, k, v, whole.span(j * P, end)))
                continue
            fn = sdpa or F.scaled_dot_product_attention
            outs.append(fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                           attn_mask=causal_lower_right(P, end),
                           enable_gqa=enable_gqa).transpose(1, 2))
        return torch.cat(outs, dim=1)


def cp_share(batch, cp: int, cp_rank: int):
    """(this CP rank's share of a batch of whole rows, the global positions of its tokens), or
    (batch, None) without CP. `batch` is a longmoe.data.packing.PackedBatch: every per-token
    tensor (ids, labels, advantages, log-probs, sample ids, in-sample positions, whole-sample
    token counts) is sliced with the same zigzag index, so they stay aligned; the whole-sample
    counts were taken before the split, so a sample is still counted whole."""
    if cp == 1:
        return batch, None
    pos = zigzag_positions(batch.input_ids.shape[1], cp, cp_rank, batch.input_ids.device)
    return batch.map_tokens(lambda t: split_sequence(t, pos)), pos


def local_packing(packing, cp: int, cp_rank: int):
    """This CP rank's share of packed rows (longmoe.model.packing.PackedRows), in the zigzag
    order cp_share gives its tokens."""
    if cp == 1:
        return packing
    return packing.select(zigzag_positions(packing.shape[1], cp, cp_rank,
                                           packing.sample_ids.device))


def split_sequence(x_BS: torch.Tensor, positions_s: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a per-token [B, S] tensor (ids, labels, advantages, ...)."""
    return x_BS.index_select(1, positions_s.to(x_BS.device))
