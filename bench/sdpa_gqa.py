"""Causal SDPA at the Qwen3.5 attention shape (16 query / 2 KV heads of dim 256, bf16): forward
and forward+backward device time per backend, with grouped-query attention passed to the kernel
(`enable_gqa=True`) against K/V expanded to every query head first (repeat_interleave, its copy
and the backward's sum over the group included in the time).

    python bench/sdpa_gqa.py --tokens 32768,65536 --backends cudnn,flash --out results/h200/sdpa_gqa.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F


def run(T: int, backend: str, mode: str, iters: int, n=16, k=2, d=256):
    from longmoe.backends import active_backend
    from longmoe.bench import median_ms
    from longmoe.ops.attention import sdpa_backends
    be = active_backend()
    dev = be.device(0)
    g = torch.Generator(device=dev).manual_seed(T)
    q = torch.randn(1, n, T, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    kk = torch.randn(1, k, T, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, k, T, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    do = torch.randn(1, n, T, d, device=dev, dtype=torch.bfloat16, generator=g)

    def fwd():
        with sdpa_backends([backend]):
            if mode == "gqa":
                return F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
            ke, ve = kk.repeat_interleave(n // k, 1), v.repeat_interleave(n // k, 1)
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (q, kk, v), do)

    try:
        with torch.no_grad():
            f = median_ms(be, fwd, iters)
        fb = median_ms(be, fwd_bwd, iters)
    except RuntimeError as e:  # a backend without a kernel for this shape
        return {"T": T, "backend": backend, "mode": mode, "error": str(e).splitlines()[0][:200]}
    flops = 2 * 2 * n * d * T * (T + 1) / 2  # QK^T and PV over the causal pairs
    return {"T": T, "backend": backend, "mode": mode, "fwd_ms": f, "fwd_bwd_ms": fb,
            "bwd_ms": fb - f, "fwd_tflops": flops / f / 1e9,
            "bwd_tflops": 2.5 * flops / (fb - f) / 1e9}


def table(r: dict) -> str:
    rows = ["| T | backend | K/V | fwd ms | fwd+bwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s |",
            "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        if "error" in x:
            rows.append(f"| {x['T']} | {x['backend']} | {x['mode']} | {x['error']} | | | | |")
        else:
            rows.append(f"| {x['T']} | {x['backend']} | {x['mode']} | {x['fwd_ms']:.2f} | "
                        f"{x['fwd_bwd_ms']:.2f} | {x['bwd_ms']:.2f} | {x['fwd_tflops']:.0f} | "
                        f"{x['bwd_tflops']:.0f} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="32768")
    p.add_argument("--backends", default="cudnn,flash")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args(argv)
    rows = [run(int(T), b, m, a.iters) for T in a.tokens.split(",")
            for b in a.backends.split(",") for m in ("gqa", "expanded")]
    from longmoe.bench import write_json_and_table
    write_json_and_table({"bench": "sdpa-gqa", "rows": rows}, a.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
