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
    "packing": "longmoe.bench.packing",
}

ROW_KEYS = ("summary", "results", "runs", "rows", "reports")


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        v = ",".join(f"{k}={x}" for k, x in v.items() if not isinstance(x, (dict, list)))
    return str(v).replace("|", "\\|")


def _short(v) -> bool:
    """A column worth a cell: scalars, and dicts of scalars that print short (a tile config)."""
    if isinstance(v, list):
        return False
    return not isinstance(v, dict) or 0 < len(_cell(v)) <= 80


def plain_table(report: dict) -> str:
    """Every scalar field of the report's first list of row objects, one column each."""
    rows = _rows_of(report)
    if rows is None:
        return "(no rows in this report)"
    cols: list[str] = []
    for r in rows:
        cols += [k for k, v in r.items() if k not in cols and _short(v)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _rows_of(report: dict) -> list | None:
    return next((report[k] for k in ROW_KEYS
                 if isinstance(report.get(k), list) and report[k]
                 and all(isinstance(r, dict) for r in report[k])), None)


def tune_table(sweep: dict) -> str:
    """`longmoe tune chunks`' sweep file: the pick per length against no chunks."""
    lines = ["| tokens/rank | chunks | transport | ms | no-chunk ms (transport) | speedup |",
             "|---|---|---|---|---|---|"]
    for T, r in sorted(sweep["summary"]["results"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {T} | {r['chunks']} | {r['transport']} | {r['ms']:.2f} | "
                     f"{r['nochunk_ms']:.2f} ({r['nochunk_transport']}) | {r['speedup']:+.1%} |")
    return "\n".join(lines)


def _is_tune_sweep(report: dict) -> bool:
    return isinstance(report.get("summary"), dict) and "results" in report["summary"] \
        and isinstance(report.get("reports"), list)


def table_for(report: dict):
    """The table function for `report`; None for a JSON that is not a bench report."""
    name = report.get("bench") or report.get("benchmark")
    if name in MODULES:
        return importlib.import_module(MODULES[name]).markdown_table
    if _is_tune_sweep(report):
        return tune_table
    return plain_table if _rows_of(report) is not None else None


def render(path: str | Path) -> Path | None:
    """Write the table of results file `path` beside it; None when the file holds no bench
    report (a list, a golden check, a doctor report)."""
    path = Path(path)
    report = json.loads(path.read_text())
    if not isinstance(report, dict):
        return None
    table = table_for(report)
    if table is None:
        return None
    if _is_tune_sweep(report) and report["reports"]:
        # the sweep file keeps provenance in each layer report it ran, not at its top
        first = report["reports"][0]
        report = {"bench": "tune-chunks", **{k: first.get(k) for k in
                                             ("date", "commit", "device", "nproc", "versions")},
                  **report}
    out = table_path(path)
    out.write_text(markdown(report, table))
    return out
