"""Device time of a profiled step by kernel and by kind, from the Chrome trace `longmoe train
--profile DIR` writes (trace_rank0.json.gz).

    python bench/trace_kernels.py DIR/trace_rank0.json.gz --out results/h200/step_kernels.json

Kinds are matched on the kernel's name, first match wins (KINDS below); "other" is what no pattern
names. Busy time is the union of all kernel intervals on the device (streams overlapping count
once); the sums per kind add each kernel's own duration.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys

KINDS = [  # (kind, pattern on the kernel name)
    ("attention", r"sdpa|fmha|flash|attn|cudnn"),
    ("gated_delta", r"gdn_|l2norm_rows|affine_scan|chunk_gated|recompute_w_u|solve_tril"),
    ("linear_ce_rows", r"ce_row"),
    ("moe_rows", r"gather_sum|gather_scale|swiglu"),
    ("grouped_gemm", r"grouped_mm|grouped_gemm|GroupedGemm"),
    ("dense_gemm", r"gemm|cutlass|xmma|nvjet|wgmma|sm90_|sm80_|cublas|Kernel2"),
    ("optimizer", r"multi_tensor|adam|Adam"),
    ("inductor", r"^triton_"),
    ("sort_scan_topk", r"sort|Sort|scan|Scan|topk|TopK|radix|Radix|cub::"),
    ("reduce", r"reduce_kernel|Reduce"),
    ("copy_cast", r"copy|Copy|memcpy|Memcpy|cat_|CatArray|to_copy|memset|Memset|fill"),
    ("elementwise", r"elementwise|vectorized|unrolled|Elementwise"),
]


def kind_of(name: str) -> str:
    for kind, pat in KINDS:
        if re.search(pat, name):
            return kind
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarise(trace: dict, top: int) -> dict:
    per_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    per_kind: dict[str, float] = collections.defaultdict(float)
    intervals = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name, dur = ev.get("name", "?"), float(ev.get("dur", 0.0))
        per_name[name][0] += dur
        per_name[name][1] += 1
        per_kind[kind_of(name) if ev["cat"] == "kernel" else "copy_cast"] += dur
        intervals.append((float(ev["ts"]), float(ev["ts"]) + dur))
    if not intervals:
        raise ValueError("the trace holds no device kernels (was it profiled on a GPU?)")
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {
        "span_ms": span / 1e3, "busy_ms": busy_time(intervals) / 1e3,
        "kernel_sum_ms": sum(v[0] for v in per_name.values()) / 1e3,
        "by_kind_ms": {k: v / 1e3 for k, v in sorted(per_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "kind": kind_of(n), "ms": v[0] / 1e3, "calls": v[1]}
                        for n, v in rows[:top]],
    }


def markdown_table(r: dict) -> str:
    lines = [f"span {r['span_ms']:.1f} ms, device busy {r['busy_ms']:.1f} ms, kernels summed "
             f"{r['kernel_sum_ms']:.1f} ms", "", "| kind | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in r["by_kind_ms"].items()]
    lines += ["", "| kernel | kind | calls | ms |", "|---|---|---|---|"]
    lines += [f"| `{t['name'][:90]}` | {t['kind']} | {t['calls']} | {t['ms']:.2f} |"
              for t in r["top_kernels"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", help="a Chrome trace (.json or .json.gz)")
    p.add_argument("--top", type=int, default=60, help="kernels listed by name")
    p.add_argument("--what", default="", help="what was profiled (recorded in the report)")
    p.add_argument("--out", help="FILE.json (and FILE.md); without it the table is printed")
    a = p.parse_args(argv)
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        report = {"bench": "step-kernels", "what": a.what, **summarise(json.load(f), a.top)}
    if a.out:
        from longmoe.bench import write_json_and_table
        write_json_and_table(report, a.out, markdown_table)
    else:
        print(markdown_table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
