"""Packed rows: samples laid end to end in the rows of a micro-batch.

Every token carries its sample id (-1: padding) and its position inside its sample. A segment is
a maximal run of tokens with one id in a row: a sample, or the row's padding. Inside the model a
token sees only earlier tokens of its own segment: attention is document-causal, Gated DeltaNet's
recurrent state and short convolution restart at every segment start, and RoPE takes the
in-sample positions. MoE, the LM head and the losses are per token and need nothing: the data
side gives padding tokens, and each sample's last token, the label -100.

The derived views (segment starts, tokens since the start, cu_seqlens, attention spans) are built
once per micro-batch and shared by every layer. Not a dataclass on purpose: FSDP2's input casting
rebuilds dataclass arguments at every wrapped block (dataclasses.replace), which would drop the
shared views; a plain object passes through untouched.

Legend: B rows, S tokens per row, n segments over all rows.
"""

from __future__ import annotations

from typing import Sequence

import torch

from longmoe.ops.document_attention import DocumentSpan


class PackedRows:
    """One micro-batch's packing: `sample_ids` and `positions`, both [B, S] int64 on the model's
    device. Immutable; build it with `from_lengths` (samples end to end, padding after them),
    `unpacked` (one sample per row) or the constructor (ids and positions as tensors)."""

    def __init__(self, sample_ids_BS: torch.Tensor, positions_BS: torch.Tensor):
        if sample_ids_BS.dim() != 2 or positions_BS.shape != sample_ids_BS.shape:
            raise ValueError(f"sample ids {tuple(sample_ids_BS.shape)} and positions "
                             f"{tuple(positions_BS.shape)} must both be [rows, tokens]")
        for name, t in (("sample ids", sample_ids_BS), ("positions", positions_BS)):
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"{name} must be integers, got {t.dtype}")
        ids = sample_ids_BS.long()
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        self._init(ids, positions_BS.long(), starts, _history(starts), None, None)

    def _init(self, ids, positions, starts, history, whole, index):
        d = self.__dict__
        d["sample_ids"], d["positions"], d["starts"], d["history"] = ids, positions, starts, history
        d["whole"], d["index"], d["_cache"] = whole, index, {}

    def __setattr__(self, name, value):
        raise AttributeError("PackedRows is immutable")

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_lengths(cls, rows: Sequence[Sequence[int]], seq_len: int, device=None,
                     sample_ids: Sequence[Sequence[int]] | None = None) -> "PackedRows":
        """Row r holds samples of lengths rows[r] end to end, then padding up to `seq_len`.
        Sample ids: `sample_ids` (same nesting, each >= 0), else 0, 1, ... over all rows."""
        ids, pos, nxt = [], [], 0
        for r, lengths in enumerate(rows):
            if sample_ids is not None and len(sample_ids[r]) != len(lengths):
                raise ValueError(f"row {r}: {len(lengths)} lengths but {len(sample_ids[r])} ids")
            row_ids, row_pos = [], []
            for i, n in enumerate(lengths):
                sid = sample_ids[r][i] if sample_ids is not None else nxt
                if n < 1:
                    raise ValueError(f"row {r}, sample {i}: length {n} (samples hold >= 1 token)")
                if sid < 0:
                    raise ValueError(f"row {r}, sample {i}: id {sid} (ids are >= 0; -1 is padding)")
                row_ids += [sid] * n
                row_pos += range(n)
                nxt += 1
            if len(row_ids) > seq_len:
                raise ValueError(f"row {r}: samples of {len(row_ids)} tokens exceed the row's "
                                 f"{seq_len}")
            pad = seq_len - len(row_ids)
            ids.append(row_ids + [-1] * pad)
            pos.append(row_pos + list(range(pad)))
        return cls(torch.tensor(ids, dtype=torch.long, device=device).view(len(rows), seq_len),
                   torch.tensor(pos, dtype=torch.long, device=device).view(len(rows), seq_len))

    @classmethod
    def unpacked(cls, batch: int, seq_len: int, device=None) -> "PackedRows":
        """One sample per row (what an unpacked batch means)."""
        ids = torch.arange(batch, device=device)[:, None].expand(batch, seq_len)
        pos = torch.arange(seq_len, device=device)[None, :].expand(batch, seq_len)
        return cls(ids, pos)

    def to(self, device) -> "PackedRows":
        if self.whole is not None:
            return self.whole.to(device).select(self.index.to(device))
        return PackedRows(self.sample_ids.to(device), self.positions.to(device))

    def select(self, index_s: torch.Tensor) -> "PackedRows":
        """The tokens at `index_s` of every row (a context-parallel rank's share, in its local
        order). Starts and histories keep their meaning in the whole rows: a token where a piece
        begins is a start only if its sample begins there. Its `whole` is these rows."""
        if self.whole is not None:
            raise ValueError("select() takes whole rows, not a share of them")
        index_s = index_s.to(self.sample_ids.device)
        out = object.__new__(PackedRows)
        pick = lambda t: t.index_select(1, index_s)  # noqa: E731
        out._init(pick(self.sample_ids), pick(self.positions), pick(self.starts),
                  pick(self.history), self, index_s)
        return out

    # ---- derived views ------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.sample_ids.shape)

    @property
    def padding(self) -> torch.Tensor:
        """[B, S] bool: padding tokens (their labels must be -100)."""
        return self.sample_ids < 0

    def _whole_rows(self, what: str):
        if self.whole is not None:
            raise ValueError(f"{what} is defined on whole rows (use .whole of a share)")

    @property
    def segments(self) -> torch.Tensor:
        """[B, S] int64 segment ids, counted over the flattened rows (row r's ids follow row
        r-1's)."""
        self._whole_rows("segments")
        if "segments" not in self._cache:
            self._cache["segments"] = (self.starts.reshape(-1).cumsum(0) - 1).view(self.shape)
        return self._cache["segments"]

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """[n + 1] int32 segment boundaries in the flattened B*S tokens (varlen kernels, fla)."""
        self._whole_rows("cu_seqlens")
        if "cu_seqlens" not in self._cache:
            starts = self.starts.reshape(-1).nonzero()[:, 0]
            end = starts.new_full((1,), self.starts.numel())
            self._cache["cu_seqlens"] = torch.cat([starts, end]).to(torch.int32)
        return self._cache["cu_seqlens"]

    @property
    def max_seqlen(self) -> int:
        """The longest segment (one host sync, once)."""
        if "max_seqlen" not in self._cache:
            self._cache["max_seqlen"] = int(self.cu_seqlens.diff().max())
        return self._cache["max_seqlen"]

    def span(self, q_start: int = 0, keys: int | None = None) -> DocumentSpan:
        """Attention span of queries [q_start, keys) against keys [0, keys) of these rows
        (default: the whole rows), cached: every layer shares one."""
        self._whole_rows("span")
        keys = self.shape[1] if keys is None else keys
        key = ("span", q_start, keys)
        if key not in self._cache:
            self._cache[key] = DocumentSpan(self.segments[:, :keys], q_start)
        return self._cache[key]

    def check(self) -> None:
        """Host-side check that every segment's positions run 0, 1, ... and every sample is one
        run (a ValueError names the first row that breaks it); for data pipelines and tests."""
        ids, pos, starts = (t.cpu() for t in (self.sample_ids, self.positions, self.starts))
        seen = set()
        for r in range(ids.shape[0]):
            for t in range(ids.shape[1]):
                sid = int(ids[r, t])
                if starts[r, t] and sid >= 0:
                    if sid in seen:
                        raise ValueError(f"row {r}: sample {sid} is split into several runs")
                    seen.add(sid)
            want = self.history[r].cpu() if self.whole is None else None
            if want is not None and not torch.equal(pos[r], want):
                t = int((pos[r] != want).nonzero()[0, 0])
                raise ValueError(f"row {r}, token {t}: position {int(pos[r, t])}, expected "
                                 f"{int(want[t])} (positions restart at 0 in every sample)")


def _history(starts_BS: torch.Tensor) -> torch.Tensor:
    """[B, S] tokens since the token's segment began (0 at a start)."""
    S = starts_BS.shape[1]
    t = torch.arange(S, device=starts_BS.device).expand_as(starts_BS)
    last_start = torch.where(starts_BS, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - last_start
