"""Document-causal attention over one packed row at the Qwen3.5 attention shape (16 query / 2 KV
heads of dim 256, bf16): the `varlen` implementation (torch's varlen_attn, flash kernels) against
one causal SDPA call per segment through a named SDPA backend (cuDNN by default), each segment a
sample of a log-normal GRPO length mix. Per row: the first forward+backward (a new set of segment
lengths: the backend's per-shape setup included), then device times of the forward and of
forward+backward, their TFLOP/s over the segments' causal FLOPs, and the largest difference
between the two outputs.

    python bench/document_attention.py --rows 3 --out results/h200/document_attention.json

What it answers: whether packed rows should leave varlen for per-segment calls. The per-segment
calls run a new shape for each new sample length; the first-call column is what that costs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F


def lengths(seed: int, total: int, mean_log: float, sigma: float) -> list[int]:
    """Sample lengths (log-normal, at least 64 tokens) filling `total` tokens."""
    g = torch.Generator().manual_seed(seed)
    out, left = [], total
    while left > 0:
        n = int(torch.empty(1).log_normal_(mean_log, sigma, generator=g).clamp(64, total))
        out.append(min(n, left))
        left -= out[-1]
    return out


def per_segment(q, k, v, lens: list[int], backend: str):
    """One causal SDPA call per segment of [1, S, N, D] q against [1, S, K, D] k and v."""
    from longmoe.ops.attention import sdpa_backends
    outs = []
    with sdpa_backends([backend]):
        for a, b, c in zip(q.split(lens, 1), k.split(lens, 1), v.split(lens, 1)):
            o = F.scaled_dot_product_attention(a.transpose(1, 2), b.transpose(1, 2),
                                               c.transpose(1, 2), is_causal=True,
                                               enable_gqa=q.shape[2] != k.shape[2])
            outs.append(o.transpose(1, 2))
    return torch.cat(outs, 1)


def run_row(seed: int, args, be) -> dict:
    from longmoe.bench import median_ms
    dev = be.device(0)
    from longmoe.ops.document_attention import DocumentSpan, varlen_document_attention
    lens = lengths(seed, args.tokens, args.mean_log, args.sigma)
    seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))[None].to(dev)
    span = DocumentSpan(seg)
    g = torch.Generator(device=dev).manual_seed(seed)
    S, N, K, D = args.tokens, args.heads, args.kv_heads, args.head_dim
    q, k, v = (torch.randn(1, S, h, D, device=dev, dtype=torch.bfloat16, generator=g)
               .requires_grad_() for h in (N, K, K))
    go = torch.randn(1, S, N, D, device=dev, dtype=torch.bfloat16, generator=g)
    flops = sum(2 * n * n * N * D for n in lens)  # causal: half of 4 * n^2 * N * D
    row = {"lens": lens, "segments": len(lens), "causal_tflop": flops / 1e12}
    arms = {"varlen": lambda: varlen_document_attention(q, k, v, span),
            f"segments_{args.backend}": lambda: per_segment(q, k, v, lens, args.backend)}
    for name, fn in arms.items():
        be.synchronize()
        t = time.perf_counter()
        torch.autograd.grad(fn(), (q, k, v), go)
        be.synchronize()
        first = (time.perf_counter() - t) * 1e3
        with torch.no_grad():
            fw = median_ms(be, fn, args.iters)
        fb = median_ms(be, lambda: torch.autograd.grad(fn(), (q, k, v), go), args.iters)
        row[name] = {"first_fwd_bwd_ms": first, "fwd_ms": fw, "fwd_bwd_ms": fb,
                     "fwd_tflops": flops / fw / 1e9, "bwd_tflops": 2.5 * flops / (fb - fw) / 1e9}
    with torch.no_grad():
        a, b = (fn().float() for fn in arms.values())
        row["max_abs_diff"] = float((a - b).abs().max())
    return row


def table(report: dict) -> str:
    names = [k for k in report["rows"][0] if isinstance(report["rows"][0][k], dict)]
    head = "| segments | " + " | ".join(f"{n} first / fwd / fwd+bwd ms" for n in names) + \
        " | max abs diff |\n|---|" + "---|" * len(names) + "---|\n"
    lines = []
    for r in report["rows"]:
        cells = [f"{r[n]['first_fwd_bwd_ms']:.0f} / {r[n]['fwd_ms']:.2f} / {r[n]['fwd_bwd_ms']:.2f}"
                 for n in names]
        lines.append(f"| {r['segments']} | " + " | ".join(cells) + f" | {r['max_abs_diff']:.3g} |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=3, help="packed rows, each its own length mix")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--mean-log", type=float, default=8.5, help="log-normal mu of sample lengths")
    p.add_argument("--sigma", type=float, default=0.6)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--backend", default="cudnn", help="the SDPA backend of the per-segment arm")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    from longmoe.backends import active_backend
    from longmoe.bench import write_json_and_table
    be = active_backend()
    if be.device(0).type == "cpu":
        print("document_attention: needs a GPU (varlen_attn runs on GPUs only)", file=sys.stderr)
        return 2
    rows = [run_row(seed, args, be) for seed in range(1, args.rows + 1)]
    report = {"benchmark": "document-attention", "args": vars(args), "rows": rows}
    write_json_and_table(report, args.out, table, be)
    return 0


if __name__ == "__main__":
    sys.exit(main())
