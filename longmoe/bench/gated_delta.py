"""`longmoe bench gated-delta`: the Gated DeltaNet core of one layer (the delta-rule token mixer,
without its projections), forward and forward+backward, per implementation and fp32-matmul
precision, beside causal SDPA of the same model's full-attention layer at the same length.

Per (T, variant): median ms over timed iterations after warm-up (device events), extra peak memory
over the inputs, and the largest error of the output and of every input gradient against the
first variant of the run (relative to that tensor's largest magnitude), so a faster variant shows
what it costs in accuracy. One variant can be profiled into an op table.

The anchor: variant "fla_direct" calls flash-linear-attention's `chunk_gated_delta_rule` itself
(bf16 in, q/k l2norm in its kernel, GQA heads repeated before the clock starts), outside the
registry and its trial call, so its forward is timed even where its backward refuses (e.g. its
gated backward on Hopper with Triton < 3.7.1); a refused backward is recorded as a reason. Every
row of the same T then carries fwd_vs_fla_fwd and fwd_bwd_vs_fla_fwd: its times over fla's
forward.

Legend: T tokens, Hk/Hv key/value heads, dk/dv head dims.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import statistics

import torch

from longmoe.backends import active_backend
from longmoe.bench import write_json_and_table
from longmoe.config import PRESETS


@contextlib.contextmanager
def _matmul_precision(level: str):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(level)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def _inputs(T, Hk, Hv, dk, dv, device, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q, k = r(1, T, Hk, dk).to(dtype), r(1, T, Hk, dk).to(dtype)
    v = r(1, T, Hv, dv).to(dtype)
    # decay and write strength as the layer makes them: g = -A softplus(a + 1), beta = sigmoid(b)
    A = torch.rand(Hv, device=device, generator=g) * 15 + 1
    gate = -A * torch.nn.functional.softplus(r(1, T, Hv) + 1.0) * 0.05
    beta = torch.sigmoid(r(1, T, Hv)).to(dtype)
    return [x.requires_grad_() for x in (q, k, v, gate, beta)]


def _core(impl):
    """The core as the layer calls it: o in the inputs' dtype (the norm after it takes that)."""
    from longmoe.ops.gated_delta import gated_delta_rule
    return lambda q, k, v, g, beta: gated_delta_rule(q, k, v, g, beta, impl=impl,
                                                     out_dtype=v.dtype)[0]


def _fla_direct(leaves, Hk, Hv, backend, warmup, iters, ref):
    """fla's chunk kernel timed directly: forward, then forward+backward where it runs."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - not installed or not importable here: a reason
        return {"status": f"skipped: flash-linear-attention not importable ({type(e).__name__})"}
    if leaves[0].device.type == "cpu":
        return {"status": "skipped: fla's Triton kernels need a GPU"}
    q, k, v, g, beta = (x.detach() for x in leaves)
    if Hv != Hk:
        q, k = (x.repeat_interleave(Hv // Hk, dim=2) for x in (q, k))
    xs = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    xs += [g.float().requires_grad_(), beta.to(torch.bfloat16).requires_grad_()]

    def fn(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g=g, beta=beta, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)[0]
    fwd, _ = _time(fn, xs, backend, warmup, iters, backward=False)
    row = {"fwd_ms": fwd, "status": "ok"}
    o = fn(*xs).detach().float()
    if ref is not None:
        row["max_rel_err"] = {"o": _rel_err([o], ref[:1])[0]}
    try:
        both, peak = _time(fn, xs, backend, warmup, iters, backward=True)
        row.update({"fwd_bwd_ms": both, "extra_peak_bytes": int(peak)})
    except Exception as e:  # noqa: BLE001 - fla refuses its backward on some GPU/Triton pairs
        row["bwd_status"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return row


def add_fla_ratios(results: list[dict]) -> None:
    """Each ok row's forward and forward+backward times over fla's forward at the same T."""
    anchor = {r["T"]: r["fwd_ms"] for r in results
              if r["variant"] == "fla_direct" and r.get("status") == "ok"}
    for r in results:
        base = anchor.get(r["T"])
        if base is None or r.get("status") != "ok":
            continue
        for key in ("fwd_ms", "fwd_bwd_ms"):
            if r.get(key) is not None:
                r[key.replace("_ms", "_vs_fla_fwd")] = r[key] / base


def _time(fn, leaves, backend, warmup, iters, backward: bool):
    for _ in range(warmup):
        out = fn(*leaves)
        if backward:
            torch.autograd.grad(out.float().sum(), leaves)
    backend.synchronize()
    base = backend.memory_allocated()
    backend.reset_peak_memory()
    times = []
    for _ in range(iters):
        t = backend.timer().start()
        out = fn(*leaves)
        grads = torch.autograd.grad(out.float().sum(), leaves) if backward else None
        times.append(t.stop())
        del out, grads
    return statistics.median(times), backend.peak_memory_bytes() - base


def _outputs(fn, leaves, seed):
    out = fn(*leaves)
    gen = torch.Generator(device=out.device).manual_seed(seed)
    w = torch.randn(out.shape, device=out.device, generator=gen)
    grads = torch.autograd.grad((out.float() * w).sum(), leaves)
    return [out.detach().float()] + [x.float() for x in grads]


def _rel_err(a, b):
    return [float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b)]


def run_bench(tokens: list[int], variants: list[str], preset: str = "qwen3.5-35b-a3b",
              warmup: int = 2, iters: int = 5, profile: str | None = None,
              profile_dir: str | None = None) -> dict:
    """`variants`: "impl" or "impl@precision" (precision: highest | high; high lets fp32
    matmuls use TF32 on GPUs that have it); "sdpa" is the attention reference, "sdpa:<backend>"
    (flash, cudnn, efficient, math) the same attention pinned to one SDPA backend."""
    backend = active_backend()
    device = backend.device(0)
    cfg = PRESETS[preset]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    results = []
    for T in tokens:
        leaves = _inputs(T, Hk, Hv, dk, dv, device, dtype, seed=T)
        ref = None
        for name in variants:
            impl, _, prec = name.partition("@")
            row = {"variant": name, "T": T}
            try:
                if impl.partition(":")[0] == "sdpa":
                    row.update(_attention(T, cfg, device, dtype, backend, warmup, iters,
                                          impl.partition(":")[2] or None))
                elif impl == "fla_direct":
                    row.update(_fla_direct(leaves, Hk, Hv, backend, warmup, iters, ref))
                else:
                    fn = _core(impl)
                    with _matmul_precision(prec or "highest"):
                        fwd, _ = _time(fn, leaves, backend, warmup, iters, backward=False)
                        both, peak = _time(fn, leaves, backend, warmup, iters, backward=True)
                        outs = _outputs(fn, leaves, seed=1)
                        if profile == name and profile_dir:
                            _profile(fn, leaves, f"{profile_dir}/ops_{impl}_{prec or 'highest'}_{T}.txt")
                    if ref is None:
                        ref, row["reference"] = outs, True
                    errs = _rel_err(outs, ref)
                    row.update({"fwd_ms": fwd, "fwd_bwd_ms": both, "extra_peak_bytes": int(peak),
                                "max_rel_err": {"o": errs[0], "dq": errs[1], "dk": errs[2],
                                                "dv": errs[3], "dg": errs[4], "dbeta": errs[5]}})
                    del outs
                row.setdefault("status", "ok")
            except torch.OutOfMemoryError:
                row["status"] = "oom"
            except Exception as e:  # noqa: BLE001 - record and go on: one variant must not end a sweep
                row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            backend.empty_cache()
            results.append(row)
            print(json.dumps(row), flush=True)
        del leaves, ref
    add_fla_ratios(results)
    return {"benchmark": "gated-delta", "preset": preset,
            "shape": {"Hk": Hk, "Hv": Hv, "dk": dk, "dv": dv, "dtype": str(dtype)},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": backend.probe(), "versions": backend.versions(),
            "warmup": warmup, "iters": iters, "results": results}


def _attention(T, cfg, device, dtype, backend, warmup, iters, sdpa_backend=None):
    """Causal SDPA with the preset's full-attention heads (GQA as the model passes it), through
    torch's own backend choice or pinned to `sdpa_backend`."""
    from longmoe.ops.attention import sdpa_backends
    H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = torch.Generator(device=device).manual_seed(T)
    q = torch.randn(1, H, T, d, device=device, dtype=dtype, generator=g).requires_grad_()
    k = torch.randn(1, Hkv, T, d, device=device, dtype=dtype, generator=g).requires_grad_()
    v = torch.randn(1, Hkv, T, d, device=device, dtype=dtype, generator=g).requires_grad_()
    def fn(q, k, v):
        with sdpa_backends([sdpa_backend] if sdpa_backend else None):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True)
    fwd, _ = _time(fn, [q, k, v], backend, warmup, iters, backward=False)
    both, peak = _time(fn, [q, k, v], backend, warmup, iters, backward=True)
    return {"fwd_ms": fwd, "fwd_bwd_ms": both, "extra_peak_bytes": int(peak),
            "shape": {"heads": H, "kv_heads": Hkv, "head_dim": d}}


def _profile(fn, leaves, path):
    acts = [torch.profiler.ProfilerActivity.CPU]
    if leaves[0].device.type != "cpu":
        acts.append(torch.profiler.ProfilerActivity.CUDA)  # GPU kernel activity on every GPU build
    with torch.profiler.profile(activities=acts) as prof:
        torch.autograd.grad(fn(*leaves).float().sum(), leaves)
        active_backend().synchronize()
    key = "self_cpu_time_total" if leaves[0].device.type == "cpu" else "self_device_time_total"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=70))


def markdown_table(report: dict) -> str:
    lines = ["| T | variant | fwd ms | fwd+bwd ms | fwd / fla fwd | fwd+bwd / fla fwd | "
             "extra peak GiB | max rel err (o, dq, dg) |", "|---|---|---|---|---|---|---|---|"]
    num = lambda r, k, f: f.format(r[k]) if r.get(k) is not None else ""  # noqa: E731
    for r in report["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['T']} | {r['variant']} | {r['status']} | | | | | |")
            continue
        e = r.get("max_rel_err")
        err = "" if e is None else ("reference" if r.get("reference") else
                                    ", ".join(f"{e[k]:.1e}" for k in ("o", "dq", "dg") if k in e))
        both = num(r, "fwd_bwd_ms", "{:.1f}") or r.get("bwd_status", "")
        peak = r.get("extra_peak_bytes")
        lines.append(f"| {r['T']} | {r['variant']} | {r['fwd_ms']:.1f} | {both} | "
                     f"{num(r, 'fwd_vs_fla_fwd', '{:.2f}')} | "
                     f"{num(r, 'fwd_bwd_vs_fla_fwd', '{:.2f}')} | "
                     f"{'' if peak is None else f'{peak / 2**30:.2f}'} | {err} |")
    return "\n".join(lines)


def write_report(report: dict, out: str | None):
    write_json_and_table(report, out, markdown_table)
