"""Route plans for one MoE layer's assignments: which rows go to which EP rank and local expert,
per chunk, computed with one host synchronisation.

Legend: T tokens, t tokens in a chunk, K top-k, A = T*K assignments, H hidden, E experts,
L local experts (E / S), S ranks in the EP group, C chunks.

Expert ownership is contiguous: EP rank r owns experts [r*L, (r+1)*L). Routing for all chunks is
planned at once, so the layer pays one host synchronisation (the split sizes the all-to-all needs
on the host), not one per chunk. Both the dispatcher (expert_parallel.py) and the chunk pipeline
(moe_pipeline.py) read the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RoutePlan:
    bounds: list[tuple[int, int]]    # token range of each chunk
    matrix: list[list[list[int]]]    # per chunk: [src][dst] rows sent, the same on every rank
    send: list[list[int]]            # per chunk: rows this rank sends to each EP rank
    recv: list[list[int]]            # per chunk: rows this rank receives from each EP rank
    expert_rows: list[list[int]]     # per chunk: rows for each local expert (all sources)
    recv_SL: list[torch.Tensor]      # per chunk: [S, L] rows per (source, local expert), on device
    order_A: torch.Tensor            # assignments sorted by (chunk, expert)
    rows_CL: torch.Tensor | None = None  # [C, L] rows per (chunk, local expert), on device
    # per chunk: int32 end row of each local expert (device); expert chunks: of its own experts
    # (expert_bounds[c]) only, the others having no rows in it
    offs: list[torch.Tensor] | None = None
    a_ranges: list[tuple[int, int]] | None = None  # per chunk: its rows of order_A
    # Chunks by expert: chunk c holds every token's assignments to local experts
    # expert_bounds[c] (on every rank), so each expert's rows sit in one chunk.
    expert_bounds: list[tuple[int, int]] | None = None
    inv_A: torch.Tensor | None = None  # inverse of order_A: the row of each (token, k)


def check_chunking(chunks: int, by: str, local_experts: int):
    """A chunk count and kind the layer can run (expert chunks: at most one per local expert)."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if by not in CHUNK_BY:
        raise ValueError(f"chunk_by must be one of {', '.join(CHUNK_BY)}, got {by!r}")
    if by == "experts" and chunks > local_experts:
        raise ValueError(f"chunks={chunks} exceeds the {local_experts} local experts per rank "
                         "(chunks by expert)")


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


CHUNK_BY = ("tokens", "experts")


def plan_routes(idx_TK: torch.Tensor, num_experts: int, chunks: int, group=None,
                by: str = "tokens") -> RoutePlan:
    """Route plan for `chunks` pieces of the layer's assignments: contiguous token ranges
    (by="tokens"), or ranges of each rank's local experts (by="experts": chunk c takes every
    token's assignments to local experts expert_bounds[c] on every rank, so a chunk's grouped
    GEMMs read only its experts' weights, each once per layer, with all of its rows)."""
    T, K = idx_TK.shape
    S = dist.get_world_size(group) if group is not None else 1
    me = dist.get_rank(group) if group is not None else 0
    L = num_experts // S
    check_chunking(chunks, by, L)
    # Clamped so that a bad index cannot break the counting; it is reported after the host copy.
    idx = idx_TK.clamp(0, num_experts - 1)
    if by == "tokens":
        bounds = chunk_bounds(T, chunks)
        C, ebounds = len(bounds), None
    else:
        ebounds = chunk_bounds(L, chunks)
        C, bounds = chunks, [(0, T)] * chunks
    # Sort key (chunk, expert). One chunk: the expert alone (no per-assignment chunk ids).
    if C == 1:
        key = idx.reshape(-1)
    else:
        chunk_A = (_chunk_ids(T, C, torch.arange(T, device=idx.device))[:, None]
                   if by == "tokens" else _chunk_ids(L, C, idx % L))
        key = (chunk_A * num_experts + idx).reshape(-1)
    order_A = torch.argsort(key, stable=True)
    counts_CE = count_ids(key, C * num_experts).view(C, num_experts)
    if S > 1:
        counts_SCE = counts_CE.new_empty((S * C, num_experts))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(counts_SCE, counts_CE, group=group)
        counts_SCE = counts_SCE.view(S, C, num_experts)
    else:
        counts_SCE = counts_CE[None]
    recv_SCL = counts_SCE[:, :, me * L:(me + 1) * L]
    matrix_CSD = counts_SCE.view(S, C, S, L).sum(-1).transpose(0, 1)
    # Device work that needs no host value is queued before the synchronisation: the device runs
    # it while the host waits, instead of idling after it while the host issues small kernels.
    rows_CL = recv_SCL[0] if S == 1 else recv_SCL.sum(0)  # one source: a view, no sum
    offs_CL = rows_CL.cumsum(1).to(torch.int32)  # grouped GEMM offsets, built without a host copy
    inv_A = inverse_permutation(order_A)
    # The one host synchronisation of the layer (the expert-index range rides along with it).
    bounds_dev = (torch.stack([idx_TK.min(), idx_TK.max()]) if idx_TK.numel()
                  else idx_TK.new_zeros(2))
    host = torch.cat([matrix_CSD.reshape(-1), rows_CL.reshape(-1),
                      bounds_dev.to(matrix_CSD.dtype)]).tolist()
    _check_index_range(*host[-2:], num_experts)
    host = host[:-2]
    mat = [[host[(c * S + s) * S:(c * S + s + 1) * S] for s in range(S)] for c in range(C)]
    rows = host[C * S * S:]
    # Per-chunk views come from one unbind each, not an indexing op per chunk (host time).
    plan = RoutePlan(bounds, mat, [], [], [], list(recv_SCL.unbind(1)), order_A, rows_CL,
                     _own_offsets(offs_CL, ebounds), [], ebounds, inv_A)
    a0 = 0
    for c in range(C):
        plan.send.append(list(mat[c][me]))
        plan.recv.append([mat[c][s][me] for s in range(S)])
        plan.expert_rows.append(rows[c * L:(c + 1) * L])
        n = sum(plan.send[c]) if ebounds else (bounds[c][1] - bounds[c][0]) * K
        plan.a_ranges.append((a0, a0 + n))
        a0 += n
    return plan


def _own_offsets(offs_CL: torch.Tensor, ebounds) -> list[torch.Tensor]:
    """Each chunk's grouped-GEMM end rows: row c of offs_CL, or for expert chunks its own
    experts' entries. Chunks of equal expert counts B take them as one strided view (chunk c's
    block starts at c * (L + B)), not a slice per chunk (host time)."""
    if ebounds is None or len(ebounds) == 1:
        return list(offs_CL.unbind(0))
    sizes = {e - s for s, e in ebounds}
    if len(sizes) == 1:
        (B,), L = sizes, offs_CL.shape[1]
        return list(offs_CL.as_strided((len(ebounds), B), (L + B, 1)).unbind(0))
    return [o[s:e] for o, (s, e) in zip(offs_CL.unbind(0), ebounds)]


# count_ids compares every id with every bin (one [ids, n] boolean pass and a column sum) up to
# this many comparisons; past it, it scatter-adds. On an H200, 262,144 ids into 32 bins took 0.1
# ms as a scatter-add (every id an atomic add on one of 32 addresses).
ONE_HOT_COUNT_MAX = 1 << 25


def count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `ids` (int64), without a host synchronisation:
    torch.bincount on a GPU reads the ids' range back to the host first, which drains the
    device queue once more per MoE layer. Integer sums, so the result is exact in any order."""
    ids = ids.reshape(-1)
    if ids.numel() * n <= ONE_HOT_COUNT_MAX:
        bins = torch.arange(n, device=ids.device, dtype=ids.dtype)
        return (ids[:, None] == bins).sum(0, dtype=torch.int64)
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids, dtype=torch.int64))


def _chunk_ids(T: int, C: int, t: torch.Tensor) -> torch.Tensor:
    """The chunk under chunk_bounds(T, C) of each position in t (positions in [0, T)), computed
    on the device (a host list sent to the device would be a stream synchronisation). Equal
    chunks: one division."""
    base, extra = divmod(T, C)
    if not extra:
        return t // base
    head = extra * (base + 1)  # the first `extra` chunks hold base + 1 tokens
    return torch.where(t < head, t // (base + 1), extra + (t - head) // base)


def _check_index_range(lo: int, hi: int, num_experts: int):
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"routing produced expert index {bad}, outside [0, {num_experts})")


def check_expert_index(idx_TK: torch.Tensor, num_experts: int):
    """A router bug that yields an expert id outside [0, E) is caught here, naming the value
    (plan_routes does the same check inside its one host copy)."""
    if idx_TK.numel():
        _check_index_range(int(idx_TK.min()), int(idx_TK.max()), num_experts)


def source_major_to_expert_major(recv_SL: torch.Tensor, total: int) -> torch.Tensor:
    """Gather index turning the received [source][expert] row order into [expert][source].
    With leading dims ([C, S, L]: one block per chunk, blocks concatenated), each block is
    reordered within itself."""
    flat = recv_SL.reshape(-1)
    start_src = (torch.cumsum(flat, 0) - flat).view_as(recv_SL).transpose(-1, -2).reshape(-1)
    len_tgt = recv_SL.transpose(-1, -2).reshape(-1)
    start_tgt = torch.cumsum(len_tgt, 0) - len_tgt
    shift = torch.repeat_interleave(start_src - start_tgt, len_tgt, output_size=total)
    return shift + torch.arange(total, device=recv_SL.device)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv
