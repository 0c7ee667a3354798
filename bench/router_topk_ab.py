"""The router's top-k alone changed, A/B/A in one process: the unpipelined MoE layer (what EP=1
training runs) and the pipeline at C = 4, fwd+bwd, with torch.topk against the Triton kernel,
every other row op on its default.

    python bench/router_topk_ab.py --tokens 16384,65536 --out topk_ab.json
"""

import argparse
import datetime
import json
import statistics

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fp32-matmul", default="high", help="as the trainer's impl.fp32_matmul")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_float32_matmul_precision(a.fp32_matmul)
    from longmoe.backends import active_backend
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    be = active_backend()
    dev = be.device(0)
    cfg = get_preset("qwen3.5-35b-a3b")
    moe = MoE(cfg)
    init_params(moe, cfg, 0)
    moe.to(device=dev, dtype=torch.bfloat16)
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(1, T, cfg.hidden_size, device=dev, dtype=torch.bfloat16,
                        requires_grad=True)
        gy = torch.randn_like(x)
        for layer in ("direct", "pipeline C=4"):
            moe.dispatcher = (ExpertDispatcher(cfg.num_experts) if layer == "direct" else
                              ExpertDispatcher(cfg.num_experts, None, 4,
                                               transport=be.a2a("auto", dev),
                                               streams=be.streams(), pipeline=True))
            for n, impl in enumerate(("torch", "triton", "torch")):
                moe.router.rows_impl = impl

                def step():
                    x.grad = None
                    moe.zero_grad(set_to_none=True)
                    y, aux = moe(x)
                    torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])

                for _ in range(3):
                    step()
                times = []
                for _ in range(a.iters):
                    be.synchronize()
                    with be.timer() as t:
                        step()
                    times.append(t.elapsed_ms)
                row = {"T": T, "layer": layer, "topk": impl, "run": n + 1,
                       "ms": statistics.median(times)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"bench": "router-topk-ab", "device": be.probe().get("device_name"),
                       "versions": be.versions(), "fp32_matmul": a.fp32_matmul,
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
