"""Argument parsing shared by the `longmoe` subcommands (cli.py, plan/, paired/, tuning/)."""

from __future__ import annotations

from longmoe.errors import UserError


def int_list(text: str, flag: str) -> list[int]:
    """"4096,8192" -> [4096, 8192]; anything else is a one-line error naming `flag`."""
    try:
        vals = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise UserError(f"{flag}: values must be >= 1, got {text!r}")
    return vals
