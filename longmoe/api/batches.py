"""A PolicyTrainer call's samples as each rank's micro-batches, and per-token results back to
per-sample tensors.

Every rank holds the same global list and computes the same plan from the samples' lengths
alone (longmoe.data.balance), so no rank reads or sends another's samples to plan:
  data.max_tokens_per_micro_batch set   micro-batches of at most that many tokens, packed end to
                                        end (data.packing) or one sample each, padded to it;
                                        data.overlong applies to a longer sample
  unset                                 one micro-batch per rank holding all its samples: one
                                        packed row (data.packing), or one padded row per sample
The trained-token and sample counts of the whole call (the loss normalisers) come from the
same host computation: no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from longmoe.api.checks import sample_name
from longmoe.data.balance import StepPlan, plan_step, plan_unpacked, sample_cost
from longmoe.data.packing import pack_rows, round_up
from longmoe.data.sample import Sample, trained_tokens
from longmoe.parallel.context_parallel import zigzag_positions
from longmoe.train.config import RunConfig
from longmoe.train.feed import StepData, min_row, pad_multiple


@dataclass(frozen=True)
class CallPlan:
    fitted: tuple[Sample | None, ...]   # per sample: as trained (truncated), None when dropped
    plan: StepPlan
    budget: int | None                  # None: one micro-batch per rank
    packed: bool
    tokens: int                         # trained tokens of the whole call
    samples: int                        # its samples with a trained token
    crossover: float                    # the balance cost's (longmoe.data.balance)


def plan_call(run: RunConfig, samples: list[Sample], data_world: int, crossover: float,
              what: str) -> CallPlan:
    d = run.data
    mult = pad_multiple(run)
    sizes = [(s.prompt_len, s.response.numel()) for s in samples]
    where = lambda k: f"{what}: {sample_name(k, samples[k])}"  # noqa: E731
    budget = d.budget
    if budget is None:  # nothing is overlong: one bin per rank that holds any share
        limit = round_up(sum(p + r for p, r in sizes), mult)
        plan = (plan_step(sizes, data_world, limit, "error", where, crossover, mult)
                if d.packing else plan_unpacked(sizes, data_world, limit, "error", where,
                                                crossover))
    elif d.packing:
        plan = plan_step(sizes, data_world, budget, d.overlong, where, crossover, mult)
    else:
        plan = plan_unpacked(sizes, data_world, budget, d.overlong, where, crossover)
    fitted = tuple(s.truncated(n) if n > 0 else None for s, n in zip(samples, plan.lengths))
    counts = [trained_tokens(s) for s in fitted if s is not None]
    return CallPlan(fitted, plan, budget, d.packing, sum(counts), sum(1 for c in counts if c),
                    crossover)


def rank_step_data(run: RunConfig, call: CallPlan, data_rank: int,
                   transform=None) -> StepData:
    """This data rank's share of the call. `transform(sample)` rewrites each sample before it
    is packed (compute_logprobs labels every response token)."""
    mult, least = pad_multiple(run), min_row(run)
    mine = call.plan.micro_batches[data_rank]

    def get(k):
        s = call.fitted[k]
        return transform(s) if transform else s

    if call.budget is None and not call.packed:   # one forward: a padded row per sample
        ks = [k for mb in mine for k in mb]
        width = round_up(max([len(call.fitted[k]) for k in ks] + [least]), mult)
        rows = [[get(k)] for k in ks] or [[]]
        micro = [pack_rows(rows, seq_len=width, packed=False)]
    elif call.budget is None:
        ks = [k for mb in mine for k in mb]
        micro = [pack_rows([[get(k) for k in ks]], pad_multiple=mult, min_len=least)]
    else:
        fixed = None if call.packed else call.budget
        micro = [pack_rows([[get(k) for k in mb]], seq_len=fixed, pad_multiple=mult,
                           min_len=least, packed=call.packed) for mb in mine]
    lengths = [len(call.fitted[k]) for mb in mine for k in mb]
    masked = sum(1 for mb in mine for k in mb if trained_tokens(call.fitted[k]) == 0)
    cost = sum(sample_cost(n, call.crossover) for n in lengths)
    return StepData(micro, lengths, sum(m.input_ids.numel() for m in micro), masked,
                    plan=call.plan.stats, overlong=call.plan.overlong, cost=cost)


def order_of(call: CallPlan, data_rank: int) -> list[list[int]]:
    """Per micro-batch of this rank (as rank_step_data builds them), per row, the sample
    positions it holds in order."""
    mine = call.plan.micro_batches[data_rank]
    ks = [k for mb in mine for k in mb]
    if call.budget is None and not call.packed:
        return [[[k] for k in ks] or [[]]]
    if call.budget is None:
        return [[ks]]
    return [[list(mb)] for mb in mine]


def whole_rows(x_RS: torch.Tensor, row_len: int, layout) -> torch.Tensor:
    """A per-token [rows, tokens, ...] result of this rank's context-parallel share as whole
    rows [rows, row_len, ...], in the order of the row (every rank of the CP group gets all of
    it)."""
    if layout.cp == 1:
        return x_RS
    parts = [torch.empty_like(x_RS) for _ in range(layout.cp)]
    dist.all_gather(parts, x_RS.contiguous(), group=layout.cp_group)
    out = x_RS.new_empty((x_RS.shape[0], row_len, *x_RS.shape[2:]))
    for r, part in enumerate(parts):
        out[:, zigzag_positions(row_len, layout.cp, r, x_RS.device)] = part
    return out


def scatter_results(call: CallPlan, rows_by_micro, data_rank: int, offsets: list[int],
                    flat: torch.Tensor) -> None:
    """Write this data rank's per-token results (per micro-batch, [rows, tokens] whole rows)
    into `flat`, each sample's response tokens at offsets[k]:offsets[k] + R. Response token j
    of a sample at row offset o with prompt P is read at position o + P + j - 1; token 0 of an
    empty prompt and tokens past a truncation keep what `flat` holds."""
    for order, lp in zip(order_of(call, data_rank), rows_by_micro):
        for r, row in enumerate(order):
            o = 0
            for k in row:
                s = call.fitted[k]
                P, n = s.prompt_len, s.response.numel()
                first = 1 if P == 0 else 0
                dst = offsets[k] + first
                flat[dst:dst + n - first] = lp[r, o + P - 1 + first:o + P + n - 1].to(flat)
                o += len(s)


def scatter_routes(call: CallPlan, routes_by_micro, data_rank: int, offsets: list[int],
                   flat: torch.Tensor) -> None:
    """Write this data rank's recorded experts (per micro-batch, [rows, tokens, layers, top_k]
    whole rows) into `flat` plus one, each sample's tokens as trained at offsets[k] (its
    sample_offsets entry); tokens a truncation cut keep what `flat` holds."""
    for order, rt in zip(order_of(call, data_rank), routes_by_micro):
        for r, row in enumerate(order):
            o = 0
            for k in row:
                n = len(call.fitted[k])
                flat[offsets[k]:offsets[k] + n] = rt[r, o:o + n].to(flat) + 1
                o += n


def sample_offsets(samples: list[Sample]) -> list[int]:
    out, o = [], 0
    for s in samples:
        out.append(o)
        o += len(s)
    return out + [o]


def response_offsets(samples: list[Sample]) -> list[int]:
    out, o = [], 0
    for s in samples:
        out.append(o)
        o += s.response.numel()
    return out + [o]


def labelled(s: Sample) -> Sample:
    """The token ids alone, every response token labelled: compute_logprobs reads no training
    field (nor checks them), so none is packed."""
    return replace(s, advantage=0.0, old_logprobs=None, ref_logprobs=None,
                   rollout_logprobs=None, loss_mask=None)
