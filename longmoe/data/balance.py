"""The step plan: a global batch split across data-parallel ranks and into token-budget
micro-batches of similar cost, computed identically on every rank from the samples' lengths
(no communication; ties broken by position, no randomness).

Cost. A sample of L tokens costs L + L^2/crossover: per-token work (projections, experts, LM
head, Gated DeltaNet) grows with L, causal attention with L^2/2 pairs. `crossover` is the length
at which the two are equal: per-token forward FLOPs over 2*N*D*(full-attention layers) (causal
attention costs 4*N*D*(L+1)/2 per token and layer, model/flops.py). For Qwen3.5-35B-A3B (10 of
40 layers full attention, N*D = 4096) that is 6.05 GFLOP / 81,920 = 73,850 tokens; for the
all-attention Qwen3-30B-A3B it is 15,470. The default, 65,536, is the hybrid model's order; pass
`attention_crossover(...)` of the model being trained for its own.

Plan. Ranks step through their micro-batches in lockstep (expert-parallel all-to-alls and
parameter all-gathers in every micro-batch), so a step takes sum over j of the slowest rank's
micro-batch j: what matters is that all world x M micro-batches cost alike, not only the rank
totals. So the global batch is split directly into world x M micro-batches, then dealt to
ranks; every rank gets the same count M, as lockstep needs:
  1. M starts at the token lower bound ceil(ceil(tokens / budget) / world);
  2. samples by decreasing cost go to the cheapest micro-batch with room for them (LPT under
     the token budget); when that fails, first-fit decreasing by tokens; when that fails too,
     M grows by one;
  3. moves and swaps between the dearest micro-batch and the others lower the maximum cost;
  4. micro-batches by decreasing cost are dealt in rounds of `world`, the dearest of a round to
     the rank with the lowest total so far, so micro-batch j of every rank comes from round j;
     swaps within a round then even the rank totals further.
A rank can get an empty micro-batch only when the step has fewer samples than world x M; it
then runs one row of padding (packing.pack_rows) to take part in the collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from longmoe.data.overlong import OverlongCounts, fit_lengths
from longmoe.data.packing import round_up

DEFAULT_CROSSOVER = 65536.0


def attention_crossover(per_token_flops: float, attention_flops_per_pair: float) -> float:
    """The sample length at which attention's work equals the per-token work: per_token_flops
    is a token's forward FLOPs without attention's core, attention_flops_per_pair the core's
    FLOPs per (query, key) pair summed over layers (4*N*D per full-attention layer; causal
    attention has L^2/2 pairs). A model without full attention has no crossover (inf)."""
    if attention_flops_per_pair <= 0:
        return math.inf
    return 2 * per_token_flops / attention_flops_per_pair


def sample_cost(length: int, crossover: float = DEFAULT_CROSSOVER) -> float:
    return length + length * length / crossover


@dataclass(frozen=True)
class PlanStats:
    samples: int                # samples trained this step
    useful_tokens: int          # their tokens
    padding_tokens: int         # row tokens beyond them, over all ranks
    padding_share: float        # padding / (useful + padding)
    micro_batches: int          # per rank (the same on every rank)
    empty_micro_batches: int    # over all ranks
    rank_costs: tuple[float, ...]
    rank_cost_imbalance: float  # max / mean of rank_costs (1 is perfect)
    lockstep_imbalance: float   # sum_j max_r cost[r][j] / sum_j mean_r cost[r][j]

    def as_dict(self) -> dict:
        return {k: v for k, v in vars(self).items() if k != "rank_costs"}


@dataclass(frozen=True)
class StepPlan:
    # micro_batches[r][j]: positions (into the step's global batch) packed as rank r's
    # micro-batch j, in position order.
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    lengths: tuple[int, ...]        # per position: tokens trained this step (0: dropped)
    overlong: OverlongCounts
    stats: PlanStats


def _lpt(order, length, cost, nbins, budget):
    bins, used, load = [[] for _ in range(nbins)], [0] * nbins, [0.0] * nbins
    for k in order:
        fit = [b for b in range(nbins) if used[b] + length[k] <= budget]
        if not fit:
            return None
        b = min(fit, key=lambda b: (load[b], b))
        bins[b].append(k)
        used[b] += length[k]
        load[b] += cost[k]
    return bins


def _ffd(items, length, nbins, budget):
    bins, used = [[] for _ in range(nbins)], [0] * nbins
    for k in sorted(items, key=lambda k: (-length[k], k)):
        b = next((b for b in range(nbins) if used[b] + length[k] <= budget), None)
        if b is None:
            return None
        bins[b].append(k)
        used[b] += length[k]
    return bins


def _best_exchange(h, low, bins, used, load, length, cost, budget):
    """The move of one sample from micro-batch h to `low`, or swap of one each, that lowers
    max(load[h], load[low]) the most within the budget: (new max, a, b or None) or None."""
    best = None
    for a in bins[h]:
        if used[low] + length[a] <= budget:
            m = max(load[h] - cost[a], load[low] + cost[a])
            if m < load[h] - 1e-9 and (best is None or m < best[0]):
                best = (m, a, None)
        for b in bins[low]:
            d = cost[a] - cost[b]
            if d <= 0 or used[low] + length[a] - length[b] > budget \
                    or used[h] - length[a] + length[b] > budget:
                continue
            m = max(load[h] - d, load[low] + d)
            if m < load[h] - 1e-9 and (best is None or m < best[0]):
                best = (m, a, b)
    return best


def _refine(bins, length, cost, budget, rounds):
    """Even out micro-batch costs: the dearest micro-batch that can still improve gives a sample
    to (or swaps one with) a cheaper one. One that cannot (e.g. a single long sample) stays
    out of later rounds: the others only gain load, so it can never improve again."""
    used = [sum(length[k] for k in b) for b in bins]
    load = [sum(cost[k] for k in b) for b in bins]
    stuck: set[int] = set()
    for _ in range(rounds):
        live = [b for b in range(len(bins)) if b not in stuck]
        if not live:
            break
        h = max(live, key=lambda b: (load[b], -b))
        for low in sorted(range(len(bins)), key=lambda b: (load[b], b)):
            if low == h or load[low] >= load[h]:
                stuck.add(h)
                break
            best = _best_exchange(h, low, bins, used, load, length, cost, budget)
            if best is not None:
                _, a, b = best
                for k, src, dst in ((a, h, low), (b, low, h)):
                    if k is not None:
                        bins[src].remove(k), bins[dst].append(k)
                        used[src] -= length[k]; used[dst] += length[k]
                        load[src] -= cost[k]; load[dst] += cost[k]
                break
        else:
            stuck.add(h)
    return bins


def _deal(bins, cost, world):
    """world x M micro-batches to ranks, M each, round by round (see the module docstring)."""
    load = [sum(cost[k] for k in b) for b in bins]
    order = sorted(range(len(bins)), key=lambda b: (-load[b], min(bins[b], default=math.inf), b))
    rounds = [order[j:j + world] for j in range(0, len(order), world)]
    ranks, total = [[] for _ in range(world)], [0.0] * world
    for rnd in rounds:
        for b, r in zip(rnd, sorted(range(world), key=lambda r: (total[r], r))):
            ranks[r].append(b)
            total[r] += load[b]
    # Swapping two ranks' micro-batches of one round keeps every round's maximum (the lockstep
    # time) and can still even the rank totals; sweep until no swap helps.
    for _ in range(4 * len(rounds)):
        improved = False
        for j in range(len(rounds)):
            for r in range(world):
                for q in range(r + 1, world):
                    a, b = ranks[r][j], ranks[q][j]
                    d = load[a] - load[b]
                    if max(total[r] - d, total[q] + d) < max(total[r], total[q]) - 1e-9:
                        ranks[r][j], ranks[q][j] = b, a
                        total[r] -= d
                        total[q] += d
                        improved = True
        if not improved:
            break
    return [[tuple(sorted(bins[b])) for b in r] for r in ranks]


def plan_step(sizes: Sequence[tuple[int, int]], world: int, budget: int, overlong: str = "error",
              where: Callable[[int], str] = lambda k: f"sample {k} of the step",
              crossover: float = DEFAULT_CROSSOVER, pad_multiple: int = 1,
              fixed_len: bool = False) -> StepPlan:
    """The plan of one step from its global batch's (prompt, response) sizes, in batch order.
    `fixed_len`: rows are always `budget` tokens (shapes never change), else the longest row
    rounded up to `pad_multiple`; it only changes the padding reported."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    lengths, counts = fit_lengths(sizes, budget, overlong, where)
    cost = [sample_cost(n, crossover) for n in lengths]
    items = [k for k, n in enumerate(lengths) if n > 0]
    order = sorted(items, key=lambda k: (-cost[k], k))
    M = max(1, math.ceil(math.ceil(sum(lengths) / budget) / world))
    while True:
        nbins = world * M
        bins = _lpt(order, lengths, cost, nbins, budget) or _ffd(items, lengths, nbins, budget)
        if bins is not None:
            break
        M += 1
    bins = _refine(bins, lengths, cost, budget, rounds=4 * (len(bins) + len(items)))
    ranks = _deal(bins, cost, world)
    return StepPlan(tuple(tuple(r) for r in ranks), tuple(lengths), counts,
                    _stats(ranks, lengths, cost, budget, pad_multiple, fixed_len))


def plan_unpacked(sizes: Sequence[tuple[int, int]], world: int, budget: int,
                  overlong: str = "error",
                  where: Callable[[int], str] = lambda k: f"sample {k} of the step",
                  crossover: float = DEFAULT_CROSSOVER) -> StepPlan:
    """The padded baseline's plan: every sample alone in a micro-batch of one row of `budget`
    tokens, ceil(samples / world) micro-batches per rank, dealt like plan_step's so each round
    of the lockstep has samples of similar cost (the last rounds may hold empty micro-batches)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    lengths, counts = fit_lengths(sizes, budget, overlong, where)
    cost = [sample_cost(n, crossover) for n in lengths]
    items = [k for k, n in enumerate(lengths) if n > 0]
    M = max(1, math.ceil(len(items) / world))
    bins = [[k] for k in items] + [[] for _ in range(world * M - len(items))]
    ranks = _deal(bins, cost, world)
    return StepPlan(tuple(tuple(r) for r in ranks), tuple(lengths), counts,
                    _stats(ranks, lengths, cost, budget, 1, True))


def _stats(ranks, lengths, cost, budget, pad_multiple, fixed_len) -> PlanStats:
    useful = sum(lengths)
    rows = sum(budget if fixed_len else round_up(max(sum(lengths[k] for k in mb), 1), pad_multiple)
               for r in ranks for mb in r)
    mb_cost = [[sum(cost[k] for k in mb) for mb in r] for r in ranks]
    rank_costs = tuple(sum(c) for c in mb_cost)
    world, M = len(ranks), len(ranks[0])
    mean = sum(rank_costs) / world
    step_max = sum(max(c[j] for c in mb_cost) for j in range(M))
    return PlanStats(
        samples=sum(1 for n in lengths if n > 0), useful_tokens=useful,
        padding_tokens=rows - useful, padding_share=(rows - useful) / rows if rows else 0.0,
        micro_batches=M, empty_micro_batches=sum(1 for r in ranks for mb in r if not mb),
        rank_costs=rank_costs, rank_cost_imbalance=max(rank_costs) / mean if mean else 1.0,
        lockstep_imbalance=step_max * world / sum(rank_costs) if mean else 1.0)
