"""Benchmarks behind `longmoe bench`; results are committed as JSON with device, versions and date."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def write_json_and_table(report: dict, out: str | None, table) -> None:
    """Write `report` as JSON to `out` (when given) and print `table(report)`."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
    print(table(report))


def parse_configs(text: str | None) -> list[dict]:
    """--configs: a JSON list of kernel tile overrides; none means the shipped config only."""
    if not text:
        return [{}]
    cfgs = json.loads(text)
    if not isinstance(cfgs, list) or not all(isinstance(c, dict) for c in cfgs):
        raise ValueError("must be a JSON list of objects")
    return cfgs


def median_ms(backend, fn, iters: int, warmup: int = 2) -> float:
    """Median device time of fn() over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    backend.synchronize()
    times = []
    for _ in range(iters):
        with backend.timer() as t:
            fn()
        times.append(t.elapsed_ms)
    return statistics.median(times)
