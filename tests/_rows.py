"""Helpers for the tests of full rows (one sample per row of seq_len, longmoe.data.rows): the
run's own path through longmoe.train.feed.Feed, samples from JSONL-style dicts, and an
independent per-position reference of the single-sample row layout."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from longmoe.data.packing import IGNORE, pack_rows
from longmoe.data.sample import LOGPROB_FIELDS, Sample


def feed_rows(data: dict, step: int, rank: int = 0, world: int = 1, vocab: int = 37,
              seed: int = 0, loss: dict | None = None):
    """(this data rank's PackedBatch of the step, its StepData) as `longmoe train` builds them
    for the data settings `data` (no token budget: the rows way)."""
    from longmoe.train.config import from_dict
    from longmoe.train.feed import Feed
    run = from_dict({"model": {"preset": "tiny", "vocab_size": vocab}, "data": dict(data),
                     "loss": dict(loss or {}), "train": {"seed": seed}})
    out = Feed(run, rank, world).step(step)
    assert len(out.micro) == 1
    return out.micro[0], out


def samples(rows: list[dict]) -> list[Sample]:
    return [Sample.from_row(r, index=i, where=f"row {i}") for i, r in enumerate(rows)]


def rows_of(rows: list[dict], seq_len: int):
    """One row of `seq_len` per sample, as the rows way packs them."""
    return pack_rows([[s] for s in samples(rows)], seq_len=seq_len, packed=False,
                     label_tail=True)


def single_rows(rows: list[dict], seq_len: int) -> SimpleNamespace:
    """The reference: each sample alone in a row, written position by position. Response token
    j is the label of position len(prompt) + j - 1 when that lies in the row."""
    B = len(rows)
    ids = torch.zeros(B, seq_len, dtype=torch.long)
    labels = torch.full((B, seq_len), IGNORE, dtype=torch.long)
    adv = torch.zeros(B, seq_len)
    logps = {k: torch.full((B, seq_len), float("nan")) for k in LOGPROB_FIELDS}
    for b, s in enumerate(rows):
        toks = (list(s["prompt"]) + list(s["response"]))[:seq_len]
        ids[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        P, mask = len(s["prompt"]), s.get("loss_mask")
        for j, tok in enumerate(s["response"]):
            t = P + j - 1
            if not 0 <= t < seq_len or (mask is not None and not mask[j]):
                continue
            labels[b, t] = tok
            a = s["advantage"]
            adv[b, t] = a[j] if isinstance(a, list) else a
            for k in LOGPROB_FIELDS:
                if s.get(k) is not None:
                    logps[k][b, t] = s[k][j]
    return SimpleNamespace(input_ids=ids, labels=labels, advantages=adv, **logps)
