"""`longmoe bench grouped-mm`: the routed experts' six grouped GEMMs (two forward, two dgrad, two
wgrad) per implementation, at the MoE layer's shapes: torch._grouped_mm against the portable
Triton kernels (each tile config given), the loop as a floor where asked.

Rows per expert are drawn from a multinomial over the experts (balanced in expectation), so group
sizes are uneven as after real routing. Per (T, op, impl, config): median ms (device events) and
TFLOP/s of 2*M*K*N.

Legend: T tokens, K top-k, M = T*K rows, L experts on the rank, H hidden, F expert FFN.
"""

from __future__ import annotations

import datetime

import torch

from longmoe.bench import median_ms


def _cases(M, L, H, F, device, dtype, g):
    from longmoe.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
    sizes = torch.multinomial(torch.ones(L), M, replacement=True, generator=g).bincount(
        minlength=L).tolist()
    x = torch.randn(M, H, device=device, dtype=dtype)
    a = torch.randn(M, F, device=device, dtype=dtype)
    gy = torch.randn(M, H, device=device, dtype=dtype)
    gh = torch.randn(M, 2 * F, device=device, dtype=dtype)
    w_in = torch.randn(L, H, 2 * F, device=device, dtype=dtype) / H ** 0.5
    w_out = torch.randn(L, F, H, device=device, dtype=dtype) / F ** 0.5
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)

    def mm(inp, w):
        return lambda impl: grouped_mm(inp, w, sizes, offs, impl=impl)

    def wg(inp, dy, w):
        return lambda impl: grouped_mm_wgrad(inp, dy, sizes, w, impl, offs)
    return {
        "up (x W_in)": (mm(x, w_in), 2 * M * H * 2 * F),
        "down (a W_out)": (mm(a, w_out), 2 * M * F * H),
        "dgrad down (gy W_out^T)": (mm(gy, w_out.transpose(1, 2)), 2 * M * H * F),
        "dgrad up (gh W_in^T)": (mm(gh, w_in.transpose(1, 2)), 2 * M * 2 * F * H),
        "wgrad W_out (a^T gy)": (wg(a, gy, w_out), 2 * M * F * H),
        "wgrad W_in (x^T gh)": (wg(x, gh, w_in), 2 * M * H * 2 * F),
    }


def run_bench(tokens, top_k, experts, hidden, ffn, dtype, impls, configs, iters, device) -> dict:
    from longmoe.backends import get_backend
    from longmoe.ops.grouped_mm import GROUPED_MM
    backend = get_backend(device)
    dev = backend.device(0)
    dt = getattr(torch, dtype)
    probe = torch.empty(16, 16, device=dev, dtype=dt)
    rows, skipped = [], {}
    for T in tokens:
        g = torch.Generator().manual_seed(T)
        ops = _cases(T * top_k, experts, hidden, ffn, dev, dt, g)
        for impl in impls:
            why = GROUPED_MM.why_not(impl, probe, probe.view(1, 16, 16), [16])
            if why:
                skipped[impl] = why
                continue
            for cfg in (configs if impl == "triton" else [{}]):
                with backend.kernel_overrides("grouped_gemm", cfg):
                    for name, (fn, flops) in ops.items():
                        ms = median_ms(backend, lambda: fn(impl), iters)
                        rows.append({"T": T, "op": name, "impl": impl, "config": cfg or None,
                                     "ms": ms, "tflops": flops / ms / 1e9})
        del ops
    return {"bench": "grouped-mm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": backend.probe().get("device_name") or backend.name, "backend": backend.name,
            "versions": backend.versions(), "skipped": skipped,
            "shape": {"top_k": top_k, "experts": experts, "hidden": hidden, "moe_ffn": ffn,
                      "dtype": dtype}, "rows": rows}


def markdown_table(report: dict) -> str:
    lines = ["| T | op | impl | config | ms | TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in report["rows"]:
        cfg = "-" if not r["config"] else ",".join(f"{k}={v}" for k, v in r["config"].items())
        lines.append(f"| {r['T']} | {r['op']} | {r['impl']} | {cfg} | {r['ms']:.3f} | "
                     f"{r['tflops']:.0f} |")
    return "\n".join(lines)
