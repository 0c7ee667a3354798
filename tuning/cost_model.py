"""A cost model for the chunk count: predicts one MoE layer's forward+backward time against the
number of chunks from GEMM throughput and all-to-all bandwidth, for hardware we cannot run.

Per rank, with A = T*K assignments, M rows received (balanced: M = A), L local experts, S = EP:

  T_gemm(C) = 18*M*H*F / (peak * f_gemm * r/(r + r_half)),   r = M / (C*L) rows per expert
  T_comm(C) = 4 * (A*H*bytes*(S-1)/S / bw + C*latency)       4 all-to-alls per layer fwd+bwd
  T(C)      = T_gemm + T_comm - hide * (1 - 1/C) * min(T_gemm, T_comm)

The (1 - 1/C) factor is the pipeline's own limit: the first dispatch and the last combine of each
direction have nothing to hide under. `hide` is how much of an overlapped transfer actually
disappears (the collective slows the GEMM it runs beside). Every figure comes from
calibration.json (measured on H200 or stated as an assumption) and hardware.json; the output is
labelled a prediction.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from longmoe.errors import UserError

_CAL = Path(__file__).with_name("calibration.json")


@lru_cache(maxsize=1)
def calibration() -> dict:
    return json.loads(_CAL.read_text())


def _link_bw(hw, ep: int) -> float:
    """Bytes/s one rank sends to the rest of its EP group (one node)."""
    cal = calibration()
    per_peer = cal["per_peer_link_gb_s"].get(hw.key)
    if per_peer is not None:  # full mesh: one link per peer, used in parallel
        return per_peer["value"] * 1e9 * (ep - 1)
    return hw.intra_node_gb_s * 1e9 * cal["a2a_fraction_of_link"]["value"]  # switched fabric


def layer_time(hw, cfg, ep: int, local_tokens: int, chunks: int, transport: str,
               dtype_bytes: int = 2) -> dict:
    cal = calibration()
    if transport not in cal["hide"]:
        raise UserError(f"--transport: no calibration for {transport!r}; "
                        f"known: {', '.join(cal['hide'])}")
    H, F, K = cfg.hidden_size, cfg.moe_ffn_size, cfg.top_k
    L = cfg.num_experts // ep
    A = local_tokens * K
    r = A / (chunks * L)
    eff = cal["gemm_fraction_of_peak"]["value"] * r / (r + cal["rows_half_efficiency"]["value"])
    t_gemm = 18 * A * H * F / (hw.bf16_dense_tflops * 1e12 * eff)
    bw = _link_bw(hw, ep)
    if transport == "symmetric_memory":
        bw *= cal["symmetric_memory_speed"]["value"]
    t_comm = 4 * (A * H * dtype_bytes * (ep - 1) / ep / bw
                  + chunks * cal["a2a_latency_us"]["value"] * 1e-6)
    hide = cal["hide"][transport]["value"]
    total = t_gemm + t_comm - hide * (1 - 1 / chunks) * min(t_gemm, t_comm)
    return {"chunks": chunks, "ms": total * 1e3, "gemm_ms": t_gemm * 1e3, "comm_ms": t_comm * 1e3}


def predict(hardware: str, cfg, ep: int, seq_lens: list[int], chunks: list[int],
            transport: str = "process_group") -> dict:
    from longmoe.plan.hardware import get_hardware
    hw = get_hardware(hardware)
    if ep > hw.gpus_per_node:
        raise UserError(f"--ep: {ep} exceeds {hw.name}'s {hw.gpus_per_node} GPUs per node; the "
                        "cost model covers one node")
    out = {"label": "PREDICTION (cost model, not measured)", "hardware": hw.name, "ep": ep,
           "transport": transport, "calibration": str(_CAL.name), "results": {}}
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
