"""`longmoe bench linear-ce`: linear cross-entropy forward+backward, ours against torch naive,
liger-kernel and cut-cross-entropy, with the 6*T*H*V GEMM floor measured in the same run.

Per (impl, T): median fwd+bwd ms over timed rounds after warm-up (device events), extra peak
memory over the inputs and their gradients, and the loss (agreement across impls). Each round
times every impl once, in an order that rotates, and the floor's GEMM once: all of them under
the same clocks. "x floor" divides by 6*T*H*V at that GEMM's median rate over the rounds;
`x_floor_cold_rate` by the rate of 10 GEMMs timed first, on a GPU not yet under load. Peers are
optional imports: a missing one is recorded as "missing", an OOM as "oom".

"ours"/"ours_rl" are the in-place layout (linear_ce triton_inplace, policy_loss fused_inplace),
"ours_lowp"/"ours_rl_lowp" the low-precision-logits one (triton_lowp, fused_lowp),
"ours_split"/"ours_rl_split" the fp32 logits with a separate gradient and an fp32 dW (triton,
fused). With "ours_split" and another layout selected, `precision` compares each with it at the
first T at two logit scales: log-probs, entropy (max abs difference) and CE dH, dW (max abs
difference over max abs of the split layout's).

Legend: T tokens, H hidden, V vocab.
"""

from __future__ import annotations

import datetime
import json
import statistics

import torch

from longmoe.backends import active_backend
from longmoe.bench import write_json_and_table


def _peers():
    """name -> fn(h, w, y) returning a scalar loss with autograd (mean over tokens)."""
    from longmoe.ops import linear_cross_entropy, linear_policy_loss
    from longmoe.rl.objective import Objective, TokenInputs

    def ours(impl, chunk=None):
        return lambda h, w, y: linear_cross_entropy(h, w, y, impl=impl, chunk_tokens=chunk)

    def ours_rl(impl, chunk=None):
        def fn(h, w, y):
            g = torch.Generator(device=h.device).manual_seed(0)
            adv = torch.randn(y.shape, device=h.device, generator=g)
            objective = Objective()  # GRPO clipped surrogate, token mean, on-policy tokens
            inputs = TokenInputs(adv, objective.token_weights(y != -100, int((y != -100).sum())))
            return linear_policy_loss(h, w, y, objective, inputs, impl=impl,
                                      chunk_tokens=chunk)[0]
        return fn

    def naive(h, w, y):
        return torch.nn.functional.cross_entropy((h @ w.T).float(), y)

    def liger():
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        mod = LigerFusedLinearCrossEntropyLoss()
        return lambda h, w, y: mod(w, h, y)

    def cce():
        from cut_cross_entropy import linear_cross_entropy as cce_fn
        return lambda h, w, y: cce_fn(h, w, y)

    return {"ours": ours, "ours_rl": ours_rl, "naive": naive, "liger": liger, "cce": cce}


# bench name -> (registry impl on GPUs, on CPU)
OURS = {"ours": ("triton_inplace", "chunked_inplace"), "ours_split": ("triton", "chunked"),
        "ours_lowp": ("triton_lowp", "chunked_lowp"),
        "ours_rl": ("fused_inplace", "fused_inplace_torch"), "ours_rl_split": ("fused", "fused_torch"),
        "ours_rl_lowp": ("fused_lowp", "fused_lowp_torch")}


def _ours_fn(peers, name, device, chunk):
    impl = OURS[name][device.type == "cpu"]
    return peers["ours_rl" if "_rl" in name else "ours"](impl, chunk)


def precision(T: int, H: int, V: int, device, dtype, w_scale: float, names) -> list[dict]:
    """Each layout in `names` against ours_split on the same inputs (see the docstring)."""
    from longmoe.ops import linear_cross_entropy, linear_logprobs
    g = torch.Generator(device=device).manual_seed(T + 1)
    h = (torch.randn(T, H, device=device, generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, H, device=device, generator=g) * w_scale).to(dtype)
    y = torch.randint(0, V, (T,), device=device, generator=g)
    cpu = device.type == "cpu"

    def run(name):
        impl = OURS[name][cpu]
        with torch.no_grad():
            lp, ent = linear_logprobs(h, w, y, with_entropy=True, impl=impl)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        linear_cross_entropy(hh, ww, y, impl=impl).backward()
        return lp, ent, hh.grad.float(), ww.grad.float()

    lp0, ent0, dh0, dw0 = run("ours_split")
    rows = []
    for name in names:
        lp, ent, dh, dw = run(name)
        rows.append({"impl": name, "T": T, "w_scale": w_scale,
                     "logprobs_max_abs": float((lp - lp0).abs().max()),
                     "entropy_max_abs": float((ent - ent0).abs().max()),
                     "dH_rel": float((dh - dh0).abs().max() / dh0.abs().max()),
                     "dW_rel": float((dw - dw0).abs().max() / dw0.abs().max())})
        del lp, ent, dh, dw
    return rows


def _floor_gemm(backend, dtype, device, H, V):
    """() -> ms of one bf16 [8192, H] @ [H, V] GEMM, the op's own shape class: the floor's rate."""
    a = torch.randn(8192, H, dtype=dtype, device=device)
    b = torch.randn(V, H, dtype=dtype, device=device)

    def once() -> float:
        t = backend.timer().start()
        torch.mm(a, b.T)
        return t.stop()
    for _ in range(3):
        once()
    return once


def _gemm_rate(ms: list[float], H: int, V: int) -> float:
    return 2 * 8192 * H * V / (statistics.median(ms) / 1e3)


def _timed(fn, h, w, y, backend) -> tuple[float, torch.Tensor]:
    h.grad = w.grad = None
    t = backend.timer().start()
    loss = fn(h, w, y)
    loss.backward()
    return t.stop(), loss


def _peak_and_loss(fn, h, w, y, backend, warmup: int) -> dict:
    """Warm-up passes, then one pass whose allocator peak above the inputs and their gradients
    is the extra memory, and its loss."""
    grad_bytes = h.numel() * h.element_size() + w.numel() * w.element_size()
    for _ in range(warmup):
        _timed(fn, h, w, y, backend)
    h.grad = w.grad = None
    backend.synchronize()
    base = backend.memory_allocated()
    backend.reset_peak_memory()
    _, loss = _timed(fn, h, w, y, backend)
    peak = backend.peak_memory_bytes() - base - grad_bytes
    return {"extra_peak_bytes": int(peak), "loss": float(loss)}


def _variants(impls, chunks) -> list[tuple[str, int | None]]:
    out = []
    for name in impls:
        sweep = [c or None for c in (chunks or [0])]  # 0: the default chunk size
        out += [(name, c) for c in sweep] if name in OURS else [(name, None)]
    return out


def _make(peers, name, chunk, device):
    if name in OURS:
        return _ours_fn(peers, name, device, chunk)
    return peers[name] if name == "naive" else peers[name]()


def run_bench(tokens: list[int], H: int, V: int, dtype=torch.bfloat16, impls: list[str] | None = None,
              chunks: list[int] | None = None, warmup: int = 2, iters: int = 5) -> dict:
    """Per T: each variant's warm-up, extra peak and loss apart; then `iters` rounds, each timing
    one fwd+bwd of every variant (the order rotating by one per round) and one floor GEMM, so
    every variant and the floor are timed under the same clocks and temperature (a GPU under
    sustained load clocks down: timed one after another, later variants read slower). Medians
    over the rounds."""
    backend = active_backend()
    device = backend.device(0)
    impls = impls or ["ours", "ours_rl", "ours_split", "ours_rl_split", "ours_lowp", "ours_rl_lowp",
                      "naive", "liger", "cce"]
    peers = _peers()
    on_gpu = device.type != "cpu"
    floor_once = _floor_gemm(backend, dtype, device, H, V) if on_gpu else None
    cold = _gemm_rate([floor_once() for _ in range(10)], H, V) if on_gpu else None
    results, rates = [], []
    for T in tokens:
        g = torch.Generator(device=device).manual_seed(T)
        h = (torch.randn(T, H, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
        w = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dtype).requires_grad_()
        y = torch.randint(0, V, (T,), device=device, generator=g)
        runs = []  # (row, fn) of the variants that ran
        variants = _variants(impls, chunks)
        for name, chunk in variants:
            row = {"impl": name, "T": T, "H": H, "V": V, "chunk_tokens": chunk}
            try:
                fn = _make(peers, name, chunk, device)
                row.update(_peak_and_loss(fn, h, w, y, backend, warmup))
                row["status"] = "ok"
                runs.append((row, fn))
            except ImportError as e:
                row["status"] = f"missing: {e.name or e}"
            except torch.OutOfMemoryError:
                row["status"] = "oom"
            except Exception as e:  # a peer that cannot run here; ours must not fail
                if name in OURS:
                    raise
                row["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            finally:
                h.grad = w.grad = None
                backend.empty_cache()
            results.append(row)
        times = {id(row): [] for row, _ in runs}
        floor_ms = []
        for r in range(iters):
            k = r % max(1, len(runs))
            for row, fn in runs[k:] + runs[:k]:
                times[id(row)].append(_timed(fn, h, w, y, backend)[0])
            if floor_once is not None:
                floor_ms.append(floor_once())
        h.grad = w.grad = None
        rate = _gemm_rate(floor_ms, H, V) if floor_ms else None
        rates.append({"T": T, "gemm_tflops": rate / 1e12 if rate else None})
        for row, _ in runs:
            row["ms"] = statistics.median(times[id(row)])
            row["ms_all"] = [round(x, 3) for x in times[id(row)]]
            if rate:
                row["floor_ms"] = 6 * T * H * V / rate * 1e3
                row["x_floor"] = row["ms"] / row["floor_ms"]
                row["x_floor_cold_rate"] = row["ms"] / (6 * T * H * V / cold * 1e3)
        for row in results[-len(variants):]:
            print(json.dumps({k: v for k, v in row.items() if k != "ms_all"}), flush=True)
        del h, w, y
        backend.empty_cache()
    prec = []
    compared = [n for n in ("ours", "ours_lowp") if n in impls]
    if "ours_split" in impls and compared:
        for scale in (0.02, 0.2):  # logits of std 0.45 (flat softmax) and 4.5 (peaked)
            prec += precision(tokens[0], H, V, device, dtype, scale, compared)
            print(json.dumps(prec[-len(compared):]), flush=True)
            backend.empty_cache()
    return {"benchmark": "linear-ce", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": backend.probe(), "versions": backend.versions(), "dtype": str(dtype),
            "timing": "interleaved", "gemm_tflops_cold": cold / 1e12 if cold else None,
            "gemm_tflops": rates, "warmup": warmup, "iters": iters,
            "results": results, "precision": prec}


def markdown_table(report: dict) -> str:
    lines = ["| T | impl | chunk | ms | x floor | extra peak GiB | loss |", "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['T']} | {r['impl']} | {r.get('chunk_tokens') or ''} | {r['status']} | | | |")
            continue
        xf = f"{r['x_floor']:.2f}" if r.get("x_floor") else ""
        chunk = (r.get("chunk_tokens") or "auto") if r["impl"] in OURS else ""
        lines.append(f"| {r['T']} | {r['impl']} | {chunk} | {r['ms']:.1f} | {xf} | "
                     f"{r['extra_peak_bytes'] / 2**30:.2f} | {r['loss']:.5f} |")
    rates = report.get("gemm_tflops")
    if isinstance(rates, list) and any(r.get("gemm_tflops") for r in rates):
        per_t = ", ".join(f"{r['gemm_tflops']:.0f} at T = {r['T']}" for r in rates
                          if r.get("gemm_tflops"))
        lines += ["", f"Floor GEMM ([8192, H] @ [H, V]) TFLOP/s, timed in the rounds: {per_t}; "
                      f"timed first, not yet under load: {report['gemm_tflops_cold']:.0f}."]
    if report.get("precision"):
        lines += ["", "Against ours_split (fp32 logits, fp32 dW), same inputs:", "",
                  "| impl | T | W scale | log-probs max abs | entropy max abs | dH rel | dW rel |",
                  "|---|---|---|---|---|---|---|"]
        for p in report["precision"]:
            lines.append(f"| {p['impl']} | {p['T']} | {p['w_scale']} | "
                         f"{p['logprobs_max_abs']:.2e} | {p['entropy_max_abs']:.2e} | "
                         f"{p['dH_rel']:.2e} | {p['dW_rel']:.2e} |")
    return "\n".join(lines)


def write_report(report: dict, out: str | None):
    write_json_and_table(report, out, markdown_table)


def profile_breakdown(T: int, H: int, V: int, chunk: int | None, which: str = "ours",
                      dtype=torch.bfloat16, top: int = 12, trace: str | None = None) -> dict:
    """Device time per kernel for one fwd+bwd (after warm-up), from torch.profiler: where the
    time goes (GEMMs, row kernels, dW accumulation) when a target is missed."""
    from torch.profiler import ProfilerActivity, profile
    backend = active_backend()
    device = backend.device(0)
    g = torch.Generator(device=device).manual_seed(1)
    h = (torch.randn(T, H, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dtype).requires_grad_()
    y = torch.randint(0, V, (T,), device=device, generator=g)
    peers = _peers()
    fn = _ours_fn(peers, which, device, chunk)
    for _ in range(2):
        h.grad = w.grad = None
        fn(h, w, y).backward()
    backend.synchronize()
    # ProfilerActivity.CUDA is torch's name for GPU kernel activity on every GPU build.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        h.grad = w.grad = None
        fn(h, w, y).backward()
        backend.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev_us and e.device_type.name != "CPU":
            rows.append({"kernel": e.key[:120], "ms": dev_us / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    return {"T": T, "chunk_tokens": chunk, "impl": which, "device_ms_total": total, "top": rows[:top]}
