"""`longmoe tune chunks`: measure the best chunk count for one MoE layer on this machine.

For each local sequence length: the moe-layer benchmark's sweep (every chunk count, every
all-to-all transport the backend offers here, the adapter's comm-stream priority), device-event
timing of forward+backward, rank-max. The best (transport, chunks) per length becomes a cache
entry; a PNG plots time against chunks per length; the baseline and the best at one length are
profiled with torch.profiler into Perfetto-viewable Chrome traces.

A run on CPU ranks (`--smoke`, `--device cpu`) checks that the tuner works and writes no cache
entry: timings of gloo on shared cores say nothing about how a GPU overlaps an all-to-all.
"""

from __future__ import annotations

import json
from pathlib import Path

from longmoe.errors import UserError


def check_inputs(seq_lens: list[int], chunks: list[int], ep: int, num_experts: int):
    if ep < 2:
        raise UserError(f"--ep: {ep}; chunked EP needs an expert-parallel group of 2 or more")
    if num_experts % ep:
        raise UserError(f"--ep: {ep} does not divide the model's {num_experts} experts")
    for T in seq_lens:
        for c in chunks:
            if T % c:
                raise UserError(f"--chunks: {c} does not divide --seq-lens value {T}")
    for c in chunks:  # the sweep chunks by expert ranges (the trainer's default)
        if c > num_experts // ep:
            raise UserError(f"--chunks: {c} exceeds the {num_experts // ep} local experts "
                            f"per rank at --ep {ep}")


def choose(rows: list[dict], T: int) -> dict:
    """Best (transport, chunks) at T from merged moe-layer rows, with its baseline."""
    layer = [r for r in rows if r["kind"] == "layer" and r["T"] == T]
    best = min(layer, key=lambda r: r["ms"])
    base = min((r for r in layer if r["chunks"] == 1), key=lambda r: r["ms"])
    comm = next((r["ms"] for r in rows if r["kind"] == "comm" and r["T"] == T
                 and r["transport"] == best["transport"]), None)
    gemm = next((r["ms"] for r in rows if r["kind"] == "gemm" and r["T"] == T
                 and r["transport"] == best["transport"]), None)
    sweep: dict[str, dict[int, float]] = {}
    for r in layer:
        sweep.setdefault(r["transport"], {})[r["chunks"]] = round(r["ms"], 4)
    out = {"chunks": best["chunks"], "transport": best["transport"], "ms": best["ms"],
           "nochunk_ms": base["ms"], "nochunk_transport": base["transport"],
           "speedup": base["ms"] / best["ms"] - 1, "sweep_ms": sweep,
           "peak_bytes": best["peak_bytes"]}
    if comm and gemm:
        from longmoe.bench.moe_layer import hidden_fraction
        frac, noise = hidden_fraction(base["ms"], best["ms"], comm, gemm)
        out.update(comm_ms=comm, gemm_ms=gemm, hidden_fraction=frac, hidden_noise=noise)
    return out


def hidden_cell(r: dict) -> str:
    """The table's "hidden" column: a fraction, or "noise" where the quotient left [0, 1]."""
    if r.get("hidden_fraction") is None:
        return ""
    return "noise" if r.get("hidden_noise") else f"{r['hidden_fraction']:.0%}"


def plot(results: dict[int, dict], path: Path, title: str) -> Path | None:
    try:
        import logging

        import matplotlib
        logging.getLogger("matplotlib").setLevel(logging.WARNING)   # its font-cache notice
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for T, res in sorted(results.items()):
        for tr, sweep in sorted(res["sweep_ms"].items()):
            cs = sorted(int(c) for c in sweep)
            ax.plot(cs, [sweep[c] for c in cs], marker="o",
                    linestyle="-" if tr == "process_group" else "--", label=f"T={T} {tr}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunks")
    ax.set_ylabel("MoE layer fwd+bwd, ms (rank max)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tune_chunks(preset: str, ep: int, seq_lens: list[int], chunks: list[int], out_dir: str,
                device: str, iters: int = 5, trace_len: int | None = None, smoke: bool = False,
                show_progress: bool = True, ep_note: str = "") -> dict:
    from longmoe.backends import get_backend
    from longmoe.bench.moe_layer import run_bench
    from longmoe.config import get_preset
    from longmoe.console import Progress, note
    from longmoe.tuning.cache import interconnect_signature, make_key, save
    backend = get_backend(device)
    cfg = smoke_model() if smoke else get_preset(preset)
    on_cpu = backend.device_type == "cpu"
    dtype = "float32" if on_cpu else "bfloat16"
    check_inputs(seq_lens, chunks, ep, cfg.num_experts)
    count = backend.probe().get("device_count") or 0
    if not on_cpu and ep > count:
        raise UserError(f"--ep: {ep} ranks but only {count} {backend.name} device(s)")
    transports = [t for t in backend.collective.a2a_transports
                  if backend.collective.a2a_unavailable(t, backend.device(0)) is None]
    prio = backend.comm_stream_priority
    probe = backend.probe()
    sig = interconnect_signature(probe)
    device_name = probe.get("device_name") or backend.name
    layer = "tiny (smoke)" if smoke else preset
    if show_progress:
        note(f"tune chunks: measuring {layer} (H={cfg.hidden_size}, top-{cfg.top_k}) on EP {ep}"
             f"{ep_note}: {ep} {device_name} rank(s), backend {backend.name}, arch {backend.arch}, "
             f"interconnect {sig}, {dtype}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, entries, reports = {}, {}, []
    trace_len = trace_len or seq_lens[len(seq_lens) // 2]
    traces = out / "traces"
    # One run of the ranks per length (every chunk count and transport at it), then the two
    # profiled runs. --smoke: one run for everything, its traces included: starting the ranks
    # takes seconds, the tiny layer milliseconds.
    runs = ([(seq_lens, {"trace_tokens": trace_len, "trace_dir": traces, "trace_chunks": chunks})]
            if smoke else [([T], {}) for T in seq_lens])
    bar = Progress("tune chunks", len(runs) + (not smoke)) if show_progress else None
    for i, (lens, trace) in enumerate(runs, 1):
        rep = run_bench(lens, chunks, transports, [prio], iters, ep, device,
                        preset=preset, dtype=dtype, smoke=smoke, **trace)
        reports.append(rep)
        for T in lens:
            res = choose(rep["rows"], T)
            results[T] = res
            key = make_key(backend.name, backend.arch, sig, ep, cfg.hidden_size, cfg.top_k,
                           dtype, T)
            entries[key] = {**{k: res[k] for k in ("chunks", "transport", "ms", "nochunk_ms",
                                                    "speedup")},
                            "hidden_fraction": res.get("hidden_fraction"),
                            "hidden_noise": res.get("hidden_noise"), "local_tokens": T,
                            "chunk_by": rep["chunk_by"],
                            "device": rep["device"], "date": rep["date"],
                            "torch": rep["versions"].get("torch")}
        if bar:
            bar.update(i, ", ".join(f"T={T}: best {results[T]['chunks']} chunks "
                                    f"({results[T]['transport']})" for T in lens))
    if not smoke:
        best = results[trace_len] if trace_len in results else results[seq_lens[-1]]
        run_bench([trace_len], sorted({1, best["chunks"]}), [best["transport"]], [prio], 1, ep,
                  device, preset=preset, dtype=dtype, trace_tokens=trace_len,
                  trace_dir=traces, trace_chunks=sorted({1, best["chunks"]}), smoke=smoke)
        if bar:
            bar.update(len(runs) + 1, f"profiled T={trace_len}")
    cache_file = None if on_cpu else save(out, entries)
    title = f"{device_name} x{ep} ({sig}), H={cfg.hidden_size}, top-{cfg.top_k}, {dtype}"
    png = plot(results, out / f"chunks_{backend.name}_{backend.arch}_{sig}_ep{ep}.png", title)
    summary = {"cache": str(cache_file) if cache_file else None,
               "cache_note": None if cache_file else CPU_NOTE,
               "plot": str(png) if png else None,
               "plot_note": None if png else "matplotlib missing: pip install longmoe[tune]",
               "traces": sorted(str(p) for p in traces.glob("*.json.gz")),
               "model": layer, "ep": ep, "dtype": dtype,
               "hardware": {"device": device_name, "backend": backend.name, "arch": backend.arch,
                            "interconnect": sig, "ranks": ep},
               "results": {str(T): r for T, r in results.items()},
               "hidden": cfg.hidden_size, "top_k": cfg.top_k}
    (out / f"sweep_{backend.name}_{backend.arch}_{sig}_ep{ep}.json").write_text(
        json.dumps({"summary": summary, "reports": reports}, indent=1))
    if bar:
        bar.finish(f"{len(seq_lens)} lengths x {len(chunks)} chunk counts on {backend.name} x{ep}")
    return summary


CPU_NOTE = ("not written: CPU ranks check that the tuner runs; their timings say nothing about "
            "a GPU's overlap")


def smoke_model():
    """The layer `--smoke` tunes: the tiny preset with 8 experts, top-2 (4 local experts at EP 2,
    so at most 4 expert chunks)."""
    from longmoe.config import get_preset
    return get_preset("tiny").replace(num_experts=8, top_k=2)


def write_prediction(res: dict, cfg, out_dir: str, dtype: str = "bfloat16") -> dict:
    """The cost model's picks as a tuning cache (entries marked "predicted"), its JSON and a PNG,
    under `out_dir`. Keys name the profiled part as its backend would: a full node of it
    (the profile's gpus_per_node) at res["ep"]."""
    import datetime

    from longmoe.plan.hardware import get_hardware
    from longmoe.tuning.cache import make_key, save
    hw = get_hardware(res["hardware_key"])
    sig = f"{hw.link}-{hw.gpus_per_node}"
    ep, transport = res["ep"], res["transport"]
    date = datetime.datetime.now(datetime.timezone.utc).isoformat()
    entries = {}
    for T, r in res["results"].items():
        key = make_key(hw.backend, hw.arch, sig, ep, cfg.hidden_size, cfg.top_k, dtype, int(T))
        entries[key] = {"chunks": r["best_chunks"], "transport": transport, "ms": r["best_ms"],
                        "nochunk_ms": r["nochunk_ms"], "speedup": r["speedup"],
                        "local_tokens": int(T), "chunk_by": "experts", "date": date,
                        "device": hw.name, "predicted": res["label"]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache_file = save(out, entries)
    stem = f"{hw.backend}_{hw.arch}_{sig}_ep{ep}"
    (out / f"prediction_{stem}.json").write_text(json.dumps(res, indent=1))
    curves = {int(T): {"sweep_ms": {transport: r["sweep_ms"]}} for T, r in res["results"].items()}
    png = plot(curves, out / f"chunks_predicted_{stem}.png",
               f"{res['label']}: {hw.name} x{ep} ({sig}), H={cfg.hidden_size}, top-{cfg.top_k}")
    return {"cache": str(cache_file), "keys": sorted(entries),
            "plot": str(png) if png else None,
            "plot_note": None if png else "matplotlib missing: pip install longmoe[tune]"}
