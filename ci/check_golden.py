"""Compare a run's per-step metrics (the JSONL of `longmoe train --metrics-out`) with a golden file.

    python ci/check_golden.py METRICS.jsonl GOLDEN.json              # check; exit 1 on a mismatch
    python ci/check_golden.py METRICS.jsonl GOLDEN.json --write-golden [--rtol R --atol A]

A golden file is data, written from a run on the vendor it names, e.g. ci/golden/cuda_gpu_smoke.json:

    {"backend": "cuda", "recipe": "gpu_smoke",
     "tolerance": {"loss": {"rtol": 0.02, "atol": 0.005}},
     "steps": [{"step": 1, "loss": 10.41}, {"step": 2, "loss": 10.37}, ...]}

A value passes when |got - want| <= atol + rtol * |want| (numpy.isclose's rule). Every golden step
must be in the metrics file and vice versa: a run that stopped early or ran longer is a failure, not
a partial pass. NaN or inf never passes. Exit codes: 0 pass, 1 mismatch, 2 missing/unreadable input.
Standard library only, so it runs before (or without) the package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# Starting tolerances for --write-golden. Two runs of the same bf16 recipe differ in the last bits
# (atomics in grouped GEMMs, all-reduce order), and the gap grows over the steps; the GRPO policy
# loss sits near zero, where only atol means anything. Measure two runs and tighten in the file.
DEFAULT_RTOL = 0.02
DEFAULT_ATOL = 0.005


class InputError(Exception):
    """A file that is missing or not what this script reads (exit 2)."""


def read_metrics(path: str) -> dict[int, dict]:
    """step -> metrics row, from a JSONL file of one object per step."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise InputError(f"metrics file {path}: {e.strerror}") from None
    rows: dict[int, dict] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"metrics file {path}:{n}: not a step record ({e})") from None
        if step in rows:
            raise InputError(f"metrics file {path}:{n}: step {step} appears twice "
                             "(a file appended to by two runs?)")
        rows[step] = row
    if not rows:
        raise InputError(f"metrics file {path}: no steps")
    return rows


def read_golden(path: str) -> dict:
    try:
        with open(path) as f:
            golden = json.load(f)
    except FileNotFoundError:
        raise InputError(f"no golden file at {path}") from None
    except (OSError, ValueError) as e:
        raise InputError(f"golden file {path}: {e}") from None
    tol = golden.get("tolerance")
    if not isinstance(tol, dict) or not tol:
        raise InputError(f"golden file {path}: 'tolerance' must map metric -> {{rtol, atol}}")
    for metric, t in tol.items():
        if not isinstance(t, dict) or not {"rtol", "atol"} <= t.keys():
            raise InputError(f"golden file {path}: tolerance.{metric} needs rtol and atol")
        if t["rtol"] < 0 or t["atol"] < 0:
            raise InputError(f"golden file {path}: tolerance.{metric} must be >= 0")
    if not isinstance(golden.get("steps"), list) or not golden["steps"]:
        raise InputError(f"golden file {path}: 'steps' must be a non-empty list")
    return golden


def compare(rows: dict[int, dict], golden: dict) -> tuple[list[str], int]:
    """Failure messages (empty when the run matches) and the number of values checked."""
    failures: list[str] = []
    want_steps = {int(s["step"]): s for s in golden["steps"]}
    missing = sorted(want_steps.keys() - rows.keys())
    extra = sorted(rows.keys() - want_steps.keys())
    if missing:
        failures.append(f"steps in the golden file but not in the run: {missing}")
    if extra:
        failures.append(f"steps in the run but not in the golden file: {extra}")
    checked = 0
    for step in sorted(want_steps.keys() & rows.keys()):
        for metric, tol in golden["tolerance"].items():
            want = want_steps[step].get(metric)
            got = rows[step].get(metric)
            if want is None:
                failures.append(f"step {step}: golden file has no {metric}")
                continue
            if not isinstance(got, (int, float)):
                failures.append(f"step {step}: run has no numeric {metric} (got {got!r})")
                continue
            checked += 1
            bound = tol["atol"] + tol["rtol"] * abs(want)
            diff = abs(got - want)
            ok = math.isfinite(got) and diff <= bound
            print(f"  step {step:>4}  {metric:<14} got {got:+.6g}  want {want:+.6g}  "
                  f"|diff| {diff:.3g} <= {bound:.3g}  {'ok' if ok else 'FAIL'}")
            if not ok:
                failures.append(f"step {step}: {metric} {got!r} vs golden {want!r} "
                                f"(|diff| {diff:.3g} > atol {tol['atol']} + rtol {tol['rtol']} "
                                f"* |golden| = {bound:.3g})")
    return failures, checked


def write_golden(rows: dict[int, dict], path: str, a) -> None:
    for step, row in rows.items():
        for metric in a.metric:
            v = row.get(metric)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InputError(f"step {step}: {metric} is {v!r}; refusing to bless it as golden")
    golden = {
        "backend": a.backend,
        "recipe": a.recipe,
        "note": "written by ci/check_golden.py --write-golden; tighten the tolerance after "
                "measuring the run-to-run spread",
        "tolerance": {m: {"rtol": a.rtol, "atol": a.atol} for m in a.metric},
        "steps": [{"step": s, **{m: rows[s][m] for m in a.metric}} for s in sorted(rows)],
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(rows)} steps of {', '.join(a.metric)} "
          f"(rtol {a.rtol}, atol {a.atol})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="JSONL from `longmoe train --metrics-out`")
    p.add_argument("golden", help="golden JSON, e.g. ci/golden/cuda_gpu_smoke.json")
    p.add_argument("--write-golden", action="store_true",
                   help="write GOLDEN from METRICS instead of checking (overwrites it)")
    p.add_argument("--metric", action="append",
                   help="with --write-golden: a metric to record (repeatable; default: loss)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help=f"with --write-golden (default {DEFAULT_RTOL})")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                   help=f"with --write-golden (default {DEFAULT_ATOL})")
    p.add_argument("--backend", help="with --write-golden: recorded in the file")
    p.add_argument("--recipe", help="with --write-golden: recorded in the file")
    p.add_argument("--report", help="also write the verdict as JSON here (a CI artifact)")
    return p


def _report(path: str | None, **verdict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(verdict, f, indent=1)
            f.write("\n")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.metric = a.metric or ["loss"]
    if a.rtol < 0 or a.atol < 0:
        print("error: --rtol and --atol must be >= 0", file=sys.stderr)
        return 2
    try:
        rows = read_metrics(a.metrics)
        if a.write_golden:
            write_golden(rows, a.golden, a)
            _report(a.report, ok=True, wrote_golden=a.golden, steps=len(rows))
            return 0
        golden = read_golden(a.golden)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        if str(e).startswith("no golden file"):
            print(f"  To bless this run as the golden file (after checking it looks right):\n"
                  f"    python ci/check_golden.py {a.metrics} {a.golden} --write-golden\n"
                  f"  or rerun the tier with: bash ci/run.sh gpu --write-golden", file=sys.stderr)
        _report(a.report, ok=False, error=str(e), metrics=a.metrics, golden=a.golden)
        return 2
    print(f"{a.metrics} vs {a.golden}:")
    failures, checked = compare(rows, golden)
    _report(a.report, ok=not failures, checked=checked, failures=failures,
            metrics=a.metrics, golden=a.golden)
    if failures:
        print(f"FAIL: {len(failures)} problem(s):", file=sys.stderr)
        for msg in failures:
            print(f"  - {msg}", file=sys.stderr)
        return 1
    print(f"ok: {checked} values within tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
