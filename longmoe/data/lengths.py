"""Length distributions for synthetic samples, written as `KIND:ARGS`:

  fixed:N              every draw is N
  uniform:MIN:MAX      integers MIN..MAX, each equally likely
  lognormal:MEAN:MAX   a log-normal capped at MAX with mean MEAN after the cap

The log-normal stands for RL response lengths: long-tailed, with the generation limit as a hard
cap that a few responses hit. Its spread is set so MAX is the 99th percentile of the uncapped
distribution of mean MEAN (sigma from ln MAX = mu + z99*sigma, mu = ln MEAN - sigma^2/2); mu is
then lowered until the capped mean is MEAN. For MEAN 6K, MAX 32K that gives sigma 0.89 and about
1% of draws at the cap. When MAX/MEAN exceeds exp(z99^2/2) ~ 15 no sigma puts MAX at the 99th
percentile; sigma = z99 (the widest that still does) is used and fewer than 1% reach the cap.

A draw is a function of one uniform number, so a sample's length depends only on its own seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from longmoe.errors import ConfigError

_Z99 = NormalDist().inv_cdf(0.99)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _capped_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for ln X ~ N(mu, sigma^2)."""
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * _phi(z - sigma) + cap * (1.0 - _phi(z))


@dataclass(frozen=True)
class LengthDist:
    kind: str
    lo: int             # fixed: N; uniform: MIN; lognormal: 1
    hi: int             # fixed: N; uniform: MAX; lognormal: MAX
    mean: float = 0.0   # lognormal: the requested mean
    mu: float = 0.0
    sigma: float = 0.0

    def draw(self, u: float) -> int:
        """The length for a uniform number u in [0, 1)."""
        if self.kind == "fixed":
            return self.lo
        if self.kind == "uniform":
            return min(self.hi, self.lo + int(u * (self.hi - self.lo + 1)))
        # Clamped so u = 0 stays finite; the cap makes the top tail a point mass at MAX.
        u = min(max(u, 1e-12), 1 - 1e-12)
        x = math.exp(self.mu + self.sigma * NormalDist().inv_cdf(u))
        return max(1, min(self.hi, round(x)))


def parse_length(spec: str | int, field: str) -> LengthDist:
    """A distribution from its `KIND:ARGS` spelling (a plain integer means fixed)."""
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"fixed:{spec}"
    parts = str(spec).split(":")
    kind, args = parts[0], parts[1:]
    want = {"fixed": 1, "uniform": 2, "lognormal": 2}
    if kind not in want:
        raise ConfigError(field, f"{spec!r}: expected fixed:N, uniform:MIN:MAX or "
                                 f"lognormal:MEAN:MAX")
    if len(args) != want[kind]:
        raise ConfigError(field, f"{spec!r}: {kind} takes {want[kind]} number(s)")
    try:
        nums = [float(a) if kind == "lognormal" and i == 0 else int(a) for i, a in enumerate(args)]
    except ValueError:
        raise ConfigError(field, f"{spec!r}: arguments must be numbers") from None
    if kind == "fixed":
        if nums[0] < 0:
            raise ConfigError(field, f"{spec!r}: length must be >= 0")
        return LengthDist("fixed", nums[0], nums[0])
    if kind == "uniform":
        lo, hi = nums
        if not 0 <= lo <= hi:
            raise ConfigError(field, f"{spec!r}: need 0 <= MIN <= MAX")
        return LengthDist("uniform", lo, hi)
    mean, cap = nums
    if not 1 <= mean < cap:
        raise ConfigError(field, f"{spec!r}: need 1 <= MEAN < MAX")
    ratio = math.log(cap / mean)
    disc = _Z99 * _Z99 - 2 * ratio
    sigma = _Z99 - math.sqrt(disc) if disc > 0 else _Z99
    # The capped mean rises with mu; bisect mu so it equals the requested mean.
    lo, hi = math.log(mean) - sigma * sigma / 2 - 20.0, math.log(mean)
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _capped_mean(mid, sigma, cap) < mean else (lo, mid)
    return LengthDist("lognormal", 1, cap, mean=mean, mu=(lo + hi) / 2, sigma=sigma)
