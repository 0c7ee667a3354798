"""Benchmarks behind `longmoe bench`; results are committed as JSON with device, versions and date."""

from __future__ import annotations

import json
from pathlib import Path


def write_json_and_table(report: dict, out: str | None, table) -> None:
    """Write `report` as JSON to `out` (when given) and print `table(report)`."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
    print(table(report))
