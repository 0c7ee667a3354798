"""`longmoe bench gated-delta-tiles`: the Triton Gated DeltaNet core's kernels one by one, per tile
config: how its table entry (backends/<vendor>/kernels.json, "gated_delta_chunk") is chosen.

Per (T, config): the forward and forward+backward median ms of the core itself (normalised q/k
in, as ops/gated_delta.py hands them over; device events), and each kernel's device ms per call
of forward+backward from the profiler (the output kernel runs twice: forward and adjoint). A
config is the shipped entry with the overrides given; one that fails (a launch error, an
unsupported tile) is recorded with its error, and a launch error ends the sweep, since the
device is then unusable. fla's forward kernels are timed beside them as the anchor where fla
imports. Shapes: the preset's linear-attention heads, B = 1, bf16.
"""

from __future__ import annotations

import datetime
import json

import torch

from longmoe.backends import active_backend
from longmoe.bench import median_ms
from longmoe.config import PRESETS


def _inputs(T, Hk, Hv, dk, dv, device, seed):
    """bench gated-delta's inputs, with q and k normalised (and q scaled) as the core gets them."""
    from longmoe.bench.gated_delta import _inputs as core_inputs
    q, k, v, g, beta = (x.detach() for x in core_inputs(T, Hk, Hv, dk, dv, device,
                                                         torch.bfloat16, seed))
    norm = lambda x, s: (torch.nn.functional.normalize(x.float(), dim=-1) * s).to(x.dtype)  # noqa: E731
    return [x.requires_grad_() for x in (norm(q, dk ** -0.5), norm(k, 1.0), v, g, beta)]


def _kernel_ms(backend, fn, iters):
    """Device ms per call of fn() of every kernel it launches, from the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        backend.synchronize()
    rows = {e.key: e.device_time_total / iters / 1e3 for e in prof.key_averages()}
    return {k: round(v, 4) for k, v in sorted(rows.items(), key=lambda kv: -kv[1]) if v > 0.001}


def _fla_row(xs, Hk, Hv, backend, iters):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - not installed here: a reason, not a failure
        return {"variant": "fla_fwd", "status": f"skipped: fla not importable ({type(e).__name__})"}
    q, k, v, g, beta = (x.detach() for x in xs)
    q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))

    def fn():
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True)
    return {"variant": "fla_fwd", "status": "ok", "fwd_ms": median_ms(backend, fn, iters),
            "kernels_ms": _kernel_ms(backend, fn, iters)}


def run_bench(tokens: list[int], configs: list[dict], iters: int = 5,
              preset: str = "qwen3.5-35b-a3b") -> dict:
    from longmoe.ops.kernels import gated_delta_chunk as gc
    backend = active_backend()
    device = backend.device(0)
    shipped, precision = gc.kernel_config()
    unknown = sorted({k for c in configs for k in c} - set(shipped))
    if unknown:
        raise ValueError(f"--configs: unknown key(s) {', '.join(unknown)}; the entry has "
                         f"{', '.join(sorted(shipped))}")
    if device.type == "cpu":
        raise RuntimeError("bench gated-delta-tiles times GPU kernels; this machine has no GPU")
    cfg = PRESETS[preset]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    results, broken = [], False
    original = gc.kernel_config
    try:
        for T in tokens:
            xs = _inputs(T, Hk, Hv, dk, dv, device, seed=T)
            do = torch.randn(1, T, Hv, dv, device=device)
            results.append({"T": T, **_fla_row(xs, Hk, Hv, backend, iters)})
            for over in configs:
                row = {"T": T, "variant": "chunked_triton", "overrides": over}
                entry = {**shipped, **over}
                gc.kernel_config = lambda e=entry: (e, precision)

                def fwd():
                    with torch.no_grad():
                        return gc.chunked_gated_delta(*(x.detach() for x in xs))

                def both():
                    o, _ = gc.chunked_gated_delta(*xs)
                    return torch.autograd.grad(o, xs, do)
                try:
                    row.update(status="ok", fwd_ms=median_ms(backend, fwd, iters),
                               fwd_bwd_ms=median_ms(backend, both, iters),
                               kernels_ms=_kernel_ms(backend, both, iters))
                except Exception as e:  # noqa: BLE001 - record the config's failure
                    row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    broken = "illegal" in str(e).lower() or "launch" in str(e).lower()
                results.append(row)
                print(json.dumps(row), flush=True)
                if broken:
                    break
                backend.empty_cache()
            del xs, do
            if broken:
                break
    finally:
        gc.kernel_config = original
    return {"benchmark": "gated-delta-tiles", "preset": preset, "table_entry": shipped,
            "precision": precision, "iters": iters,
            "shape": {"B": 1, "Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv, "dtype": "bfloat16"},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": backend.probe(), "versions": backend.versions(), "results": results}


def markdown_table(report: dict) -> str:
    kernels = sorted({k for r in report["results"] if r.get("variant") == "chunked_triton"
                      for k in r.get("kernels_ms", {}) if k.startswith("gdn_")})
    short = [k.replace("gdn_", "").replace("_kernel", "") for k in kernels]
    lines = ["| T | config | fwd ms | fwd+bwd ms | " + " | ".join(short) + " |",
             "|---|---|---|---|" + "---|" * len(short)]
    for r in report["results"]:
        if r.get("variant") == "fla_fwd":
            if r.get("status") == "ok":
                lines.append(f"| {r['T']} | fla forward | {r['fwd_ms']:.2f} | | "
                             + " | " * (len(short) - 1) + " |")
            continue
        over = json.dumps(r["overrides"]) if r["overrides"] else "table"
        if r.get("status") != "ok":
            lines.append(f"| {r['T']} | {over} | {r['status']} | |" + " |" * len(short))
            continue
        ks = " | ".join(f"{r['kernels_ms'].get(k, 0):.2f}" for k in kernels)
        lines.append(f"| {r['T']} | {over} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {ks} |")
    return "\n".join(lines)


def _cmd(a) -> int:
    from longmoe.bench import parse_configs, write_json_and_table
    from longmoe.errors import UserError
    try:
        configs = parse_configs(a.configs)
        tokens = [int(t) for t in a.tokens.split(",")]
    except ValueError as e:
        raise UserError(f"--configs/--tokens: {e}") from None
    try:
        report = run_bench(tokens, configs, a.iters)
    except (RuntimeError, ValueError) as e:
        raise UserError(str(e)) from None
    write_json_and_table(report, a.out, markdown_table)
    return 0


def add_parser(bsub):
    p = bsub.add_parser("gated-delta-tiles", help="the Triton Gated DeltaNet kernels one by one "
                                                  "per tile config (GPU)")
    p.add_argument("--tokens", default="32768", help="comma list of T")
    p.add_argument("--configs", help='JSON list of overrides of the table entry, e.g. '
                                     '\'[{}, {"num_warps_qk": 4}]\' (default: the entry only)')
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", help="write the JSON report here")
    p.set_defaults(fn=_cmd)
