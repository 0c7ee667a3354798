"""Expert compute of one EP rank two ways, on one GPU, no all-to-all: is skipping the pipeline's
row permutations worth more than it costs?

  expert-major (what moe_pipeline.py does): received rows (S source blocks, each sorted by
      expert) permuted to expert order, one grouped GEMM per weight, outputs permuted back to
      source order; backward the same, and one weight-gradient GEMM per weight.
  source-major (not implemented in the pipeline): one grouped GEMM per source block (each
      block's groups are its experts), no permutations; the weight gradient per source, summed.

Rows: T tokens x top-K per rank, balanced over S sources and the L = E / S local experts
(multinomial per source). Fwd and bwd ms each, median of --iters.

    python bench/source_major_experts.py --tokens 16384,65536 --ep 2,8 --out sm.json
"""

import argparse
import json

import torch

from longmoe.bench import write_json_and_table
from longmoe.bench.tables import plain_table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,65536")
    ap.add_argument("--ep", default="2,8")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out")
    a = ap.parse_args()
    from longmoe.backends import active_backend
    from longmoe.bench import median_ms
    from longmoe.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
    from longmoe.ops.moe_rows import swiglu_backward, swiglu_forward
    from longmoe.parallel.expert_parallel import (inverse_permutation,
                                                  source_major_to_expert_major)
    be = active_backend()
    dev = be.device(0)
    H, F, dt = a.hidden, a.ffn, torch.bfloat16
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        for S in [int(s) for s in a.ep.split(",")]:
            L = a.experts // S
            g = torch.Generator().manual_seed(T + S)
            # rows[s][e]: rows source s sends to local expert e
            cnt = [torch.multinomial(torch.ones(L), T * a.top_k // S, replacement=True,
                                     generator=g).bincount(minlength=L).tolist() for _ in range(S)]
            M = sum(map(sum, cnt))
            w_in = (torch.randn(L, H, 2 * F, device=dev) * 0.02).to(dt)
            w_out = (torch.randn(L, F, H, device=dev) * 0.02).to(dt)
            recv = torch.randn(M, H, device=dev, dtype=dt)
            grecv = torch.randn(M, H, device=dev, dtype=dt)
            perm = source_major_to_expert_major(torch.tensor(cnt, device=dev), M)
            inv = inverse_permutation(perm)
            sizes = [sum(cnt[s][e] for s in range(S)) for e in range(L)]
            offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
            blocks, o = [], 0
            for s in range(S):
                n = sum(cnt[s])
                blocks.append((o, o + n, cnt[s], torch.tensor(cnt[s], device=dev).cumsum(0)
                               .to(torch.int32)))
                o += n

            def em_fwd():
                x = recv.index_select(0, perm)
                h = grouped_mm(x, w_in, sizes, offs)
                y = grouped_mm(swiglu_forward(h), w_out, sizes, offs)
                return x, h, y[inv]

            x_em, h_em, _ = em_fwd()

            def em_bwd():
                gy = grecv.index_select(0, perm)
                ga = grouped_mm(gy, w_out.transpose(1, 2), sizes, offs)
                gh, act, _ = swiglu_backward(h_em, ga, with_dot=True)
                dwo = grouped_mm_wgrad(act, gy, sizes, w_out, "auto", offs)
                gx = grouped_mm(gh, w_in.transpose(1, 2), sizes, offs)
                send = gx[inv]
                dwi = grouped_mm_wgrad(x_em, gh, sizes, w_in, "auto", offs)
                return send, dwo, dwi

            def sm_fwd():
                hs, ys = [], []
                for lo, hi, sz, of in blocks:
                    h = grouped_mm(recv[lo:hi], w_in, sz, of)
                    ys.append(grouped_mm(swiglu_forward(h), w_out, sz, of))
                    hs.append(h)
                return hs, ys

            h_sm, _ = sm_fwd()

            def sm_bwd():
                dwo = dwi = None
                sends = []
                for (lo, hi, sz, of), h in zip(blocks, h_sm):
                    gy = grecv[lo:hi]
                    ga = grouped_mm(gy, w_out.transpose(1, 2), sz, of)
                    gh, act, _ = swiglu_backward(h, ga, with_dot=True)
                    d = grouped_mm_wgrad(act, gy, sz, w_out, "auto", of)
                    dwo = d if dwo is None else dwo.add_(d)
                    sends.append(grouped_mm(gh, w_in.transpose(1, 2), sz, of))
                    d = grouped_mm_wgrad(recv[lo:hi], gh, sz, w_in, "auto", of)
                    dwi = d if dwi is None else dwi.add_(d)
                return sends, dwo, dwi

            for name, fn in (("expert_major_fwd", em_fwd), ("source_major_fwd", sm_fwd),
                             ("expert_major_bwd", em_bwd), ("source_major_bwd", sm_bwd)):
                row = {"T": T, "ep": S, "local_experts": L, "rows": M, "case": name,
                       "ms": median_ms(be, fn, a.iters, warmup=3)}
                print(json.dumps(row), flush=True)
                rows.append(row)
            # the two ways agree (bf16 sums in a different order: loose bound)
            _, _, y1 = em_fwd()
            y2 = torch.cat(sm_fwd()[1])
            err = ((y1.float() - y2.float()).norm() / y1.float().norm()).item()
            rows.append({"T": T, "ep": S, "case": "agreement", "rel_err": err})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        write_json_and_table({"bench": "source-major-experts", "rows": rows}, a.out, plain_table,
                             be)


if __name__ == "__main__":
    main()
