"""What happens to a sample longer than the micro-batch token budget (`data.overlong`):

  error     (default) stop, naming the sample and its length against the budget;
  drop      leave it out of the step;
  truncate  keep its first `budget` tokens (the whole prompt, a prefix of the response).

Nothing is lost silently: drop and truncate are counted per step for the step log and metrics.
A prompt that fills the budget leaves no response token to train; it is an error under truncate
(and under error), and dropped under drop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from longmoe.errors import ConfigError, UserError

POLICIES = ("error", "drop", "truncate")
BUDGET = "data.max_tokens_per_micro_batch"


@dataclass(frozen=True)
class OverlongCounts:
    dropped: int = 0            # samples left out
    truncated: int = 0          # samples cut to the budget
    truncated_tokens: int = 0   # tokens cut from them
    dropped_tokens: int = 0


def overlong_message(where: str, length: int, budget: int, setting: str = BUDGET) -> str:
    return (f"{where}: sample of {length} tokens is longer than {setting}={budget} "
            f"(set data.overlong to drop or truncate to train without it)")


def fit_lengths(sizes: Sequence[tuple[int, int]], budget: int, policy: str,
                where: Callable[[int], str], setting: str = BUDGET
                ) -> tuple[list[int], OverlongCounts]:
    """Each sample's length in the step after the policy (0: dropped), from its (prompt,
    response) sizes; `where(k)` names sample k for the error, `setting` the limit's field."""
    if policy not in POLICIES:
        raise ConfigError("data.overlong", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    out, dropped, truncated, cut, lost = [], 0, 0, 0, 0
    for k, (p, r) in enumerate(sizes):
        n = p + r
        if n <= budget:
            out.append(n)
            continue
        if policy == "drop":
            out.append(0)
            dropped, lost = dropped + 1, lost + n
            continue
        if policy == "error":
            raise UserError(overlong_message(where(k), n, budget, setting))
        if p >= budget:
            raise UserError(f"{where(k)}: prompt of {p} tokens leaves no response token within "
                            f"{setting}={budget}")
        out.append(budget)
        truncated, cut = truncated + 1, cut + n - budget
    return out, OverlongCounts(dropped, truncated, cut, lost)


def check_budget(budget: int, pad_multiple: int = 1, longest_prompt: int | None = None,
                 policy: str = "error", setting: str = BUDGET, prompt_where: str | None = None
                 ) -> None:
    """Startup checks of the budget against the row padding (the CP zigzag pieces) and the
    longest prompt of a sized source (`prompt_where`: the sample holding it, for the message),
    before any process group starts."""
    if policy not in POLICIES:
        raise ConfigError("data.overlong", f"must be one of {', '.join(POLICIES)}, got {policy!r}")
    if budget < 1:
        raise ConfigError(setting, f"must be >= 1, got {budget}")
    if budget % pad_multiple:
        raise ConfigError(setting, f"{budget} does not divide into rows padded to a multiple of "
                                   f"{pad_multiple} (2 x context-parallel size, for the zigzag "
                                   f"split)")
    if longest_prompt is not None and longest_prompt >= budget and policy != "drop":
        at = f", {prompt_where}" if prompt_where else ""
        raise ConfigError(setting, f"{budget} is not longer than the longest prompt "
                                   f"({longest_prompt} tokens{at})")
