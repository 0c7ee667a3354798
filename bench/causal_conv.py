"""The Gated DeltaNet layer's depthwise causal conv + SiLU: the Triton kernels
(ops/kernels/causal_conv.py) against inductor's compiled `causal_conv_silu` on the same tensors,
forward and forward+backward through autograd, plain, with a halo (context parallelism), with
packed rows' history and with both; device time, median of timed calls.

    python bench/causal_conv.py --tokens 32768 --channels 8192 --out results/h200/causal_conv.json

`--configs` (a JSON list of causal_conv tile overrides) adds a row per config for the Triton path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch


def _inputs(B, S, C, K, dev, samples=32):
    g = torch.Generator(device=dev).manual_seed(S * C + K)
    r = lambda *s: torch.randn(*s, device=dev, generator=g).to(torch.bfloat16)  # noqa: E731
    x, w, halo, dy = r(B, S, C), r(C, K) * 0.5, r(B, K - 1, C), r(B, S, C)
    # `samples` samples a row at random places: tokens since each one's sample began
    starts = torch.zeros(B, S, dtype=torch.bool, device=dev)
    starts[:, 0] = True
    starts[:, torch.randint(1, S, (samples - 1,), generator=g, device=dev)] = True
    t = torch.arange(S, device=dev).expand(B, S)
    history = t - torch.where(starts, t, torch.zeros_like(t)).cummax(1).values
    return x, w, halo, history, dy


def run(S: int, C: int, K: int, iters: int, configs: list[dict]) -> list[dict]:
    from longmoe.backends import active_backend
    from longmoe.bench import median_ms
    from longmoe.model.deltanet import causal_conv_silu
    from longmoe.ops.compiled import compiled
    from longmoe.ops.kernels.causal_conv import TABLE_KEY, causal_conv_silu_triton
    be = active_backend()
    dev = be.device(0)
    x, w, halo, history, dy = _inputs(1, S, C, K, dev)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    variants = {"plain": (None, None), "halo": (halo, None), "history": (None, history),
                "halo+history": (halo, history)}
    impls = [("compiled", {}, compiled(causal_conv_silu))]
    impls += [("triton", cfg, causal_conv_silu_triton) for cfg in configs]
    rows = []
    for name, cfg, fn in impls:
        ctx = be.kernel_overrides(TABLE_KEY, cfg) if cfg else contextlib.nullcontext()
        with ctx:
            for var, (h, hist) in variants.items():
                def fwd():
                    return fn(x, w, h, hist)

                def fwd_bwd():
                    torch.autograd.grad(fn(xr, wr, h, hist), (xr, wr), dy)
                with torch.no_grad():
                    f = median_ms(be, fwd, iters)
                fb = median_ms(be, fwd_bwd, iters)
                rows.append({"impl": name, "tiles": cfg or None, "variant": var, "tokens": S,
                             "channels": C, "taps": K, "fwd_ms": f, "fwd_bwd_ms": fb,
                             "fwd_TBps": 2 * x.numel() * 2 / f / 1e9})
    return rows


def table(r: dict) -> str:
    lines = ["| impl | tiles | variant | fwd ms | fwd+bwd ms | fwd TB/s (x read, y written) |",
             "|---|---|---|---|---|---|"]
    for x in r["rows"]:
        tiles = ",".join(f"{k}={v}" for k, v in (x["tiles"] or {}).items()) or "table"
        lines.append(f"| {x['impl']} | {tiles if x['impl'] == 'triton' else ''} | {x['variant']} "
                     f"| {x['fwd_ms']:.3f} | {x['fwd_bwd_ms']:.3f} | {x['fwd_TBps']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--channels", type=int, default=8192)
    p.add_argument("--taps", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", help="JSON list of causal_conv tile overrides ([{}]: the table's)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    configs = json.loads(a.configs) if a.configs else [{}]
    rows = run(a.tokens, a.channels, a.taps, a.iters, configs)
    from longmoe.bench import write_json_and_table
    write_json_and_table({"bench": "causal-conv", "rows": rows}, a.out, table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
