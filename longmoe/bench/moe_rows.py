"""`longmoe bench moe-rows`: the MoE layer's row ops one by one, eager reference against the
Triton kernels (and each Triton tile config given), at the layer's real shapes.

Per (T, op, impl, config): median ms (device events, after warm-up) and the bandwidth of the
op's least traffic (each input read once, each output written once), so a kernel's distance from
the memory roofline shows directly.

Legend: T tokens, K top-k, A = T*K rows, H hidden, F expert FFN.
"""

from __future__ import annotations

import datetime

import torch

from longmoe.bench import median_ms


def _ops(T, K, H, F, device, dtype, g):
    from longmoe.ops.moe_rows import gather_scale, gather_sum, swiglu_backward, swiglu_forward
    A, e = T * K, torch.empty((), dtype=dtype).element_size()
    order = torch.randperm(A, device=device, generator=g)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(A, device=device)
    tok, w = order // K, torch.rand(A, device=device, generator=g)
    w_sorted = w[order]
    y = torch.randn(A, H, device=device, dtype=dtype, generator=g)
    gT = torch.randn(T, H, device=device, dtype=dtype, generator=g)
    h = torch.randn(A, 2 * F, device=device, dtype=dtype, generator=g)
    ga = torch.randn(A, F, device=device, dtype=dtype, generator=g)
    return {
        # op: (fn(impl), least bytes)
        "combine": (lambda i: gather_sum(y, inv, w, K, impl=i), (A * H + T * H) * e + A * 12),
        "combine_bwd": (lambda i: gather_scale(gT, tok, w_sorted, y, impl=i),
                        (T * H + 2 * A * H) * e + A * 16),
        "dispatch_bwd": (lambda i: gather_sum(y, inv, None, K, impl=i), (A * H + T * H) * e + A * 8),
        "swiglu": (lambda i: swiglu_forward(h, impl=i), 3 * A * F * e),
        "swiglu_bwd+dot": (lambda i: swiglu_backward(h, ga, with_dot=True, impl=i),
                           6 * A * F * e + A * 4),
    }


def run_bench(tokens, top_k, hidden, ffn, dtype, configs, iters, device) -> dict:
    from longmoe.backends import get_backend
    from longmoe.ops.moe_rows import MOE_ROWS
    backend = get_backend(device)
    dev = backend.device(0)
    dt = getattr(torch, dtype)
    rows = []
    why_not = MOE_ROWS.why_not("triton", torch.empty(1, device=dev, dtype=dt))
    impls = [("reference", None)] + ([] if why_not else [("triton", c) for c in configs])
    for T in tokens:
        g = torch.Generator(device=dev).manual_seed(T)
        ops = _ops(T, top_k, hidden, ffn, dev, dt, g)
        for name, (fn, nbytes) in ops.items():
            for impl, cfg in impls:
                with backend.kernel_overrides("moe_rows", cfg):
                    ms = median_ms(backend, lambda: fn(impl), iters)
                rows.append({"T": T, "op": name, "impl": impl, "config": cfg, "ms": ms,
                             "least_bytes": nbytes, "GBps": nbytes / ms / 1e6})
        del ops
    return {"bench": "moe-rows", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": backend.probe().get("device_name") or backend.name,
            "backend": backend.name, "versions": backend.versions(),
            "shape": {"top_k": top_k, "hidden": hidden, "moe_ffn": ffn, "dtype": dtype},
            "shipped_config": backend.kernel_config("moe_rows"), "triton_skipped": why_not,
            "rows": rows}


def markdown_table(report: dict) -> str:
    lines = ["| T | op | impl | config | ms | GB/s (least bytes) |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        cfg = "-" if r["config"] is None else ",".join(f"{k}={v}" for k, v in r["config"].items())
        lines.append(f"| {r['T']} | {r['op']} | {r['impl']} | {cfg} | {r['ms']:.3f} | "
                     f"{r['GBps']:.0f} |")
    return "\n".join(lines)
