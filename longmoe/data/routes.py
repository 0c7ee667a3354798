"""Router replay routes of one sample: `routed_experts`, per token of prompt + response, for each
MoE layer, the top-k experts the rollout engine routed it to, [P + R, layers, top_k] integers;
a token's row is k distinct expert ids, or all -1 (the trainer's router decides).

The rules every way in checks (the API's samples, JSONL lines, Parquet rows) are `check_ids`;
messages name the place, the field and the entry ("f.jsonl:3: routed_experts[4, 0, 1]: ...").
A file's routes become an int16 tensor (what packing stores): ids are checked against int16
before the cast. Conversion is vectorised: a 32K-token sample at 40 layers x top-8 is 10M ids.

  JSONL    nested arrays [tokens][layers][top_k] of integers
  Parquet  a list<list<list<int>>> column (any integer width; int16 keeps a row group small),
           flattened with Arrow, never turned into Python objects
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from longmoe.errors import UserError

FIELD = "routed_experts"
INT16_LIMIT = 1 << 15   # ids stored as int16: at most 32767
SHAPE = "nested lists [tokens][layers][top_k] of integers (every token with the same number " \
        "of layers, every layer with the same top_k)"


def check_ids(name: str, v: torch.Tensor, experts: int) -> None:
    """The id rules of an integer tensor [T, L, K] of routes, UserError naming the first bad
    entry: each id in [0, experts) or -1, a token's ids at a layer all -1 or all ids, and
    distinct."""
    off = v < 0
    bad = ((v < -1) | (v >= experts)).nonzero()
    if bad.numel():
        i, j, k = (int(x) for x in bad[0])
        raise UserError(f"{name}: {FIELD}[{i}, {j}, {k}]: {int(v[i, j, k])} is not an "
                        f"expert id in [0, {experts}) or -1")
    mixed = (off.any(-1) & ~off.all(-1)).nonzero()
    if mixed.numel():
        i, j = (int(x) for x in mixed[0])
        raise UserError(f"{name}: {FIELD}[{i}, {j}]: a token's experts are all ids or all "
                        f"-1, got {v[i, j].tolist()}")
    dup = repeats_expert(v).nonzero()
    if dup.numel():
        i, j = (int(x) for x in dup[0])
        raise UserError(f"{name}: {FIELD}[{i}, {j}]: {v[i, j].tolist()} repeats an "
                        f"expert (top_k distinct experts per token)")


def repeats_expert(v: torch.Tensor) -> torch.Tensor:
    """[..., top_k] ids -> [...] bool: the row names some expert twice (-1 rows excluded).
    Pairwise, top_k^2 / 2 compares: cheaper on the host than a sort, whose int64 indices would
    be 4x an int16 route tensor."""
    K = v.shape[-1]
    out = torch.zeros(v.shape[:-1], dtype=torch.bool)
    for i in range(K):
        for j in range(i + 1, K):
            out |= v[..., i] == v[..., j]
    return out & (v[..., 0] >= 0)


def as_array(value, where: str) -> np.ndarray:
    """A row's routed_experts (nested lists, or the array arrow_routes made) as an integer
    array [T, L, K], UserError naming the field otherwise."""
    if isinstance(value, np.ndarray):
        a = value
    elif isinstance(value, list):
        try:
            a = np.array(value)
        except (ValueError, OverflowError):     # ragged lists; an int beyond int64
            raise UserError(f"{where}: {FIELD} must be {SHAPE}") from None
    else:
        raise UserError(f"{where}: {FIELD} must be {SHAPE}, got {type(value).__name__}")
    if a.ndim != 3 or a.dtype.kind not in "iu":
        got = f"{a.ndim}-D" if a.ndim != 3 else a.dtype.name
        raise UserError(f"{where}: {FIELD} must be {SHAPE}, got {got} values")
    if isinstance(value, list) and a.size and bool in set(
            map(type, chain.from_iterable(chain.from_iterable(value)))):
        # numpy reads a true/false among integers as 1/0: refused, not replayed as an expert id
        raise UserError(f"{where}: {FIELD} holds true/false; expert ids must be integers")
    return a


def check_row(value, where: str, tokens: int, dims: tuple[int, int, int] | None) -> np.ndarray:
    """One row's routes checked: shape [tokens, layers, top_k] (`dims`: the model's (layers,
    top_k, experts); None: this run replays no routes, so a row with them is refused), ids that
    fit int16, then check_ids. Returns them as int16."""
    if dims is None:
        raise UserError(f"{where}: {FIELD}: this run does not replay routes (the model has no "
                        f"MoE layers to replay them in)")
    a = as_array(value, where)
    L, K, E = dims
    if a.shape != (tokens, L, K):
        raise UserError(f"{where}: {FIELD}: shape {list(a.shape)} is not [{tokens}, {L}, {K}] "
                        f"(prompt + response tokens, the model's MoE layers, its top_k)")
    limit = min(E, INT16_LIMIT)
    if a.size:
        bad = np.flatnonzero((a < -1) | (a >= limit))
        if bad.size:
            i, j, k = np.unravel_index(bad[0], a.shape)
            raise UserError(f"{where}: {FIELD}[{i}, {j}, {k}]: {a[i, j, k]} is not an expert "
                            f"id in [0, {limit}) or -1")
    t = to_tensor(a)
    check_ids(where, t, E)
    return t


def to_tensor(a: np.ndarray) -> torch.Tensor:
    """Checked ids (they fit int16) as an int16 tensor."""
    return torch.from_numpy(a.astype(np.int16))     # a copy: Arrow's buffers are read-only


def _is_list(t) -> bool:
    import pyarrow as pa
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def arrow_row(column, j: int, where: str) -> np.ndarray | None:
    """Row j of a Parquet routed_experts column (an Arrow list array) as an integer array
    [T, L, K] without Python objects per id; None when the row's value is null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    one = column.slice(j, 1)
    if one.null_count:
        return None
    if not _is_list(column.type) or not _is_list(column.type.value_type) or \
            not _is_list(column.type.value_type.value_type):
        raise UserError(f"{where}: {FIELD} must be {SHAPE}, got a column of {column.type}")
    level, lens = one, []
    for depth in range(3):
        level = level.flatten()
        if level.null_count:
            raise UserError(f"{where}: {FIELD} holds a null; it must be {SHAPE}")
        if depth < 2:
            n = pc.list_value_length(level).to_numpy(zero_copy_only=False)
            if n.size and (n != n[0]).any():
                raise UserError(f"{where}: {FIELD} must be {SHAPE}")
            lens.append(len(level))
    if not pa.types.is_integer(level.type):
        raise UserError(f"{where}: {FIELD} must be {SHAPE}, got {level.type} values")
    vals = level.to_numpy(zero_copy_only=False)
    T, TL = lens
    L = TL // T if T else 0
    K = len(vals) // TL if TL else 0
    return vals.reshape(T, L, K)
