"""The router's three fp32 GEMMs (logits x W^T, dx = g W, dW = g^T x) at one MoE layer's shape:
which kernels run and how long they take under each fp32 matmul precision, and the bf16-input /
fp32-output GEMM (torch.mm(..., out_dtype=float32)) beside them, with errors against fp64; the
backward's split form (g as two bf16 terms hi + lo, one bf16 GEMM each with fp32 output;
measured and not adopted) and each registered implementation's whole fwd+bwd at "high".

    python bench/router_gemm.py --tokens 16384,65536 --out router.json
"""

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters


def split_grads(g, x, w, need_dx, need_dw):
    """(g W, g^T x) with g as hi + lo bf16 terms (16 of fp32's 24 bits), stacked along the
    reduction (dx) or the rows (dW) so each is one bf16 GEMM with fp32 output."""
    E = g.shape[1]
    hi = g.to(torch.bfloat16)
    lo = (g - hi.float()).to(torch.bfloat16)
    dx = torch.mm(torch.cat([hi, lo], 1), torch.cat([w, w], 0), out_dtype=torch.float32) \
        if need_dx else None
    dw = None
    if need_dw:
        d2 = torch.mm(torch.cat([hi.t(), lo.t()], 0), x, out_dtype=torch.float32)
        dw = d2[:E] + d2[E:]
    return dx, dw


def kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sorted({ev.name[:120] for ev in p.events() if ev.device_type.name == "CUDA"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--out")
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        g0 = torch.Generator(device=dev).manual_seed(T)
        x = torch.randn(T, a.hidden, device=dev, generator=g0).bfloat16()
        w = (torch.randn(a.experts, a.hidden, device=dev, generator=g0) * 0.02).bfloat16()
        g = torch.randn(T, a.experts, device=dev, generator=g0) * 1e-3
        ref = {"fwd": x.double() @ w.double().t(), "dx": g.double() @ w.double(),
               "dw": g.double().t() @ x.double()}
        cases = {
            "fwd": {"fp32": lambda: torch.nn.functional.linear(x.float(), w.float()),
                    "bf16_out_fp32": lambda: torch.mm(x, w.t(), out_dtype=torch.float32)},
            "dx": {"fp32": lambda: g @ w.float(),
                   "bf16_out_fp32": lambda: torch.mm(g.bfloat16(), w, out_dtype=torch.float32)},
            "dw": {"fp32": lambda: g.t() @ x.float(),
                   "bf16_out_fp32": lambda: torch.mm(g.t().bfloat16(), x, out_dtype=torch.float32)},
        }
        cases["dx"]["split_bf16x2"] = lambda: split_grads(g, x, w, True, False)[0]
        cases["dw"]["split_bf16x2"] = lambda: split_grads(g, x, w, False, True)[1]
        for prec in ("highest", "high"):
            torch.set_float32_matmul_precision(prec)
            state = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                     "fp32_precision": getattr(torch.backends.cuda.matmul, "fp32_precision", None)}
            for op, variants in cases.items():
                for name, fn in variants.items():
                    if name != "fp32" and prec == "high":
                        continue  # independent of the fp32 setting
                    out = fn().double()
                    err = ((out - ref[op]).norm() / ref[op].norm()).item()
                    row = {"T": T, "op": op, "variant": name,
                           "precision": prec if name == "fp32" else "n/a", **state,
                           "ms": timed(fn), "rel_err_fp64": err, "kernels": kernels(fn)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
        # the same GEMMs inside autograd (the backward runs on autograd's device thread)
        torch.set_float32_matmul_precision("high")
        xr = x.clone().requires_grad_()
        wr = w.float().requires_grad_()

        def fb():
            y = torch.nn.functional.linear(xr.float(), wr)
            y.backward(g)
        row = {"T": T, "op": "autograd fwd+bwd", "variant": "fp32", "precision": "high",
               "ms": timed(fb), "kernels": kernels(fb)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        from longmoe.ops.router_matmul import router_logits
        wb = w.clone().requires_grad_()
        for impl in ("fp32", "mixed", "fp32", "mixed"):  # A/B/A/B
            def fb_impl(impl=impl):
                router_logits(xr, wb, impl).backward(g)
            row = {"T": T, "op": "router_logits fwd+bwd", "variant": impl, "precision": "high",
                   "ms": timed(fb_impl), "kernels": kernels(fb_impl)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if a.out:
        from longmoe.backends import active_backend
        be = active_backend()
        write_json_and_table({"bench": "router-gemm", "rows": rows}, a.out, plain_table, be)


if __name__ == "__main__":
    main()
