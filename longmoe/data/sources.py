"""RL sample sources: a JSONL stream and a Parquet reader with the same fields (sample.py), and
the interface every source (synthetic.py too) offers the step planner.

A source is opened once: one streaming pass reads every row, validates it with the caller's
`check(row, where)` (which raises a UserError naming the row) and keeps only a compact index:

  JSONL    per row its byte offset (int64), line number and prompt/response lengths (int32):
           20 bytes a row, 20 MB for a million rollouts whatever their length. A sample is read
           back by seeking to its offset and parsing that one line.
  Parquet  per row its prompt/response lengths (int32); rows are located through the file's
           row-group row counts. The pass reads one row group at a time, and reading samples
           back loads the row groups they are in (the last one is kept for sequential reads),
           so memory is bounded by the largest row group, not the file: write rollout files
           with row groups of a few thousand rows.

Planning needs only lengths (`sizes`), so each rank reads only the samples it trains on. The
row order is the file order; which rows a step takes is order.py's business.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from longmoe.data import routes
from longmoe.data.sample import FIELDS, Sample
from longmoe.data.validate import json_row
from longmoe.errors import UserError

Check = Callable[[dict, str], None]
REQUIRED = ("prompt", "response", "advantage")


class Source(Protocol):
    num_samples: int | None     # None: endless (no epochs)

    def sizes(self, i: int) -> tuple[int, int]: ...     # (prompt, response) tokens
    def longest(self) -> tuple[int, int]: ...           # (longest prompt, longest sample)
    def where(self, i: int) -> str: ...
    def get(self, i: int) -> Sample: ...
    def get_many(self, indices: Sequence[int]) -> list[Sample]: ...


def _sizes(row, where: str) -> tuple[int, int]:
    if not isinstance(row, dict):
        raise UserError(f"{where}: expected an object")
    for key in REQUIRED:
        if key not in row:
            raise UserError(f"{where}: missing field {key!r}")
    for key in ("prompt", "response"):
        if not isinstance(row[key], list):
            raise UserError(f"{where}: {key} must be a list of token ids")
    return len(row["prompt"]), len(row["response"])


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise UserError(f"data.path: {path} does not exist")


class _Indexed:
    """Shared bookkeeping of the file sources: per-row lengths and a readable origin."""
    path: Path
    prompt_lens: np.ndarray
    response_lens: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.prompt_lens)

    def sizes(self, i: int) -> tuple[int, int]:
        return int(self.prompt_lens[i]), int(self.response_lens[i])

    def longest(self) -> tuple[int, int]:
        return int(self.prompt_lens.max()), int((self.prompt_lens.astype(np.int64)
                                                 + self.response_lens).max())

    def longest_prompt_at(self) -> int:
        """The first sample holding the longest prompt (for messages)."""
        return int(np.argmax(self.prompt_lens))

    def first_longer_than(self, budget: int) -> int | None:
        """The first sample longer than `budget` tokens, from the index alone."""
        over = np.flatnonzero(self.prompt_lens.astype(np.int64) + self.response_lens > budget)
        return int(over[0]) if over.size else None

    def index_nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if isinstance(a, np.ndarray))

    def _sample(self, row, i: int) -> Sample:
        where = self.where(i)
        if _sizes(row, where) != self.sizes(i):
            raise UserError(f"{where}: row changed since the file was opened")
        return Sample.from_row(row, index=i, where=where)

    def get(self, i: int) -> Sample:
        return self.get_many([i])[0]


class JsonlSource(_Indexed):
    def __init__(self, path: str | Path, check: Check):
        self.path = path = Path(path)
        _require_file(path)
        offsets, lines, plen, rlen = array("q"), array("i"), array("i"), array("i")
        pos = 0
        with path.open("rb") as f:
            for ln, line in enumerate(f, 1):
                start, pos = pos, pos + len(line)
                if not line.strip():
                    continue
                where = f"{path}:{ln}"
                sizes = []
                json_row(line, where, (lambda row: sizes.append(_sizes(row, where)),
                                       lambda row: check(row, where)))
                p, r = sizes[0]
                offsets.append(start), lines.append(ln), plen.append(p), rlen.append(r)
        if not offsets:
            raise UserError(f"{path}: no rows")
        self.offsets = np.frombuffer(offsets, dtype=np.int64)
        self.lines = np.frombuffer(lines, dtype=np.int32)
        self.prompt_lens = np.frombuffer(plen, dtype=np.int32)
        self.response_lens = np.frombuffer(rlen, dtype=np.int32)
        self._fh = None

    def where(self, i: int) -> str:
        return f"{self.path}:{int(self.lines[i])}"

    def get_many(self, indices: Sequence[int]) -> list[Sample]:
        if self._fh is None:
            self._fh = self.path.open("rb")
        out: dict[int, Sample] = {}
        for i in sorted(set(indices), key=lambda i: self.offsets[i]):   # forward seeks only
            self._fh.seek(int(self.offsets[i]))
            out[i] = self._sample(json.loads(self._fh.readline()), i)
        return [out[i] for i in indices]

    def __del__(self):
        if getattr(self, "_fh", None) is not None:
            self._fh.close()


class ParquetSource(_Indexed):
    """`memory_pool`: the Arrow pool every read of the file allocates from (Arrow's default pool
    when None); the source keeps it alive as long as it holds data read from it (Arrow buffers
    point at their pool without owning it)."""
    SCAN_ROWS = 16      # rows turned into Python objects at once while validating

    def __init__(self, path: str | Path, check: Check, memory_pool=None):
        import pyarrow.dataset as ds
        from pyarrow.fs import LocalFileSystem

        self.path = path = Path(path)
        _require_file(path)
        self.memory_pool = memory_pool
        try:
            self._file = ds.ParquetFileFormat().make_fragment(str(path), LocalFileSystem())
            self._file.ensure_complete_metadata()     # reads the footer
            names = set(self._file.physical_schema.names)
        except Exception as e:  # pyarrow raises its own error types for a file it cannot read
            raise UserError(f"{path}: not a readable Parquet file ({e})") from None
        for key in REQUIRED:
            if key not in names:
                raise UserError(f"{path}: missing column {key!r}")
        self.columns = [k for k in FIELDS if k in names]
        self._groups = self._file.split_by_row_group()
        self.group_starts = np.cumsum([0] + [f.row_groups[0].num_rows for f in self._groups],
                                      dtype=np.int64)
        plen, rlen = array("i"), array("i")
        i = 0
        try:
            for g in range(len(self._groups)):
                group = self._read_group(g)
                for batch in group.to_batches(max_chunksize=self.SCAN_ROWS):
                    for row in _rows(batch, i, self.where):
                        where = self.where(i)
                        p, r = _sizes(row, where)
                        check(row, where)
                        plen.append(p), rlen.append(r)
                        i += 1
                group = batch = None     # a batch slice would keep the group's buffers alive
        finally:                         # a bad row's traceback keeps this frame
            group = batch = None
        if not plen:
            raise UserError(f"{path}: no rows")
        self.prompt_lens = np.frombuffer(plen, dtype=np.int32)
        self.response_lens = np.frombuffer(rlen, dtype=np.int32)
        self._cached: tuple[int, object] | None = None

    def _read_group(self, g: int):
        return self._groups[g].to_table(columns=self.columns, memory_pool=self.memory_pool)

    def where(self, i: int) -> str:
        return f"{self.path}:row {i}"

    def _group(self, g: int):
        if self._cached is None or self._cached[0] != g:
            self._cached = (g, self._read_group(g))
        return self._cached[1]

    def __del__(self):
        self._cached = None     # the row group goes before the pool it was read into

    def get_many(self, indices: Sequence[int]) -> list[Sample]:
        out: dict[int, Sample] = {}
        for i in sorted(set(indices)):      # each row group loaded once
            g = int(np.searchsorted(self.group_starts, i, side="right")) - 1
            row = _rows(self._group(g).slice(i - int(self.group_starts[g]), 1), i, self.where)[0]
            out[i] = self._sample(row, i)
        return [out[i] for i in indices]


def _rows(table, first: int, where) -> list[dict]:
    """The rows of an Arrow table or batch (source rows first, first + 1, ...) as dicts without
    their nulls; routed_experts as integer arrays flattened by Arrow (routes.arrow_row): a long
    sample's routes are millions of ids, too many to become Python objects."""
    if routes.FIELD not in table.schema.names:
        return [_drop_nulls(row) for row in table.to_pylist()]
    col = table.column(routes.FIELD)
    if hasattr(col, "combine_chunks"):      # a Table's column is chunked
        col = col.combine_chunks()
    rows = [_drop_nulls(row) for row in table.drop_columns([routes.FIELD]).to_pylist()]
    for j, row in enumerate(rows):
        got = routes.arrow_row(col, j, where(first + j))
        if got is not None:
            row[routes.FIELD] = got
    return rows


def _drop_nulls(row: dict) -> dict:
    """A Parquet column holds every field for every row; a null is a field the row lacks."""
    return {k: v for k, v in row.items() if v is not None}
