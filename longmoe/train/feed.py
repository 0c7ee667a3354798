"""What one step trains on this rank: its micro-batches, built on the host from the run's data
settings, and what the step log reports about them. Every way yields the one batch type,
longmoe.data.packing.PackedBatch; the ways differ only in packing policy (docs/packing.md):

  rows     no token budget; data.source=jsonl, or synthetic without data.response_len: one
           sample per row of seq_len, up to seq_len + 1 tokens (the last only a label;
           longmoe.data.rows), all of a rank's rows in one forward. A file's rows meet
           data.overlong when it is opened.
  padded   no token budget; synthetic with data.response_len, or parquet: one sample per row of
           seq_len, up to seq_len tokens, one forward; a longer sample meets data.overlong per
           step (a dropped one leaves a row of padding).
  planned  data.max_tokens_per_micro_batch set: the step's global batch is planned (every rank
           computes the same plan from the samples' lengths, longmoe.data.balance) into M
           micro-batches per rank, each one row of at most the budget: samples end to end
           (data.packing) or one sample padded to the budget. Every rank runs the same M.

A micro-batch here holds whole rows; the step splits them for context parallelism on the
device (longmoe.train.step, longmoe.parallel.context_parallel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from longmoe.data.balance import sample_cost
from longmoe.data.overlong import OverlongCounts, fit_lengths
from longmoe.data.order import step_indices
from longmoe.data.packing import IGNORE, PackedBatch, pack_rows
from longmoe.data.pipeline import check_source, plan_for_step, rank_micro_batches
from longmoe.data.rows import FittedFile, full_rows
from longmoe.data.rule import RuleSource
from longmoe.data.sources import JsonlSource, ParquetSource
from longmoe.data.validate import check_sample
from longmoe.errors import ConfigError
from longmoe.model.flops import balance_crossover
from longmoe.train.config import RunConfig


@dataclass
class StepData:
    """This data rank's share of one step. Counts are of this data rank (its CP ranks hold the
    same); `plan` and `overlong` are of the whole step (every rank computes the same)."""
    micro: list[PackedBatch]
    lengths: list[int]          # tokens of each of this data rank's samples, as trained
    row_tokens: int             # tokens of its rows, padding included
    masked: int = 0             # its samples with no trained token
    truncated: int = 0          # rows: its samples data.overlong cut
    plan: object = None         # longmoe.data.balance.PlanStats
    overlong: OverlongCounts = field(default_factory=OverlongCounts)
    cost: float = 0.0           # the balance cost of its samples (longmoe.data.balance)

    @property
    def trained_tokens(self) -> int:
        return sum(int((m.labels != IGNORE).sum()) for m in self.micro)

    @property
    def trained_samples(self) -> int:
        """Its samples with at least one trained token (the seq-mean aggregation's count)."""
        return sum(m.trained_samples for m in self.micro)


def mode(run: RunConfig) -> str:
    d = run.data
    if d.budget is not None:
        return "planned"
    if d.source == "parquet" or (d.source == "synthetic" and d.response_len is not None):
        return "padded"
    return "rows"


def pad_multiple(run: RunConfig) -> int:
    """Rows split into 2*cp zigzag pieces; data.row_multiple buckets their shapes."""
    two_cp = 2 * run.parallel.cp if run.parallel.cp > 1 else 1
    return math.lcm(two_cp, run.data.row_multiple)


def min_row(run: RunConfig) -> int:
    """Shortest row: under CP, Gated DeltaNet's conv reads kernel - 1 tokens of the previous
    piece, so every piece must hold at least that many."""
    cp = run.parallel.cp
    if cp > 1 and "linear_attention" in run.model.layer_types:
        return 2 * cp * (run.model.linear_conv_kernel - 1)
    return 1


def route_dims(run: RunConfig) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, experts): the shape a file row's routed_experts must fit (router
    replay; every layer of the model is a MoE layer), None where the model has none."""
    m = run.model
    return (m.num_layers, m.top_k, m.num_experts) if m.num_experts else None


def open_data_source(run: RunConfig):
    """The run's longmoe.data source (opening a file reads and checks every row once, naming the
    first bad one): for the rows way a FittedFile (JSONL) or the full-row synthetic draw."""
    d, V = run.data, run.model.vocab_size
    need, dims = run.loss.required_logprobs(), route_dims(run)
    if mode(run) == "rows":
        if d.source == "jsonl":
            return FittedFile(d.path, V, d.seq_len, d.overlong, need, dims)
        return RuleSource(V, run.train.seed, d.prompt_len, None, d.group_size,
                          full_rows=(d.seq_len, d.batch_size))
    if d.source == "synthetic":
        resp = d.response_len if d.response_len is not None else d.seq_len - d.prompt_len
        return RuleSource(V, run.train.seed, d.prompt_len, resp, d.group_size, d.num_samples)
    check = lambda row, where: check_sample(row, where, V, need, dims)  # noqa: E731
    return (JsonlSource if d.source == "jsonl" else ParquetSource)(d.path, check)


def check_data(run: RunConfig, source=None):
    """The launcher's checks of the data against the rows it will train in (one line naming the
    sample or setting), before any process group starts. Returns the opened source."""
    d = run.data
    m = mode(run)
    source = source or open_data_source(run)
    if m == "rows":
        return source
    if m == "padded":
        check_source(source, d.seq_len, d.overlong, 1, setting="data.seq_len")
        return source
    check_budget_settings(run)
    check_source(source, d.budget, d.overlong, pad_multiple(run))
    return source


def check_budget_settings(run: RunConfig) -> None:
    """The token budget against the layout's row constraints (ConfigError naming the setting);
    nothing to check without a budget."""
    d = run.data
    if d.budget is None:
        return
    cp, mult = run.parallel.cp, pad_multiple(run)
    if cp > 1 and d.budget % (2 * cp):
        raise ConfigError("data.max_tokens_per_micro_batch",
                          f"{d.budget} does not split into 2*cp={2 * cp} equal zigzag pieces "
                          f"(parallel.cp={cp})")
    if d.budget % mult:
        raise ConfigError("data.row_multiple", f"{d.row_multiple}: rows padded to a multiple "
                                               f"of {mult} do not fit the budget {d.budget}")
    if d.budget < min_row(run):
        raise ConfigError("data.max_tokens_per_micro_batch",
                          f"{d.budget} gives context-parallel pieces shorter than the Gated "
                          f"DeltaNet conv history ({run.model.linear_conv_kernel - 1})")


class Feed:
    """Builds each step's StepData for one data rank."""

    def __init__(self, run: RunConfig, data_rank: int, data_world: int):
        self.run, self.rank, self.world = run, data_rank, data_world
        self.mode = mode(run)
        self.source = open_data_source(run)
        self.crossover = balance_crossover(run.model)
        if not math.isfinite(self.crossover):
            self.crossover = 1e300  # no full attention: cost is tokens alone

    def counts(self) -> dict:
        return self.source.counts() if isinstance(self.source, FittedFile) else {}

    def describe(self) -> str | None:
        if isinstance(self.source, FittedFile):
            return self.source.describe()
        d = self.run.data
        if self.mode == "planned":
            return (f"data: {d.source}, {d.batch_size} samples a step in micro-batches of at most "
                    f"{d.budget} tokens ({'packed' if d.packing else 'one sample each, padded'}"
                    f"), data.overlong={d.overlong}")
        return None

    def step(self, step: int) -> StepData:
        out = {"rows": self._rows, "padded": self._padded, "planned": self._planned}[
            self.mode](step)
        out.cost = sum(sample_cost(n, self.crossover) for n in out.lengths)
        return out

    def _rows(self, step: int) -> StepData:
        d, src = self.run.data, self.source
        n = d.per_rank(self.world)
        if isinstance(src, FittedFile):
            pb, cut = src.step_rows(step, d.batch_size, self.rank, n, self.run.train.seed,
                                    d.shuffle)
        else:
            idx = step_indices(step, d.batch_size, None, self.run.train.seed)
            pb, cut = full_rows(src, idx[self.rank * n:(self.rank + 1) * n], d.seq_len), 0
        return StepData([pb], [k for r in pb.row_lengths for k in r], pb.input_ids.numel(),
                        pb.masked, cut)

    def _padded(self, step: int) -> StepData:
        d, src = self.run.data, self.source
        n = d.per_rank(self.world)
        idx = step_indices(step, d.batch_size, src.num_samples, self.run.train.seed, d.shuffle)
        # The policy over the whole step (from lengths alone), so its counts are the step's.
        lengths, counts = fit_lengths([src.sizes(i) for i in idx], d.seq_len, d.overlong,
                                      lambda k: src.where(idx[k]), setting="data.seq_len")
        mine = slice(self.rank * n, (self.rank + 1) * n)
        idx, lengths = idx[mine], lengths[mine]
        got = iter(src.get_many([i for i, k in zip(idx, lengths) if k > 0]))
        rows = [[next(got).truncated(k)] if k > 0 else [] for k in lengths]  # dropped: padding
        pb = pack_rows(rows, seq_len=d.seq_len, packed=False)
        return StepData([pb], [k for k in lengths if k > 0], pb.input_ids.numel(), pb.masked,
                        overlong=counts)

    def _planned(self, step: int) -> StepData:
        d, run = self.run.data, self.run
        batch = plan_for_step(self.source, step, d.batch_size, self.world, d.budget,
                              run.train.seed, d.shuffle, d.overlong, self.crossover,
                              pad_multiple(run), packing=d.packing)
        micro = list(rank_micro_batches(self.source, batch, self.rank, min_len=min_row(run)))
        lengths = [batch.plan.lengths[k] for mb in batch.plan.micro_batches[self.rank]
                   for k in mb]
        return StepData(micro, lengths, sum(m.input_ids.numel() for m in micro),
                        sum(m.masked for m in micro), plan=batch.plan.stats,
                        overlong=batch.plan.overlong)
