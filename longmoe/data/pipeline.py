"""A step's data, from source to packed micro-batches; what the trainer calls each step:

    check_source(source, budget, overlong, pad_multiple)   # once, at startup
    batch = plan_for_step(source, step, global_batch=..., world=dp, budget=..., seed=...)
    n = global_trained_tokens(source, batch)           # the loss normaliser (normalise.py)
    for mb in rank_micro_batches(source, batch, rank): # PackedBatch each, same count every rank
        loss_sum(mb) * micro_batch_scale(n) -> backward
    batch.plan.stats, batch.plan.overlong              # for the step log and metrics

Every rank computes the same plan from (seed, step) alone and reads only its own samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from longmoe.data.balance import DEFAULT_CROSSOVER, StepPlan, plan_step, plan_unpacked
from longmoe.data.normalise import step_trained_tokens
from longmoe.data.order import step_indices
from longmoe.data.overlong import BUDGET, check_budget, overlong_message
from longmoe.data.packing import PackedBatch, pack_rows
from longmoe.data.sources import Check, JsonlSource, ParquetSource, Source
from longmoe.data.synthetic import SyntheticSource
from longmoe.errors import ConfigError, UserError

SOURCES = ("synthetic", "jsonl", "parquet")


def open_source(kind: str, path: str, check: Check, vocab_size: int, seed: int,
                prompt_len: str | int = 32, response_len: str | int = "fixed:96",
                group_size: int = 1) -> Source:
    """`data.source`, `data.path`, `data.prompt_len`, `data.response_len`, `data.group_size`."""
    if kind == "jsonl":
        return JsonlSource(path, check)
    if kind == "parquet":
        return ParquetSource(path, check)
    if kind == "synthetic":
        return SyntheticSource(vocab_size, seed, prompt_len, response_len, group_size)
    raise ConfigError("data.source", f"must be one of {', '.join(SOURCES)}, got {kind!r}")


def check_source(source: Source, budget: int, overlong: str = "error",
                 pad_multiple: int = 1, setting: str = BUDGET) -> None:
    """Startup checks, before any process group starts: the budget against the row padding and
    the longest prompt, and under data.overlong=error every sample against the budget.
    `setting` names the limit in messages (the budget, or data.seq_len for padded rows)."""
    longest_prompt, longest = source.longest()
    locate = getattr(source, "longest_prompt_at", None)  # file sources: name the sample
    where = source.where(locate()) if locate and longest_prompt >= budget else None
    check_budget(budget, pad_multiple, longest_prompt, overlong, setting, where)
    if overlong != "error" or longest <= budget:
        return
    if source.num_samples is None:
        raise ConfigError("data.response_len", f"draws samples of up to {longest} tokens (with "
                                               f"the prompt), longer than {setting}={budget}")
    k = source.first_longer_than(budget)
    p, r = source.sizes(k)
    raise UserError(overlong_message(source.where(k), p + r, budget, setting))


@dataclass(frozen=True)
class StepBatch:
    step: int
    indices: tuple[int, ...]    # source index of each global-batch position
    plan: StepPlan
    budget: int
    pad_multiple: int
    fixed_len: bool
    packed: bool = True         # samples end to end; False: one sample per micro-batch


def plan_for_step(source: Source, step: int, global_batch: int, world: int, budget: int,
                  seed: int, shuffle: bool = True, overlong: str = "error",
                  crossover: float = DEFAULT_CROSSOVER, pad_multiple: int = 1,
                  fixed_len: bool = False, packing: bool = True) -> StepBatch:
    """The step's global batch (order.py) and its plan (balance.py), from lengths only.
    `packing=False`: one sample per micro-batch, its row padded to the budget."""
    idx = step_indices(step, global_batch, source.num_samples, seed, shuffle)
    sizes = [source.sizes(i) for i in idx]
    where = lambda k: source.where(idx[k])  # noqa: E731
    if not packing:
        plan = plan_unpacked(sizes, world, budget, overlong, where, crossover)
        return StepBatch(step, tuple(idx), plan, budget, pad_multiple, True, packed=False)
    plan = plan_step(sizes, world, budget, overlong, where=where, crossover=crossover,
                     pad_multiple=pad_multiple, fixed_len=fixed_len)
    return StepBatch(step, tuple(idx), plan, budget, pad_multiple, fixed_len)


def _samples(source: Source, batch: StepBatch, positions):
    got = source.get_many([batch.indices[k] for k in positions])
    return [s.truncated(batch.plan.lengths[k]) for s, k in zip(got, positions)]


def rank_micro_batches(source: Source, batch: StepBatch, rank: int,
                       min_len: int = 1) -> Iterator[PackedBatch]:
    """Rank `rank`'s micro-batches, each one packed row (of at least `min_len` tokens), read
    lazily (one micro-batch's samples in memory at a time)."""
    for mb in batch.plan.micro_batches[rank]:
        yield pack_rows([_samples(source, batch, mb)],
                        seq_len=batch.budget if batch.fixed_len else None,
                        pad_multiple=batch.pad_multiple, min_len=min_len, packed=batch.packed)


def global_trained_tokens(source: Source, batch: StepBatch) -> int:
    """N, the step's trained tokens over all ranks, from reading every sample of the step (no
    communication). For a file source on many ranks, summing packed_trained_tokens over ranks
    with one all-reduce gives the same number without reading other ranks' samples."""
    kept = [k for k, n in enumerate(batch.plan.lengths) if n > 0]
    return step_trained_tokens(_samples(source, batch, kept))
