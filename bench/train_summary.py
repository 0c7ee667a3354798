"""A results JSON (and its table) from `longmoe train --metrics-out` runs: per arm, the medians of
the steps after the first (which compiles), the first step's loss, every step's record.

    python bench/train_summary.py --what "40 layers, 32 experts, 32K tokens" \
        --provenance OUT/weight_sync.json --command "longmoe train ..." \
        --arm chunked_triton=OUT/train_a.jsonl --arm chunked_compiled=OUT/train_b.jsonl \
        --out results/h200/train_40l_32e.json

The metrics files carry no provenance of their own: `--provenance` names a bench report written
by the same run on the same machine, whose date, commit, device and versions are copied;
`--date`/`--commit` give this run's where that report is of another run on the same image (the
report then says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from longmoe.bench import write_json_and_table

KEYS = ("step_time_s", "tokens_per_s", "hw_tflops_per_gpu", "model_tflops_per_gpu")


def summarise(path: str) -> dict:
    steps = [json.loads(line) for line in open(path) if line.strip()]
    if len(steps) < 2:
        raise ValueError(f"{path}: {len(steps)} step(s); the summary needs a step after the first")
    steady = steps[1:]
    out = {f"median_{k}": statistics.median(s[k] for s in steady) for k in KEYS}
    out.update(steady_steps=f"2-{len(steps)}", first_loss=steps[0]["loss"],
               peak_mem_gib=max(s["peak_mem_bytes"] for s in steps) / 2**30, steps=steps)
    return out


def markdown_table(r: dict) -> str:
    rows = [r["what"], "", "| arm | s a step | tokens/s | hw TFLOPS/GPU | model TFLOPS/GPU "
            "| peak GiB | first loss |", "|---|---|---|---|---|---|---|"]
    for name, a in r["arms"].items():
        rows.append(f"| {name} | {a['median_step_time_s']:.3f} | {a['median_tokens_per_s']:,.0f} "
                    f"| {a['median_hw_tflops_per_gpu']:.1f} | {a['median_model_tflops_per_gpu']:.1f} "
                    f"| {a['peak_mem_gib']:.2f} | {a['first_loss']:.5f} |")
    rows += ["", *(f"- {name}: `{a['sets']}`" for name, a in r["arms"].items() if a.get("sets"))]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--what", required=True, help="what was trained (model, tokens, settings)")
    p.add_argument("--arm", action="append", required=True, metavar="NAME=METRICS.jsonl")
    p.add_argument("--sets", action="append", default=[], metavar="NAME=--set k=v ...",
                   help="what an arm adds to --command (recorded per arm)")
    p.add_argument("--provenance", help="a bench JSON of the same run; without it the date, "
                                        "commit, device and versions are this machine's now "
                                        "(run it where the arms ran)")
    p.add_argument("--command", required=True, help="the train command (arms differ in --set)")
    p.add_argument("--date", help="the run's date (UTC), when the provenance report is of "
                                  "another run on the same machine image")
    p.add_argument("--commit", help="the run's commit, likewise")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    prov = json.load(open(a.provenance)) if a.provenance else {}
    report = {"bench": "train", "what": a.what, "command": a.command,
              **{k: prov[k] for k in ("date", "commit", "device", "versions") if prov.get(k)},
              "arms": {}}
    if a.provenance and (a.date or a.commit):
        report.update({k: v for k, v in (("date", a.date), ("commit", a.commit)) if v})
        report["provenance"] = (f"date and commit of this run; device and versions from "
                                f"{prov.get('bench')} at {prov.get('commit')} "
                                f"({prov.get('date')}) on the same machine image")
    sets = dict(x.partition("=")[::2] for x in a.sets)
    for arm in a.arm:
        name, _, path = arm.partition("=")
        report["arms"][name] = {"sets": sets.get(name, ""), **summarise(path)}
    write_json_and_table(report, a.out, markdown_table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
