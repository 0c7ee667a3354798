"""The markdown table of any results JSON: the bench's own table where the bench is a `longmoe
bench` command, a plain one of its rows otherwise (the probes in bench/). `bench/render_tables.py`
regenerates `FILE.md` beside `FILE.json` with these, the same functions the benches write with."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from longmoe.bench import markdown, table_path

# bench name (the report's "bench" or "benchmark" field) -> the module whose markdown_table it is
MODULES = {
    "linear-ce": "longmoe.bench.linear_ce",
    "moe-layer": "longmoe.bench.moe_layer",
    "moe-rows": "longmoe.bench.moe_rows",
    "grouped-mm": "longmoe.bench.grouped_mm",
    "gated-delta": "longmoe.bench.gated_delta",
    "train-path": "longmoe.bench.train_path",
}

ROW_KEYS = ("summary", "results", "runs", "rows", "reports")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return ""
    return str(v).replace("|", "\\|")


def plain_table(report: dict) -> str:
    """Every scalar field of the report's first list of row objects, one column each."""
    rows = next((report[k] for k in ROW_KEYS
                 if isinstance(report.get(k), list) and report[k]
                 and all(isinstance(r, dict) for r in report[k])), None)
    if rows is None:
        return "(no rows in this report)"
    cols: list[str] = []
    for r in rows:
        cols += [k for k, v in r.items() if k not in cols and not isinstance(v, (dict, list))]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def table_for(report: dict):
    name = report.get("bench") or report.get("benchmark")
    if name in MODULES:
        return importlib.import_module(MODULES[name]).markdown_table
    return plain_table


def render(path: str | Path) -> Path | None:
    """Write the table of results file `path` beside it; None when the file holds no report
    (a list or a non-JSON file)."""
    path = Path(path)
    report = json.loads(path.read_text())
    if not isinstance(report, dict):
        return None
    out = table_path(path)
    out.write_text(markdown(report, table_for(report)))
    return out
