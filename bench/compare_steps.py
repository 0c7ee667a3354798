"""Two `longmoe train --metrics-out` runs of the same batch in two layouts (one GPU against CP or EP
ranks), step by step: the loss, gradient norm (before clipping), mean log-prob and entropy
within |a - b| <= rtol |a| + atol, the trained tokens equal. Writes a results JSON (device, versions,
date, commit stamped from this machine) and exits 1 when any step is out of tolerance.

    python bench/compare_steps.py ONE.jsonl RANKS.jsonl --what "..." --out results/x.json
"""

from __future__ import annotations

import argparse
import json
import sys

# (rtol, atol). Layouts differ in reduction order, so bf16 runs differ by rounding. The policy
# loss of a group-centred batch sits near 0 (on-policy, -mean(A) up to rounding), so it gets an
# absolute floor; the gradient norm, log-probs and entropy are the informative ones.
TOL = {"loss": (1e-2, 1e-3), "grad_norm": (3e-2, 0.0), "mean_logprob": (1e-2, 0.0),
       "entropy": (1e-2, 0.0)}
EXACT = ("trained_tokens", "useful_tokens")


def compare(a: list[dict], b: list[dict], tol: dict = TOL) -> dict:
    if len(a) != len(b) or not a:
        raise ValueError(f"the runs have {len(a)} and {len(b)} steps; need the same, at least one")
    steps, ok = [], True
    for x, y in zip(a, b):
        row = {"step": x["step"]}
        for k, (rtol, atol) in tol.items():
            if k in x and k in y:
                diff = abs(x[k] - y[k])
                good = diff <= rtol * abs(x[k]) + atol
                row[k] = {"one": x[k], "ranks": y[k], "diff": diff,
                          "rel": diff / max(abs(x[k]), 1e-12), "ok": good}
                ok &= good
        for k in EXACT:
            if k in x and k in y:
                row[k] = {"one": x[k], "ranks": y[k], "ok": x[k] == y[k]}
                ok &= x[k] == y[k]
        steps.append(row)
    return {"ok": bool(ok), "tolerance": tol, "steps": steps}


def markdown_table(r: dict) -> str:
    rows = [r["what"], "", "| step | field | one | ranks | abs diff | ok |",
            "|---|---|---|---|---|---|"]
    for s in r["steps"]:
        for k, v in s.items():
            if k != "step":
                rel = f"{v['diff']:.1e}" if "diff" in v else "exact"
                rows.append(f"| {s['step']} | {k} | {v['one']:.6g} | {v['ranks']:.6g} | {rel} "
                            f"| {'yes' if v['ok'] else 'NO'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("one")
    p.add_argument("ranks")
    p.add_argument("--what", required=True)
    p.add_argument("--out")
    a = p.parse_args(argv)
    load = lambda f: [json.loads(line) for line in open(f) if line.strip()]  # noqa: E731
    try:
        report = {"bench": "compare_steps", "what": a.what, **compare(load(a.one), load(a.ranks))}
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from longmoe.bench import write_json_and_table
    write_json_and_table(report, a.out, markdown_table)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
