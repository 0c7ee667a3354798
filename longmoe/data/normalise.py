"""Gradient accumulation's normalisation: a step's loss is the mean over every trained token of
the global batch, so each micro-batch contributes (its token-loss sum) / N, with N the trained
tokens of the whole step over all ranks and micro-batches. Summing those gradients over
micro-batches, and over ranks in the data-parallel reduction (a sum, not a mean), gives the
gradient of one big batch; dividing by each micro-batch's own count would weight a token of a
short micro-batch more than one of a long micro-batch.
"""

from __future__ import annotations

from typing import Iterable

from longmoe.data.packing import PackedBatch
from longmoe.data.sample import Sample, trained_tokens


def step_trained_tokens(samples: Iterable[Sample]) -> int:
    """N from the step's samples as trained (after the overlong policy): what every rank can
    compute alike without communication."""
    return sum(trained_tokens(s) for s in samples)


def packed_trained_tokens(batches: Iterable[PackedBatch]) -> int:
    """A rank's share of N from its packed micro-batches; summed over ranks (one all-reduce of
    a scalar) it equals step_trained_tokens."""
    return sum(b.trained_tokens for b in batches)


def micro_batch_scale(global_tokens: int) -> float:
    """The factor on a micro-batch's token-loss sum. A step that trains no token (every
    response masked) contributes zero gradient rather than dividing by zero."""
    return 1.0 / global_tokens if global_tokens > 0 else 0.0
