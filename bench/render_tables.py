"""Regenerate the markdown table beside each results JSON (`FILE.md` next to `FILE.json`).

    python bench/render_tables.py                      # every results/**/*.json
    python bench/render_tables.py results/h200/linear_ce.json ...

The table is the one the bench writes when it runs (longmoe.bench.tables), headed by the date,
commit, device and versions the JSON records; a field the JSON lacks is said to be missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

from longmoe.bench.tables import render


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parents[1]
    paths = [Path(a) for a in argv] or sorted((root / "results").rglob("*.json"))
    bad = 0
    for p in paths:
        try:
            out = render(p)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{p}: {type(e).__name__}: {e}", file=sys.stderr)
            bad += 1
            continue
        print(f"{p} -> {out}" if out else f"{p}: not a report (skipped)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
