"""Where one MoE layer's memory goes, per phase, on one GPU: the chunk pipeline (local
all-to-alls) per chunk count and weight-gradient schedule, beside the unpipelined layer.

Per case, in bytes above what was allocated before the step: the forward's peak, what the
forward leaves behind (the saved set plus the output), the backward's peak, and the median
fwd+bwd time. The analytic saved set of the pipeline is its expert inputs and first-GEMM outputs,
A x (H + 2F) elements (A = T x K rows).

    python bench/pipeline_memory.py --tokens 16384,65536 --chunks 1,4,8 --out mem.json
"""

import argparse
import json
import statistics

import torch

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--chunks", default="1,2,4,8")
    ap.add_argument("--wgrad", default="in_chunks,delayed")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--fp32-matmul", default="high", help="as the trainer's impl.fp32_matmul")
    a = ap.parse_args()
    from _one_rank import dispatcher, layer
    be, dev, cfg, moe = layer(a.fp32_matmul)
    H, F, K = cfg.hidden_size, cfg.moe_ffn_size, cfg.top_k
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(1, T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)
        gy = torch.randn_like(x)
        cases = [("direct", 1, None)] + [("pipeline", int(c), w) for w in a.wgrad.split(",")
                                         for c in a.chunks.split(",")]
        for kind, C, wgrad in cases:
            moe.dispatcher = dispatcher(be, dev, cfg, 0 if kind == "direct" else C, wgrad)
            times, fwd, kept, bwd = [], [], [], []
            for i in range(2 + a.iters):
                x.grad = None
                moe.zero_grad(set_to_none=True)
                be.synchronize()
                base = be.memory_allocated()
                be.reset_peak_memory()
                with be.timer() as t:
                    y, aux = moe(x)
                    be.synchronize()
                    fwd.append(be.peak_memory_bytes() - base)
                    kept.append(be.memory_allocated() - base)
                    be.reset_peak_memory()
                    torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])
                bwd.append(be.peak_memory_bytes() - base)
                times.append(t.elapsed_ms)
                del y, aux
            A = T * K
            row = {"T": T, "kind": kind, "chunks": C, "wgrad": wgrad,
                   "ms": statistics.median(times[2:]),  # the in-between sync is inside the time
                   "fwd_peak_gib": max(fwd[2:]) / 2**30, "after_fwd_gib": max(kept[2:]) / 2**30,
                   "bwd_peak_gib": max(bwd[2:]) / 2**30,
                   "analytic_saved_gib": A * (H + 2 * F) * 2 / 2**30,
                   "weights_gib": sum(p.numel() for p in moe.experts.parameters()) * 2 / 2**30}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        write_json_and_table({"bench": "pipeline-memory", "rows": rows}, a.out, plain_table, be)


if __name__ == "__main__":
    main()
