"""Host time of one MoE layer's fwd+bwd against its device time, per chunk count, on one GPU
(the pipeline with local all-to-alls; chunks 0: the unpipelined layer): when the host takes
longer than the device, the GPU waits on Python. Prints a JSON line per case, with the torch
operations one step dispatches (`aten_ops`, views included; a Triton kernel's launch is not one)
and the stream calls it makes (`stream_calls`: event records, waits, record_stream, stream
switches), counted in one extra untimed step (longmoe/bench/host_ops.py), and the top host
functions (cProfile) of the last C.

    python bench/host_overhead.py --tokens 16384 --chunks 0,1,2,4 --out host.json
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time

import torch

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunks", default="1,4,8")
    ap.add_argument("--rows-impl", default="auto")
    ap.add_argument("--wgrad", default="auto", help="the pipeline's weight-gradient schedule")
    ap.add_argument("--profile-ops", action="store_true",
                    help="also print the device kernels of the largest C (torch.profiler)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--fp32-matmul", default="high", help="as the trainer's impl.fp32_matmul")
    a = ap.parse_args()
    from _one_rank import dispatcher, layer
    from longmoe.bench.host_ops import count_case
    be, dev, cfg, moe = layer(a.fp32_matmul)
    moe.experts.rows_impl = a.rows_impl
    x = torch.randn(1, a.tokens, cfg.hidden_size, device=dev, dtype=torch.bfloat16,
                    requires_grad=True)
    gy = torch.randn_like(x)

    def step():
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])

    out = []
    for C in [int(c) for c in a.chunks.split(",")]:
        moe.dispatcher = dispatcher(be, dev, cfg, C, a.wgrad)
        moe.dispatcher.rows_impl = a.rows_impl
        for _ in range(3):
            step()
        be.synchronize()
        host, dev_ms = [], []
        for _ in range(a.iters):
            be.synchronize()
            with be.timer() as t:
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
            dev_ms.append(t.elapsed_ms)
        ops, calls = count_case(moe, x, gy, fold_kernels=False)
        be.synchronize()
        row = {"T": a.tokens, "chunks": C, "host_ms": statistics.median(host),
               "wall_ms": statistics.median(dev_ms), "aten_ops": ops.n,
               "stream_calls": sum(calls.values()), "rows_impl": a.rows_impl,
               "wgrad": a.wgrad}
        print(json.dumps(row), flush=True)
        out.append(row)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        step()
    pr.disable()
    be.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue()[-6000:])
    ops = None
    if a.profile_ops:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            be.synchronize()
        ops = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
        print(ops)
    if a.out:
        write_json_and_table({"bench": "host-overhead", "rows": out,
                              "profile_top": s.getvalue()[-6000:], "device_ops_5_steps": ops},
                             a.out, plain_table, be)


if __name__ == "__main__":
    main()
