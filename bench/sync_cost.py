"""What the MoE layer's one host synchronisation costs on the device: the idle time between the
device-to-host copy of the route plan (plan_routes' .tolist()) and the next kernel, while the
host builds the plan and launches the layer's next work. Also the device's total idle time per
step, for scale. One GPU; the unpipelined layer and the pipeline (local all-to-alls).

    python bench/sync_cost.py --tokens 16384,65536 --chunks 1,4 --out sync.json
"""

import argparse
import json
import statistics

import torch

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def _device_events(prof):
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def _gaps(events):
    """(idle after each device-to-host copy, total idle) in us, over the events' span."""
    after_copy, idle, busy_until = [], 0.0, None
    for i, (s, e, name) in enumerate(events):
        if busy_until is not None and s > busy_until:
            idle += s - busy_until
        busy_until = e if busy_until is None else max(busy_until, e)
        if "DtoH" in name or "Device -> Pageable" in name or "Device -> Pinned" in name:
            nxt = next((t for t, _, _ in events[i + 1:] if t >= e), None)
            if nxt is not None:
                after_copy.append(nxt - e)
    return after_copy, idle


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--chunks", default="1,4")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fp32-matmul", default="high", help="as the trainer's impl.fp32_matmul")
    ap.add_argument("--out")
    a = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile
    from _one_rank import dispatcher, layer
    be, dev, cfg, moe = layer(a.fp32_matmul)
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(1, T, cfg.hidden_size, device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        gy = torch.randn_like(x)
        for C in [0] + [int(c) for c in a.chunks.split(",")]:  # 0: the unpipelined layer
            moe.dispatcher = dispatcher(be, dev, cfg, C)

            def step():
                x.grad = None
                moe.zero_grad(set_to_none=True)
                y, aux = moe(x)
                torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])

            for _ in range(3):
                step()
            be.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:  # device only: less host
                for _ in range(a.steps):
                    step()
                be.synchronize()
            events = _device_events(prof)
            after, idle = _gaps(events)
            span = events[-1][1] - events[0][0]
            row = {"T": T, "layer": "direct" if C == 0 else f"pipeline C={C}",
                   "syncs_per_step": len(after) / a.steps,
                   "idle_after_sync_us_median": statistics.median(after) if after else None,
                   "idle_after_sync_us_per_step": sum(after) / a.steps,
                   "idle_us_per_step": idle / a.steps, "span_us_per_step": span / a.steps}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        write_json_and_table({"bench": "sync-cost", "fp32_matmul": a.fp32_matmul, "rows": rows},
                             a.out, plain_table, be)


if __name__ == "__main__":
    main()
