"""Checks of one policy-update sample (a JSONL row). Every error is one line naming the place
(`file:line`) and the field; a sample is never changed without being counted.

Response token j is the label of position len(prompt) + j - 1, so a sample fits a sequence of
S tokens when prompt + response has at most S + 1 tokens: the last response token is only ever
a label, never an input. `fit` applies the data.overlong policy to one that does not.
"""

from __future__ import annotations

import json
import math

from longmoe.data import routes as route_rules
from longmoe.errors import UserError

# Per response token, optional: the trainer's policy at rollout time, the reference policy (KL
# terms) and the rollout engine's (truncated importance sampling).
LOGPROB_FIELDS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")

# Advantages and log-probs train in float32: a larger magnitude would become infinite there.
F32_MAX = 3.4028234663852886e38


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(where: str, field: str, v) -> None:
    if not math.isfinite(v) or abs(v) > F32_MAX:
        raise UserError(f"{where}: {field}: {v} is not a finite float32 number")


def _per_token(row: dict, key: str, n: int, where: str) -> list | None:
    vals = row.get(key)
    if vals is None:
        return None
    if not isinstance(vals, list) or len(vals) != n:
        raise UserError(f"{where}: {key} must be a list of {n} values (one per response token)")
    return vals


def json_row(line, where: str, checks=()) -> object:
    """One JSONL line parsed, then `checks` run on it (each `check(row)`), then a non-JSON
    constant refused: Python's json reads NaN and Infinity, JSON has neither. Checking first
    lets a checked field name its own error ("advantage: nan is not a finite ...")."""
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name)

    try:
        row = json.loads(line, parse_constant=constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
    for check in checks:
        check(row)
    if constants:
        raise UserError(f"{where}: {constants[0]} is not valid JSON (no NaN or Infinity)")
    return row


def parse_sample(line: str, where: str, vocab_size: int,
                 require: dict[str, str] | None = None,
                 routes: tuple[int, int, int] | None = None) -> dict:
    """The row of one JSONL line, checked field by field."""
    def checked(row):
        if not isinstance(row, dict):
            raise UserError(f"{where}: expected an object")
        check_sample(row, where, vocab_size, require, routes)
    return json_row(line, where, (checked,))


def check_sample(row: dict, where: str, vocab_size: int,
                 require: dict[str, str] | None = None,
                 routes: tuple[int, int, int] | None = None) -> None:
    """`require`: log-prob fields the loss needs (field -> why); a row without one is an error,
    never a silent zero term. `routes`: the model's (MoE layers, top_k, experts) a row's
    routed_experts must fit (longmoe.data.routes); None: a row with routes is refused."""
    require = require or {}
    for key in ("prompt", "response", "advantage"):
        if key not in row:
            raise UserError(f"{where}: missing field {key!r}")
    for key in ("prompt", "response"):
        ids = row[key]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                for t in ids):
            raise UserError(f"{where}: {key} must be a list of integer token ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise UserError(f"{where}: {key} token id {bad[0]} is outside [0, {vocab_size})")
    n = len(row["response"])
    if not n:
        raise UserError(f"{where}: response is empty")
    a = row["advantage"]
    if isinstance(a, list):
        if len(a) != n:
            raise UserError(f"{where}: advantage list has {len(a)} values, response has {n}")
        for i, v in enumerate(a):
            if not _is_number(v):
                raise UserError(f"{where}: advantage[{i}]: {v!r} is not a number")
            _finite(where, f"advantage[{i}]", v)
    elif _is_number(a):
        _finite(where, "advantage", a)
    else:
        raise UserError(f"{where}: advantage must be a number or a list of numbers")
    for key in LOGPROB_FIELDS:
        vals = _per_token(row, key, n, where)
        if vals is None and key in require:
            raise UserError(f"{where}: missing field {key!r} ({require[key]})")
        for i, v in enumerate(vals or []):
            if not _is_number(v):
                raise UserError(f"{where}: {key}[{i}]: {v!r} is not a number")
            _finite(where, f"{key}[{i}]", v)
            if v > 0:
                raise UserError(f"{where}: {key}[{i}]: {v} is positive (a log-probability "
                                f"is <= 0)")
    if "temperature" in row:
        t = row["temperature"]
        if not _is_number(t) or not math.isfinite(t) or not 0 < t <= F32_MAX:
            raise UserError(f"{where}: temperature: {t!r} is not a positive finite number (the "
                            f"rollout's sampling temperature)")
    if row.get(route_rules.FIELD) is not None:
        route_rules.check_row(row[route_rules.FIELD], where, len(row["prompt"]) + n, routes)
    for i, v in enumerate(_per_token(row, "loss_mask", n, where) or []):
        # true/false, 0/1 or 0.0/1.0: a Parquet bool column, numpy floats, JSON integers
        if not isinstance(v, (bool, int, float)) or v not in (0, 1):
            raise UserError(f"{where}: loss_mask[{i}]: {v!r} is not 0 or 1 (the mask is "
                            f"bool or 0/1)")


def fit(row: dict, seq_len: int, policy: str, where: str) -> tuple[dict | None, str]:
    """(the sample as trained or None, "ok" | "dropped" | "truncated") under data.overlong."""
    P, R = len(row["prompt"]), len(row["response"])
    if P + R <= seq_len + 1:
        return row, "ok"
    if policy == "drop":
        return None, "dropped"
    if P > seq_len:  # not even the first response token would have a position
        raise UserError(f"{where}: prompt: {P} tokens leave no room for a response in "
                        f"data.seq_len={seq_len}")
    if policy == "error":
        raise UserError(f"{where}: response: prompt {P} + response {R} tokens exceed "
                        f"data.seq_len={seq_len} (a sample trains at most {seq_len + 1}); "
                        f"data.overlong=drop or truncate trains the rest")
    keep = seq_len + 1 - P
    cut = dict(row)
    for key in ("response", "advantage", *LOGPROB_FIELDS, "loss_mask"):
        if isinstance(row.get(key), list):
            cut[key] = row[key][:keep]
    if row.get(route_rules.FIELD) is not None:     # per token of prompt + response
        cut[route_rules.FIELD] = row[route_rules.FIELD][:seq_len + 1]
    return cut, "truncated"


def trained_tokens(row: dict, seq_len: int) -> int:
    """Response tokens of a fitting sample that get a label (its loss mask and position)."""
    P, mask = len(row["prompt"]), row.get("loss_mask")
    return sum(1 for j in range(len(row["response"]))
               if 0 <= P + j - 1 < seq_len and (mask is None or mask[j]))
