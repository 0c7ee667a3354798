"""A cost model for the chunk count: predicts one MoE layer's forward+backward time against the
number of chunks from GEMM throughput, all-to-all bandwidth and HBM bandwidth, for hardware we
cannot run.

Per rank, with A = T*K assignments, M rows received (balanced: M = A), L local experts, S = EP and
X = A*H*bytes / HBM bandwidth (one pass over the layer's activations):

  T_gemm(C)  = 18*M*H*F / (peak * f_gemm * r/(r + r_half)),   r = M / (C*L) rows per expert
  T_comm(C)  = 4 * (A*H*bytes*(S-1)/S / bw + C*latency)       4 all-to-alls per layer fwd+bwd
  T_other    = other_fixed + other_passes * X                 routing, permutes, SwiGLU, combine
  T_chunk    = chunk_fixed + chunk_passes * X                 what each extra chunk adds
  T(C)       = T_gemm + T_comm + T_other + (C-1)*T_chunk - hide * (1 - 1/C) * min(T_gemm, T_comm)

The (1 - 1/C) factor is the pipeline's own limit: the first dispatch and the last combine of each
direction have nothing to hide under. `hide` is how much of an overlapped transfer actually
disappears inside the layer. f_gemm, the link fraction, the non-GEMM and per-chunk terms and
`hide` are fitted to a measured 2xH200 sweep by `longmoe tune calibrate` (calibrate.py);
r_half, latency and the xGMI per-peer links are stated assumptions (calibration.json). Moving
the fit to other hardware assumes the same software costs scaled by its peak, links and HBM;
the output is labelled a prediction. The shipped fit (calibration.json) is of the 2xH200 sweep
in results/h200x2/moe_layer.json, expert-range chunks (the default); it over-predicts the 64K
gain measured on that pair by 5-8 points, so treat predictions for other hardware as upper bounds.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from longmoe.errors import UserError

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")


@lru_cache(maxsize=1)
def calibration() -> dict:
    return json.loads(CALIBRATION_FILE.read_text())


def _link_bw(hw, ep: int, cal: dict) -> float:
    """Bytes/s one rank sends to the rest of its EP group (one node)."""
    per_peer = cal["per_peer_link_gb_s"].get(hw.key)
    if per_peer is not None:  # full mesh: one link per peer, used in parallel
        return per_peer["value"] * 1e9 * (ep - 1)
    return hw.intra_node_gb_s * 1e9 * cal["a2a_fraction_of_link"]["value"]  # switched fabric


def terms(hw, cfg, ep: int, local_tokens: int, chunks: int, transport: str, cal: dict | None = None,
          dtype_bytes: int = 2) -> dict:
    """The model's physical terms in seconds: expert GEMMs, all-to-alls, and one pass over the
    layer's A*H activations at HBM speed (the unit of the memory-bound terms)."""
    cal = cal or calibration()
    if transport not in cal["hide"]:
        raise UserError(f"--transport: no calibration for {transport!r}; "
                        f"known: {', '.join(cal['hide'])}")
    H, F, K = cfg.hidden_size, cfg.moe_ffn_size, cfg.top_k
    L = cfg.num_experts // ep
    A = local_tokens * K
    r = A / (chunks * L)
    eff = cal["gemm_fraction_of_peak"]["value"] * r / (r + cal["rows_half_efficiency"]["value"])
    t_gemm = 18 * A * H * F / (hw.bf16_dense_tflops * 1e12 * eff)
    bw = _link_bw(hw, ep, cal)
    if transport == "symmetric_memory":
        bw *= cal["symmetric_memory_speed"]["value"]
    t_comm = 4 * (A * H * dtype_bytes * (ep - 1) / ep / bw
                  + chunks * cal["a2a_latency_us"]["value"] * 1e-6)
    return {"gemm_s": t_gemm, "comm_s": t_comm, "hbm_s": A * H * dtype_bytes / (hw.hbm_tb_s * 1e12)}


def layer_time(hw, cfg, ep: int, local_tokens: int, chunks: int, transport: str,
               dtype_bytes: int = 2, cal: dict | None = None) -> dict:
    cal = cal or calibration()
    t = terms(hw, cfg, ep, local_tokens, chunks, transport, cal, dtype_bytes)
    ng, co = cal["non_gemm"], cal["chunk_overhead"]
    other = ng["fixed_us"] * 1e-6 + ng["passes"] * t["hbm_s"]
    per_chunk = co["fixed_us"] * 1e-6 + co["passes"] * t["hbm_s"]
    hide = cal["hide"][transport]["value"]
    total = (t["gemm_s"] + t["comm_s"] + other + (chunks - 1) * per_chunk
             - hide * (1 - 1 / chunks) * min(t["gemm_s"], t["comm_s"]))
    return {"chunks": chunks, "ms": total * 1e3, "gemm_ms": t["gemm_s"] * 1e3,
            "comm_ms": t["comm_s"] * 1e3, "other_ms": other * 1e3,
            "chunk_overhead_ms": (chunks - 1) * per_chunk * 1e3}


def predict(hardware: str, cfg, ep: int, seq_lens: list[int], chunks: list[int],
            transport: str = "process_group") -> dict:
    from longmoe.plan.hardware import get_hardware
    hw = get_hardware(hardware)
    if ep > hw.gpus_per_node:
        raise UserError(f"--ep: {ep} exceeds {hw.name}'s {hw.gpus_per_node} GPUs per node; the "
                        "cost model covers one node")
    out = {"label": "PREDICTION (cost model, not measured)", "hardware": hw.name,
           "hardware_key": hw.key, "ep": ep,
           "transport": transport, "calibration": str(CALIBRATION_FILE.name), "results": {}}
    for T in seq_lens:
        rows = [layer_time(hw, cfg, ep, T, c, transport) for c in chunks if c <= T]
        best = min(rows, key=lambda r: r["ms"])
        base = next(r for r in rows if r["chunks"] == 1) if any(r["chunks"] == 1 for r in rows) \
            else layer_time(hw, cfg, ep, T, 1, transport)
        out["results"][str(T)] = {"best_chunks": best["chunks"], "best_ms": best["ms"],
                                  "nochunk_ms": base["ms"],
                                  "speedup": base["ms"] / best["ms"] - 1,
                                  "gemm_ms": base["gemm_ms"], "comm_ms": base["comm_ms"],
                                  "sweep_ms": {r["chunks"]: round(r["ms"], 3) for r in rows}}
    return out
