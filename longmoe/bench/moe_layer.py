"""`longmoe bench moe-layer`: one MoE layer forward+backward under expert parallelism, no chunks
against chunked, per transport and comm-stream priority, with the all-to-all alone and the expert
GEMMs alone measured in the same run.

Per (transport, priority, T, chunks): rank-max of each rank's median fwd+bwd ms (device events,
after warm-up, ranks aligned by a barrier before every iteration) and rank-max peak memory above
what was allocated before the iteration. Per (transport, T): the layer's four all-to-alls alone
(dispatch and combine, forward and backward) and its expert GEMMs alone (the pipeline's own
forward/dgrad/wgrad calls on the rows one rank receives). Then

    hidden fraction = (T_nochunk - T_chunk) / min(T_comm, T_gemm)

which cannot exceed 1 (no schedule hides more than the smaller of the two); a larger quotient is
timing noise (a CPU run, a tiny layer), reported as noise, not as a fraction (`hidden_fraction`).

With `baseline="megatron"`, the same layer with megatron-core's all-to-all token
dispatcher in place of the pipeline (`megatron_moe.py`), on the first transport's process group,
timed the same way.

Legend: T local tokens per rank, K top-k, H hidden, C chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gzip
import os
import shutil
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from longmoe.bench import write_json_and_table
from longmoe.config import from_dict as model_from_dict, get_preset
from longmoe.train.config import ImplConfig


def _timed(backend, fn, iters: int, warmup: int = 2):
    return _timed_rounds(backend, [fn], iters, warmup)[0]


def _timed_rounds(backend, fns: list, iters: int, warmup: int = 2) -> list[tuple[float, int]]:
    """(median ms, peak bytes above the start) per fn: each fn warmed up, then `iters` rounds
    that time every fn once, the order rotating by one per round, so that the arms compared
    with each other ran under the same clocks (a GPU under sustained load clocks down: timed
    one after another, the later arms read slower)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    backend.synchronize()
    times, peaks = [[] for _ in fns], [[] for _ in fns]
    for r in range(iters):
        k = r % len(fns)
        for i in list(range(k, len(fns))) + list(range(k)):
            if dist.is_initialized():
                dist.barrier()
            backend.synchronize()
            base = backend.memory_allocated()
            backend.reset_peak_memory()
            with backend.timer() as t:
                fns[i]()
            times[i].append(t.elapsed_ms)
            peaks[i].append(backend.peak_memory_bytes() - base)
    return [(statistics.median(t), max(p)) for t, p in zip(times, peaks)]


def _layer(cfg, rank, world, backend, dtype):
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    moe = MoE(cfg, ep_rank=rank, ep_size=world)
    init_params(moe, cfg, 0)
    moe.to(device=backend.device(rank), dtype=dtype)
    moe.batch_group = dist.group.WORLD if world > 1 else None
    return moe


def _comm_alone(pipe, x_TH, H):
    """The four all-to-alls of one layer (dispatch+combine, forward and backward), chunks=1."""
    plan = pipe.plan
    send = x_TH.new_empty((plan.order_A.numel(), H)).normal_()
    recv = x_TH.new_empty((sum(plan.recv[0]), H))

    def run():
        for _ in range(2):
            pipe.a2a(recv, send, 0, reverse=False)
            mark = pipe.a2a(send, recv, 0, reverse=True)
        pipe.streams.compute_waits(mark)  # the timer's end event sits on the compute stream
    return run


def _gemm_alone(moe, rows, H, device, dtype, impl="auto", rows_impl="auto"):
    from longmoe.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
    from longmoe.ops.moe_rows import swiglu_backward, swiglu_forward
    M = sum(rows)
    xg = torch.randn(M, H, device=device, dtype=dtype)
    gy = torch.randn(M, H, device=device, dtype=dtype)
    w_in, w_out = moe.experts.w_in.detach(), moe.experts.w_out.detach()

    def run():
        h = grouped_mm(xg, w_in, rows, impl=impl)
        grouped_mm(swiglu_forward(h, rows_impl), w_out, rows, impl=impl)
        ga = grouped_mm(gy, w_out.transpose(1, 2), rows, impl=impl)
        gh, a, _ = swiglu_backward(h, ga, impl=rows_impl)
        grouped_mm(gh, w_in.transpose(1, 2), rows, impl=impl)
        grouped_mm_wgrad(a, gy, rows, w_out, impl)
        grouped_mm_wgrad(xg, gh, rows, w_in, impl)
    return run


def hidden_fraction(base_ms: float, best_ms: float, comm_ms: float,
                    gemm_ms: float) -> tuple[float, bool]:
    """(hidden fraction clamped to [0, 1], whether the quotient fell outside it: noise)."""
    f = (base_ms - best_ms) / min(comm_ms, gemm_ms)
    return min(max(f, 0.0), 1.0), not 0.0 <= f <= 1.0


def _cores() -> int:
    """The cores this process may run on (a CPU set or container limit, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # no affinity call on this platform
        return os.cpu_count() or 1


def _rank(rank, world, backend, spec):
    from longmoe.parallel.expert_parallel import ExpertDispatcher, plan_routes
    from longmoe.parallel.moe_pipeline import ChunkPipeline
    if backend.device_type == "cpu":
        # CPU ranks share the host's cores: each with a thread per core oversubscribes them, and a
        # tiny layer's step went from ~15 ms to ~1.5 s (2 ranks on 2 cores).
        torch.set_num_threads(max(1, _cores() // world))
    cfg = model_from_dict(spec["model"])
    dtype = getattr(torch, spec["dtype"])
    device = backend.device(rank)
    if backend.device_type != "cpu":  # as the trainer does (impl.fp32_matmul): the router's GEMMs
        torch.set_float32_matmul_precision(spec["fp32_matmul"])
    moe = _layer(cfg, rank, world, backend, dtype)
    moe.experts.rows_impl = spec["rows_impl"]
    moe.router.matmul = spec["router_matmul"]
    H, E, K = cfg.hidden_size, cfg.num_experts, cfg.top_k
    group = dist.group.WORLD
    rows_out = []
    for transport in spec["transports"]:
        tr = backend.a2a(transport, device)
        for prio in spec["priorities"]:
            streams = backend.streams(prio)
            for T in spec["tokens"]:
                g = torch.Generator(device=device).manual_seed(1000 + rank)
                x = torch.randn(1, T, H, device=device, dtype=dtype, generator=g).requires_grad_()
                gy = torch.randn(1, T, H, device=device, dtype=dtype, generator=g)

                def step():
                    x.grad = None
                    moe.zero_grad(set_to_none=True)
                    y, aux = moe(x)
                    torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])

                base = {"transport": transport, "priority": prio, "T": T}
                # The arms of this (transport, priority, T), timed in the same rounds: each is
                # (its row, its dispatcher, the trace name's chunk count or None).
                arms = []
                if world == 1 and prio == spec["priorities"][0]:
                    # One rank: the layer without the pipeline (what EP=1 training runs), beside
                    # the pipeline at each chunk count, whose all-to-alls are local copies here.
                    d = ExpertDispatcher(E, None, 1)
                    d.rows_impl = spec["rows_impl"]
                    arms.append(({**base, "kind": "direct"}, d, 0))  # C0: the unpipelined layer
                by = spec.get("chunk_by", "experts")
                limit = T if by == "tokens" else E // world
                for i, wgrad in enumerate(spec["wgrads"]):  # the first is the summary's
                    for C in [c for c in spec["chunks"] if c <= limit]:
                        d = ExpertDispatcher(E, group, C, tr, streams, pipeline=world == 1,
                                             chunk_by=by)
                        d.rows_impl = spec["rows_impl"]
                        d.wgrad = wgrad
                        traced = (C in spec["trace_chunks"] and prio == spec["priorities"][0]
                                  and i == 0)
                        arms.append(({**base, "kind": "layer", "chunks": C, "chunk_by": by,
                                      "wgrad": wgrad}, d, C if traced else None))
                if (prio == spec["priorities"][0] and spec.get("baseline") == "megatron"
                        and transport == spec["transports"][0]):
                    from longmoe.bench.megatron_moe import MegatronDispatch
                    d = MegatronDispatch(E, group, moe.experts, K, H, cfg.moe_ffn_size, dtype)
                    arms.append(({**base, "transport": "megatron", "kind": "megatron"}, d, None))

                def with_dispatcher(d):
                    def run():
                        moe.dispatcher = d
                        step()
                    return run
                timed = _timed_rounds(backend, [with_dispatcher(d) for _, d, _ in arms],
                                      spec["iters"])
                for (row, d, trace_c), (ms, peak) in zip(arms, timed):
                    rows_out.append({**row, "ms": ms, "peak_bytes": peak})
                    if spec.get("trace_tokens") == T and trace_c is not None:
                        moe.dispatcher = d
                        _trace(step, backend, Path(spec["trace_dir"]) /
                               f"{transport}_T{T}_C{trace_c}_rank{rank}.json")
                if prio != spec["priorities"][0]:
                    continue
                with torch.no_grad():
                    idx, _, _ = moe.router(x.detach().view(T, H))
                plan = plan_routes(idx, E, 1, group)
                pipe = ChunkPipeline(plan, K, group, tr, backend.streams(prio))
                ms, _ = _timed(backend, _comm_alone(pipe, x.detach().view(T, H), H), spec["iters"])
                moved = 2 * (plan.order_A.numel() + sum(plan.recv[0])) * H * x.element_size()
                rows_out.append({**base, "kind": "comm", "ms": ms, "bytes": moved})
                run = _gemm_alone(moe, plan.expert_rows[0], H, device, dtype,
                                  rows_impl=spec["rows_impl"])
                ms, _ = _timed(backend, run, spec["iters"])
                M = sum(plan.expert_rows[0])
                rows_out.append({**base, "kind": "gemm", "ms": ms, "rows": M,
                                 "flops": 18 * M * H * cfg.moe_ffn_size})  # fwd 6MHF, bwd 12MHF
                del x, gy
    return rows_out


def _trace(step, backend, path: Path):
    from torch.profiler import ProfilerActivity, profile
    step()
    backend.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.device_type != "cpu" else [])
    path.parent.mkdir(parents=True, exist_ok=True)
    with _without_profiler_chatter(), warnings.catch_warnings():
        # the profiler's advice on its own cycles (torch 2.11: "Profiler clears events ...")
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=acts) as prof:
            step()
            backend.synchronize()
        prof.export_chrome_trace(str(path))


# kineto's own progress lines ("USDT: ... profiler_start", "STAGE: ...", "INFO: ..."), which it
# writes to file descriptor 2 from C++ at its default log level; its warnings and errors pass.
_CHATTER = ("USDT:", "STAGE:", "INFO:")


@contextlib.contextmanager
def _without_profiler_chatter():
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(ln for ln in lines if not ln.startswith(_CHATTER)))
            sys.stderr.flush()


def merge(per_rank: list[list[dict]]) -> list[dict]:
    """Rank-max of time and peak memory per case (the slowest rank sets the layer's pace)."""
    out = []
    for rows in zip(*per_rank):
        m = dict(rows[0])
        m["ms"] = max(r["ms"] for r in rows)
        m["ms_per_rank"] = [round(r["ms"], 4) for r in rows]
        if "peak_bytes" in m:
            m["peak_bytes"] = max(r["peak_bytes"] for r in rows)
        out.append(m)
    return out


def summarize(rows: list[dict], default_chunks, ranks: int = 2) -> list[dict]:
    """Per (transport, priority, T): baseline, best and default chunk counts, hidden fraction
    (none on one rank: its pipeline issues no all-to-all, so there is nothing to hide and a gap
    between chunk counts is the schedule's, not overlap)."""
    out = []
    keys = sorted({(r["transport"], r["priority"], r["T"]) for r in rows if r["kind"] == "layer"},
                  key=lambda k: (k[0], k[1], k[2]))
    first = next((r.get("wgrad") for r in rows if r["kind"] == "layer"), None)
    for tr, prio, T in keys:
        layer = {r["chunks"]: r for r in rows if r["kind"] == "layer" and
                 (r["transport"], r["priority"], r["T"]) == (tr, prio, T) and
                 r.get("wgrad") == first}
        if 1 not in layer:
            continue
        pick = lambda kind: next((r for r in rows if r["kind"] == kind and  # noqa: E731
                                  (r["transport"], r["T"]) == (tr, T)), None)
        comm, gemm, direct = pick("comm"), pick("gemm"), pick("direct")
        mega = next((r for r in rows if r["kind"] == "megatron" and r["T"] == T), None)
        best_c = min(layer, key=lambda c: layer[c]["ms"])
        dflt = default_chunks(T)
        base = layer[1]["ms"]
        s = {"transport": tr, "priority": prio, "T": T, "nochunk_ms": base,
             "best_chunks": best_c, "best_ms": layer[best_c]["ms"],
             "speedup_best": base / layer[best_c]["ms"] - 1,
             "nochunk_peak_gib": layer[1]["peak_bytes"] / 2**30,
             "best_peak_gib": layer[best_c]["peak_bytes"] / 2**30,
             "default_chunks": dflt}
        if direct:
            s["direct_ms"] = direct["ms"]
        if mega:
            s.update(megatron_ms=mega["ms"], megatron_peak_gib=mega["peak_bytes"] / 2**30,
                     speedup_vs_megatron=mega["ms"] / layer[best_c]["ms"] - 1)
            if direct:  # one rank: the unpipelined layer is what EP=1 training runs
                s["direct_vs_megatron"] = mega["ms"] / direct["ms"] - 1
        if dflt in layer:
            s.update(default_ms=layer[dflt]["ms"], speedup_default=base / layer[dflt]["ms"] - 1)
        if comm and gemm:
            s.update(comm_ms=comm["ms"], gemm_ms=gemm["ms"],
                     comm_GBps=comm["bytes"] / comm["ms"] / 1e6)
            if ranks > 1:
                frac, noise = hidden_fraction(base, layer[best_c]["ms"], comm["ms"], gemm["ms"])
                s.update(hidden_fraction=frac, hidden_noise=noise)
        out.append(s)
    return out


def run_bench(tokens, chunks, transports, priorities, iters, nproc, device, preset="qwen3.5-35b-a3b",
              dtype="bfloat16", trace_tokens=None, trace_dir=None, trace_chunks=(1, 8),
              smoke=False, chunk_by="experts", baseline: str | None = None,
              rows_impl: str = "auto", wgrad: str | list[str] = "auto",
              fp32_matmul: str | None = None, router_matmul: str = "auto",
              experts: int | None = None) -> dict:
    """`wgrad`: one weight-gradient schedule or several, each timed at every C in the same
    rounds (the first is the summary's). `experts`: the layer's expert count in place of the
    preset's (e.g. one EP = 8 rank's share on one device)."""
    from longmoe.backends import get_backend
    from longmoe.paired.spawn import run_ranks
    from longmoe.tuning import default_chunks
    backend = get_backend(device)
    cfg = get_preset(preset)
    if smoke:
        cfg = get_preset("tiny").replace(num_experts=8, top_k=2)
    if experts:
        cfg = cfg.replace(num_experts=experts)
    wgrads = [wgrad] if isinstance(wgrad, str) else list(wgrad)
    spec = {"model": dataclasses.asdict(cfg), "dtype": dtype, "tokens": tokens, "chunks": chunks,
            "transports": transports, "priorities": priorities, "iters": iters,
            "trace_tokens": trace_tokens, "trace_chunks": list(trace_chunks),
            "trace_dir": str(trace_dir or ""), "chunk_by": chunk_by, "baseline": baseline,
            "rows_impl": rows_impl, "wgrads": wgrads,
            "fp32_matmul": fp32_matmul or ImplConfig().fp32_matmul, "router_matmul": router_matmul}
    per_rank = run_ranks(_rank, nproc, spec, device=device)
    rows = merge(per_rank)
    report = {
        "bench": "moe-layer", "chunk_by": chunk_by, "rows_impl": rows_impl, "wgrad": wgrads[0],
        "wgrads": wgrads,
        "fp32_matmul": spec["fp32_matmul"], "router_matmul": router_matmul,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "device": backend.probe().get("device_name") or backend.name, "nproc": nproc,
        "backend": backend.name, "versions": backend.versions(),
        "env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE",
                                                "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
        "layer": {"hidden": cfg.hidden_size, "experts": cfg.num_experts, "top_k": cfg.top_k,
                  "moe_ffn": cfg.moe_ffn_size, "shared_ffn": cfg.shared_expert_ffn_size,
                  "dtype": dtype, "ep": nproc},
        "rows": rows, "summary": summarize(rows, default_chunks, nproc), "tax": pipeline_tax(rows)}
    if trace_tokens and trace_dir:
        report["traces"] = _keep_critical_traces(Path(trace_dir), rows, trace_tokens, nproc)
    return report


def _keep_critical_traces(d: Path, rows, T, nproc) -> list[str]:
    """gzip the slowest rank's traces at T (the rank that sets the layer's time), drop the others."""
    kept = []
    for f in sorted(d.glob(f"*_T{T}_C*_rank0.json")):
        stem = f.name[: -len("_rank0.json")]
        tr, c = stem.split("_T")[0], int(stem.rsplit("_C", 1)[1])
        case = next((r for r in rows if r["kind"] == "layer" and r["transport"] == tr
                     and r["T"] == T and r["chunks"] == c), None)
        crit = max(range(nproc), key=lambda r: case["ms_per_rank"][r]) if case else 0
        src = d / f"{stem}_rank{crit}.json"
        dst = d / f"{stem}_rank{crit}.json.gz"
        with open(src, "rb") as fi, gzip.open(dst, "wb") as fo:
            shutil.copyfileobj(fi, fo)
        kept.append(dst.name)
        for r in range(nproc):
            (d / f"{stem}_rank{r}.json").unlink(missing_ok=True)
    return kept


def pipeline_tax(rows: list[dict]) -> list[dict]:
    """One rank: each pipelined arm (weight-gradient schedule, C) against the unpipelined layer
    timed in the same rounds, time and peak memory."""
    out = []
    for d in (r for r in rows if r["kind"] == "direct"):
        for r in rows:
            if r["kind"] == "layer" and (r["transport"], r["priority"], r["T"]) == \
                    (d["transport"], d["priority"], d["T"]):
                out.append({"T": r["T"], "wgrad": r.get("wgrad"), "chunks": r["chunks"],
                            "ms": r["ms"], "unpipelined_ms": d["ms"],
                            "over_unpipelined": r["ms"] / d["ms"] - 1,
                            "peak_gib": r["peak_bytes"] / 2**30,
                            "unpipelined_peak_gib": d["peak_bytes"] / 2**30})
    return out


def _pct(v) -> str:
    return "" if v is None or v != v else f"{v:+.1%}"


def _ms(v) -> str:
    return "" if v is None or v != v else f"{v:.2f}"


def markdown_table(report: dict) -> str:
    """One row per (transport, priority, T/rank). "unpipelined" and its megatron column appear
    when the run has them (one rank; --baseline megatron): megatron vs unpipelined is how much
    longer megatron-core's dispatcher path takes than the layer EP=1 training runs."""
    summ = report["summary"]
    direct = any("direct_ms" in s for s in summ)
    mega = any("megatron_ms" in s for s in summ)
    head = ["transport", "prio", "T/rank", "no-chunk ms", "best C", "best ms", "speedup",
            "default C", "default speedup", "comm ms", "GEMM ms", "hidden", "peak GiB (1 -> best)"]
    head += ["unpipelined ms"] if direct else []
    head += ["megatron ms", "megatron vs best"] if mega else []
    head += ["megatron vs unpipelined"] if mega and direct else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summ:
        frac = s.get("hidden_fraction")
        cells = [s["transport"], s["priority"], s["T"], _ms(s["nochunk_ms"]), s["best_chunks"],
                 _ms(s["best_ms"]), _pct(s["speedup_best"]), s["default_chunks"],
                 _pct(s.get("speedup_default")), _ms(s.get("comm_ms")), _ms(s.get("gemm_ms")),
                 "" if frac is None else "noise" if s.get("hidden_noise") else f"{frac:.0%}",
                 f"{s['nochunk_peak_gib']:.2f} -> {s['best_peak_gib']:.2f}"]
        cells += [_ms(s.get("direct_ms"))] if direct else []
        if mega:
            cells += [_ms(s.get("megatron_ms")), _pct(s.get("speedup_vs_megatron"))]
        if mega and direct:
            m, d = s.get("megatron_ms"), s.get("direct_ms")
            cells.append(_pct(m / d - 1) if m and d else "")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    tax = report.get("tax") or []
    if tax:
        lines += ["", "Pipeline tax (one rank: nothing to overlap), against the unpipelined "
                  "layer timed in the same rounds:", "",
                  "| T | wgrad | C | ms | unpipelined ms | tax | peak GiB | unpipelined peak GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        for t in tax:
            lines.append(f"| {t['T']} | {t['wgrad']} | {t['chunks']} | {_ms(t['ms'])} | "
                         f"{_ms(t['unpipelined_ms'])} | {_pct(t['over_unpipelined'])} | "
                         f"{t['peak_gib']:.2f} | {t['unpipelined_peak_gib']:.2f} |")
    return "\n".join(lines)


def write_report(report: dict, out: str | None):
    write_json_and_table(report, out, markdown_table)
