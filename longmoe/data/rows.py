"""Full rows: one sample per row of `seq_len` positions, a sample of up to seq_len + 1 tokens
(its last response token is only the label of the row's last position). The packing policy
`longmoe train` uses without a token budget for JSONL files and for synthetic data whose
responses fill the row; it builds the same longmoe.data.packing.PackedBatch as every other way.

A file's rows are fitted once, when it is opened (`FittedFile`): data.overlong=error stops at the
first row longer than seq_len + 1 (naming `file:line` and the field), `drop` leaves the row out of
the file's sample order (the epochs run over the rows kept), `truncate` marks it, and it is cut to
seq_len + 1 tokens when read. The file itself is streamed (longmoe.data.sources): only the index
and these per-row marks stay in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from longmoe.data.order import step_indices
from longmoe.data.packing import PackedBatch, pack_rows
from longmoe.data.sources import JsonlSource
from longmoe.data.validate import check_sample, fit, trained_tokens
from longmoe.errors import UserError


def full_rows(source, indices: Sequence[int], seq_len: int) -> PackedBatch:
    """The samples at `indices`, one a row of `seq_len` (cut to seq_len + 1 tokens)."""
    samples = source.get_many(list(indices))
    return pack_rows([[s.truncated(seq_len + 1)] for s in samples], seq_len=seq_len,
                     packed=False, label_tail=True)


class FittedFile:
    """A JSONL file opened as a stream, every row checked (`routes`: the model's route dims,
    validate.check_sample) and fitted into a row of seq_len under data.overlong. Attributes:
    source (the JsonlSource of every row), kept (source indices of the rows trained, file
    order), truncated (per kept row), dropped and masked (line numbers: rows left out, rows
    with no trained token)."""

    def __init__(self, path: str | Path, vocab_size: int, seq_len: int, overlong: str = "error",
                 require: dict[str, str] | None = None,
                 routes: tuple[int, int, int] | None = None):
        self.path, self.seq_len, self.overlong = Path(path), seq_len, overlong
        status: list[str] = []
        masked_rows: list[bool] = []

        def check(row: dict, where: str) -> None:
            check_sample(row, where, vocab_size, require, routes)
            fitted, st = fit(row, seq_len, overlong, where)
            status.append(st)
            masked_rows.append(fitted is not None and trained_tokens(fitted, seq_len) == 0)

        self.source = JsonlSource(self.path, check)
        src = self.source
        keep = [i for i, st in enumerate(status) if st != "dropped"]
        self.dropped = [int(src.lines[i]) for i, st in enumerate(status) if st == "dropped"]
        if not keep:
            raise UserError(f"{self.path}: no rows ({len(self.dropped)} dropped by "
                            f"data.overlong=drop)")
        self.kept = np.asarray(keep, dtype=np.int64)
        self.truncated = [status[i] == "truncated" for i in keep]
        self.masked = [int(src.lines[i]) for i in keep if masked_rows[i]]

    @property
    def lines(self) -> list[int]:
        return [int(self.source.lines[i]) for i in self.kept]

    def counts(self) -> dict:
        return {"data_rows": len(self.kept), "data_dropped": len(self.dropped),
                "data_truncated": sum(self.truncated), "data_masked": len(self.masked)}

    def describe(self) -> str:
        def lines(ls):
            return ", ".join(map(str, ls[:5])) + (", ..." if len(ls) > 5 else "")
        parts = [f"data: {len(self.kept)} rows from {self.path}"]
        cut = [ln for ln, t in zip(self.lines, self.truncated) if t]
        if self.dropped or cut:
            parts.append(f"data.overlong={self.overlong}: {len(self.dropped)} dropped"
                         + (f" (line {lines(self.dropped)})" if self.dropped else "")
                         + f", {len(cut)} truncated" + (f" (line {lines(cut)})" if cut else ""))
        if self.masked:
            parts.append(f"{len(self.masked)} with no trained token (loss_mask all 0; line "
                         f"{lines(self.masked)})")
        return "; ".join(parts)

    def step_rows(self, step: int, batch_size: int, rank: int, per_rank: int, seed: int,
                  shuffle: bool) -> tuple[PackedBatch, int]:
        """(data rank `rank`'s rows of the step, how many of them data.overlong cut): step s
        trains positions [s*B, (s+1)*B) of the kept rows' order (longmoe.data.order), data rank
        r its slice of them."""
        order = step_indices(step, batch_size, len(self.kept), seed, shuffle)
        picked = order[rank * per_rank:(rank + 1) * per_rank]
        batch = full_rows(self.source, [int(self.kept[p]) for p in picked], self.seq_len)
        return batch, sum(self.truncated[p] for p in picked)
