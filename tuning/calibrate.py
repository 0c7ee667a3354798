"""Fit the chunk cost model (cost_model.py) to a measured `longmoe bench moe-layer` sweep.

`longmoe tune calibrate --from SWEEP.json --hardware h200` refits, from the layer times at every
(length, chunk count, transport) and the all-to-all-alone and GEMM-alone times of the sweep:
  gemm_fraction_of_peak   expert GEMMs alone at one chunk, against the dense bf16 peak
  a2a_fraction_of_link    all-to-alls alone, against the rated intra-node link
  symmetric_memory_speed  copy-engine exchange speed relative to the process-group one
  non_gemm                routing, permutes, SwiGLU, combine: fixed + passes * (A*H*bytes / HBM)
  chunk_overhead          each extra chunk's cost (launches, index builds, per-chunk wgrad
                          partials): fixed + passes * (A*H*bytes / HBM)
  hide                    fraction of min(GEMM, comm) that overlap removes, per transport
by least squares (the last three jointly; the model is linear in them). Assumed figures
(rows_half_efficiency, a2a_latency_us, per_peer_link_gb_s) are kept as they are.
"""

from __future__ import annotations

import datetime
import json
import statistics
from pathlib import Path

import numpy as np

from longmoe.errors import UserError


def fit(sweep: dict, cfg, hw, base: dict) -> dict:
    """Returns a new calibration dict: `base` with the fitted entries replaced."""
    layer = sweep.get("layer", {})
    ep = layer.get("ep")
    if not ep or "rows" not in sweep:
        raise UserError("--from: not a `bench moe-layer` result (needs 'layer.ep' and 'rows')")
    for k, v in (("hidden", cfg.hidden_size), ("top_k", cfg.top_k), ("experts", cfg.num_experts),
                 ("moe_ffn", cfg.moe_ffn_size)):
        if layer.get(k) != v:
            raise UserError(f"--from: the sweep's layer has {k}={layer.get(k)}, the model {v}")
    rows = [r for r in sweep["rows"] if r.get("priority", -1) == -1]
    cal = json.loads(json.dumps(base))
    src = (f"fitted by `longmoe tune calibrate` to {sweep.get('device')} EP{ep} sweep of "
           f"{sweep.get('date', '?')[:10]}")
    lat = cal["a2a_latency_us"]["value"] * 1e-6

    def alone(kind, transport=None):
        out = {}
        for r in rows:
            if r["kind"] == kind and (transport is None or r["transport"] == transport):
                out.setdefault(r["T"], []).append(r["ms"] * 1e-3)
        return {T: min(v) for T, v in out.items()}

    gemm = alone("gemm")
    comm = {t: alone("comm", t) for t in ("process_group", "symmetric_memory")}
    if not gemm or not comm["process_group"]:
        raise UserError("--from: the sweep has no GEMM-alone or process-group comm-alone rows")
    from longmoe.tuning.cost_model import terms
    # the model's GEMM time scales as 1 / f_gemm: refit f_gemm so it meets the measured time
    f0 = cal["gemm_fraction_of_peak"]["value"]
    fr = [f0 * terms(hw, cfg, ep, T, 1, "process_group", cal)["gemm_s"] / t
          for T, t in gemm.items()]
    cal["gemm_fraction_of_peak"] = {"value": round(statistics.median(fr), 4), "source": src +
                                    f": expert GEMMs alone, median over lengths {sorted(gemm)}"}
    link = hw.intra_node_gb_s * 1e9
    fl = [4 * T * cfg.top_k * cfg.hidden_size * 2 * (ep - 1) / ep / (t - 4 * lat) / link
          for T, t in comm["process_group"].items()]
    cal["a2a_fraction_of_link"] = {"value": round(statistics.median(fl), 4), "source": src +
                                   ": process-group all-to-alls alone, median over lengths"}
    sm = [(comm["process_group"][T] - 4 * lat) / (t - 4 * lat)
          for T, t in comm["symmetric_memory"].items()
          if T in comm["process_group"]]
    if sm:
        cal["symmetric_memory_speed"] = {"value": round(statistics.median(sm), 4), "source": src +
                                         ": process-group over copy-engine all-to-all time, latency taken off"}

    pts = [r for r in rows if r["kind"] == "layer" and r["transport"] in cal["hide"]]
    transports = sorted({r["transport"] for r in pts})
    design, y = [], []
    for r in pts:
        T, C = r["T"], r["chunks"]
        t = terms(hw, cfg, ep, T, C, r["transport"], cal)
        x = t["hbm_s"]
        m = min(t["gemm_s"], t["comm_s"])
        hide_cols = [-(1 - 1 / C) * m * (r["transport"] == tr) for tr in transports]
        design.append([1.0, x, (C - 1), (C - 1) * x] + hide_cols)
        y.append(r["ms"] * 1e-3 - t["gemm_s"] - t["comm_s"])
    if len(y) < 4 + len(transports):
        raise UserError(f"--from: {len(y)} layer rows are too few to fit {4 + len(transports)} terms")
    D, Y = np.array(design), np.array(y)
    free = list(range(D.shape[1]))
    while True:  # the four cost terms are costs: a negative fit is pinned to 0 and the rest refit
        coef = np.zeros(D.shape[1])
        coef[free] = np.linalg.lstsq(D[:, free], Y, rcond=None)[0]
        neg = [i for i in free if i < 4 and coef[i] < 0]
        if not neg:
            break
        free.remove(min(neg, key=lambda i: coef[i]))
    coef = [float(c) for c in coef]
    pred = D @ np.array(coef)
    cal["non_gemm"] = {"fixed_us": round(coef[0] * 1e6, 1), "passes": round(coef[1], 2),
                       "source": src + ": least squares over every layer row"}
    cal["chunk_overhead"] = {"fixed_us": round(coef[2] * 1e6, 1), "passes": round(coef[3], 2),
                             "source": src + ": least squares over every layer row"}
    for i, tr in enumerate(transports):
        cal["hide"][tr] = {"value": round(float(coef[4 + i]), 4),
                           "source": src + ": least squares over every layer row (negative: "
                           "overlapping cost more than it hid)"}
    rel = [abs(p - v) / (r["ms"] * 1e-3) for p, v, r in zip(pred, y, pts)]
    cal["_fit"] = {"rows": len(y), "median_rel_error": round(float(statistics.median(rel)), 4),
                   "max_rel_error": round(float(max(rel)), 4), "sweep_date": sweep.get("date"),
                   "fitted": datetime.date.today().isoformat()}
    return cal


def write(cal: dict, path: Path):
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cal, indent=1) + "\n")
    tmp.replace(path)
