"""Packing: samples laid end to end in rows, each token tagged with its sample and its position
inside it, the training signal aligned to next-token labels.

Shapes: R rows of S tokens. For a sample of prompt length P and response length R_ placed at
offset o of a row, position o+t holds its token t, has position id t (RoPE restarts per sample)
and sample id k (its ordinal in the micro-batch; -1 on padding). Position t predicts token t+1
of the same sample, so response token j (at t = P+j) is the label of position o+P+j-1; the
sample's last position, its prompt positions (except the one predicting the first response
token), masked response tokens and padding carry label -100. Advantages and the old / ref /
rollout log-probs sit at the same positions as their labels (0 and NaN elsewhere; NaN also
where the sample gave no such log-probs).

A sample never spans two rows: the planner keeps every sample within the budget (overlong.py).
Rows are padded to the longest row rounded up to `pad_multiple` (2*cp for the zigzag split of
context parallel), or to a fixed `seq_len` when shapes must not change between micro-batches.
With `label_tail` a row's last sample may hold one token more than the row has positions: that
token is never an input, only the label of the row's last position (full rows of seq_len train
a sample of seq_len + 1 tokens).

`routed_experts` (None when no sample has any) gives every position its sample's replayed
experts per MoE layer, [R, S, layers, top_k] int16, -1 where the router decides (padding, and
samples without routes). `temperature` (None when every sample's is 1) gives every position its
sample's rollout temperature (1 on padding): the LM head divides that position's logits by it.

`sample_tokens` gives every token its whole sample's trained-token count (0 on padding), for the
per-sample loss aggregation modes; it is counted here, before a context-parallel split of a row,
and travels with the tokens. `packed` says what the model is told: True, rows of samples end to
end (the model gets their boundaries, longmoe.model.packing); False, one sample per row,
attention plainly causal over the row.

Every per-token tensor is [R, S]; `map_tokens` applies one function to all of them (moving to a
device, the context-parallel slice), keeping the per-row bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from longmoe.data.sample import LOGPROB_FIELDS, Sample

IGNORE = -100


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, eq=False)
class PackedBatch:
    input_ids: torch.Tensor         # [R, S] int64
    labels: torch.Tensor            # [R, S] int64, -100 where nothing is trained
    advantages: torch.Tensor        # [R, S] float32
    old_logprobs: torch.Tensor      # [R, S] float32, NaN: not given
    ref_logprobs: torch.Tensor
    rollout_logprobs: torch.Tensor
    sample_ids: torch.Tensor        # [R, S] int64, -1 on padding
    positions: torch.Tensor         # [R, S] int64, restarting at 0 per sample
    sample_tokens: torch.Tensor     # [R, S] int64, the trained tokens of each token's sample
    row_lengths: tuple[tuple[int, ...], ...]    # per row, its samples' tokens in it, in order
    sample_index: tuple[tuple[int, ...], ...]   # per row, its samples' source indices
    packed: bool = True             # rows of samples end to end (else one sample a row)
    temperature: torch.Tensor | None = None     # [R, S] float32; None: every sample's is 1
    routed_experts: torch.Tensor | None = None  # [R, S, layers, top_k] int16; -1: not replayed

    TOKEN_FIELDS = ("input_ids", "labels", "advantages", "old_logprobs", "ref_logprobs",
                    "rollout_logprobs", "sample_ids", "positions", "sample_tokens",
                    "temperature", "routed_experts")

    def map_tokens(self, fn) -> "PackedBatch":
        """The same batch with `fn` applied to every per-token tensor (the absent ones stay
        None)."""
        return replace(self, **{f: fn(t) for f in self.TOKEN_FIELDS
                                if (t := getattr(self, f)) is not None})

    def to(self, device) -> "PackedBatch":
        """On `device`. Host tensors go to an accelerator from page-locked memory without
        blocking (a pageable copy waits for the device's queue to drain, so the next
        micro-batch could not be queued behind the running one)."""
        kind = torch.device(device).type
        if kind in ("cpu", "meta"):
            return self.map_tokens(lambda t: t.to(device, non_blocking=True))
        return self.map_tokens(lambda t: (t.pin_memory() if t.device.type == "cpu" else t)
                               .to(device, non_blocking=True))

    @property
    def row_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_samples(self) -> int:
        return sum(len(r) for r in self.row_lengths)

    @property
    def masked(self) -> int:
        """Samples with no trained token."""
        return self.num_samples - self.trained_samples

    @property
    def trained_samples(self) -> int:
        return int(self.sample_ids[self.labels != IGNORE].unique().numel())

    @property
    def useful_tokens(self) -> int:
        return sum(map(sum, self.row_lengths))

    @property
    def padding_tokens(self) -> int:
        return self.input_ids.numel() - self.useful_tokens

    @property
    def trained_tokens(self) -> int:
        return int((self.labels != IGNORE).sum())


def _put(dst: torch.Tensor, run, val: torch.Tensor, keep: torch.Tensor | None, fill) -> None:
    if keep is not None:
        val = torch.where(keep, val, torch.as_tensor(fill, dtype=val.dtype))
    dst[run] = val


def pack_rows(rows: Sequence[Sequence[Sample]], seq_len: int | None = None,
              pad_multiple: int = 1, min_len: int = 1, packed: bool = True,
              label_tail: bool = False) -> PackedBatch:
    """Pack each inner list into one row. No rows (a rank's empty micro-batch) gives one row of
    padding, so the rank still runs the step's collectives with nothing to train. Without a
    fixed `seq_len` rows take the longest row's tokens (at least `min_len`) rounded up to
    `pad_multiple`. `packed`: the batch's flag (module docstring); `label_tail`: a row of a
    fixed `seq_len` takes one token more, as its last label."""
    if not rows:
        rows = [[]]
    used = [sum(len(s) for s in row) for row in rows]
    S = round_up(max(max(used), min_len, 1), pad_multiple) if seq_len is None else seq_len
    if max(used) > S + (label_tail and seq_len is not None):
        raise ValueError(f"a row of {max(used)} tokens does not fit seq_len={S}"
                         + (" (+1 label)" if label_tail else ""))
    if S % pad_multiple:
        raise ValueError(f"seq_len={S} is not a multiple of pad_multiple={pad_multiple}")
    n = len(rows)
    ids = torch.zeros(n, S, dtype=torch.long)
    labels = torch.full((n, S), IGNORE, dtype=torch.long)
    adv = torch.zeros(n, S)
    logps = {k: torch.full((n, S), float("nan")) for k in LOGPROB_FIELDS}
    sid = torch.full((n, S), -1, dtype=torch.long)
    pos = torch.zeros(n, S, dtype=torch.long)
    # decided on the host: at temperature 1 everywhere the head does no per-token division
    temp = (torch.ones(n, S) if any(float(s.temperature) != 1.0 for row in rows for s in row)
            else None)
    shapes = {tuple(s.routed_experts.shape[1:]) for row in rows for s in row
              if s.routed_experts is not None}
    if len(shapes) > 1:
        raise ValueError(f"samples' routed_experts differ in [layers, top_k]: {sorted(shapes)}")
    routes = torch.full((n, S, *shapes.pop()), -1, dtype=torch.int16) if shapes else None
    k = 0
    placed = []
    for r, row in enumerate(rows):
        o = 0
        placed.append([])
        for s in row:
            P, L = s.prompt_len, len(s)
            n = min(L, S - o)   # L, or L - 1 for a label tail
            ids[r, o:o + n] = torch.cat([s.prompt, s.response])[:n]
            sid[r, o:o + n] = k
            pos[r, o:o + n] = torch.arange(n)
            if temp is not None:
                temp[r, o:o + n] = float(s.temperature)
            if s.routed_experts is not None:
                routes[r, o:o + n] = s.routed_experts[:n]
            placed[-1].append(n)
            # The response tokens from `first` on are the labels of one contiguous run of
            # positions; writing them as slices, not through index tensors, matters: an indexed
            # write of 6K positions took 3000x a slice's time on CPU.
            first = 1 if P == 0 else 0
            run = (r, slice(o + P - 1 + first, o + L - 1))
            keep = None if s.loss_mask is None else s.loss_mask[first:]
            _put(labels, run, s.response[first:], keep, IGNORE)
            a = s.advantage
            _put(adv, run, a[first:] if isinstance(a, torch.Tensor)
                 else torch.full((L - P - first,), a), keep, 0.0)
            for key in LOGPROB_FIELDS:
                v = getattr(s, key)
                if v is not None:
                    _put(logps[key], run, v[first:], keep, float("nan"))
            o, k = o + L, k + 1
    return PackedBatch(ids, labels, adv, logps["old_logprobs"], logps["ref_logprobs"],
                       logps["rollout_logprobs"], sid, pos, _sample_tokens(labels, sid, k),
                       row_lengths=tuple(map(tuple, placed)),
                       sample_index=tuple(tuple(s.index for s in row) for row in rows),
                       packed=packed, temperature=temp, routed_experts=routes)


def _sample_tokens(labels: torch.Tensor, sample_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Per token, the trained tokens of its sample (0 on padding)."""
    valid = sample_ids >= 0
    per_sample = torch.bincount(sample_ids[(labels != IGNORE) & valid], minlength=n)
    if per_sample.numel() == 0:
        return torch.zeros_like(sample_ids)
    return torch.where(valid, per_sample[sample_ids.clamp(min=0)], 0)


def row_sample_lengths(sample_ids: torch.Tensor) -> list[list[int]]:
    """Per row of a [R, S] sample-id tensor, the lengths of its samples in order (padding, id
    -1, is not a sample). From these the model builds its sequence boundaries (cu_seqlens)."""
    out = []
    for row in sample_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        out.append([int(c) for i, c in zip(ids.tolist(), counts) if i >= 0])
    return out
