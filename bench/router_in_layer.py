"""Why a faster router does (or does not) shorten the MoE layer: per router implementation, A/B/A/B
in one process, the unpipelined layer's fwd+bwd on one GPU under the CUDA profiler: span, busy and
idle device time per step, the kernels whose total time differs most between the two, and the
longest idle gaps with the kernels on either side.

    python bench/router_in_layer.py --tokens 65536 --out router_in_layer.json
"""

import argparse
import collections
import json

import torch

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def _events(prof):
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA
                  and e.time_range.end > e.time_range.start)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--chunks", type=int, default=0, help="0: the unpipelined layer")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from _one_rank import dispatcher, layer
    be, dev, cfg, moe = layer("high")
    moe.dispatcher = dispatcher(be, dev, cfg, a.chunks)
    x = torch.randn(1, a.tokens, cfg.hidden_size, device=dev, dtype=torch.bfloat16,
                    requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        x.grad = None
        moe.zero_grad(set_to_none=True)
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])

    rows, per_impl = [], {}
    for impl in ("reference", "mixed", "reference", "mixed"):
        moe.router.matmul = impl
        for _ in range(3):
            step()
        be.synchronize()
        with be.timer() as t:
            for _ in range(5):
                step()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step()
            be.synchronize()
        ev = _events(prof)
        busy, idle, end, gaps = 0.0, 0.0, None, []
        for i, (s, e, name) in enumerate(ev):
            if end is not None and s > end:
                idle += s - end
                gaps.append((s - end, ev[i - 1][2][:60], name[:60]))
            busy += max(0.0, e - max(s, end if end is not None else s))
            end = e if end is None else max(end, e)
        kern = collections.Counter()
        for s, e, name in ev:
            kern[name[:90]] += (e - s) / a.steps
        per_impl.setdefault(impl, []).append(kern)
        row = {"impl": impl, "T": a.tokens, "chunks": a.chunks, "ms_timed": t.elapsed_ms / 5,
               "span_ms": (ev[-1][1] - ev[0][0]) / a.steps / 1e3,
               "busy_ms": busy / a.steps / 1e3, "idle_ms": idle / a.steps / 1e3,
               "top_gaps_us": [(round(g), b, n) for g, b, n in sorted(gaps, reverse=True)[:6]]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    f32, mix = per_impl["reference"][-1], per_impl["mixed"][-1]
    diff = sorted(((mix[k] - f32[k], k) for k in set(f32) | set(mix)), key=lambda d: abs(d[0]))
    kernel_diff = [(round(d), k) for d, k in reversed(diff[-12:])]
    print("kernel us/step, mixed - fp32:", json.dumps(kernel_diff, indent=0))
    if a.out:
        write_json_and_table({"bench": "router-in-layer", "rows": rows,
                              "kernel_diff_us_per_step": kernel_diff}, a.out, plain_table, be)


if __name__ == "__main__":
    main()
