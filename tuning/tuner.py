"""`longmoe tune chunks`: measure the best chunk count for one MoE layer on this machine.

For each local sequence length: the moe-layer benchmark's sweep (every chunk count, every
all-to-all transport the backend offers here, the adapter's comm-stream priority), device-event
timing of forward+backward, rank-max. The best (transport, chunks) per length becomes a cache
entry; a PNG plots time against chunks per length; the baseline and the best at one length are
profiled with torch.profiler into Perfetto-viewable Chrome traces.
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
        out.update(comm_ms=comm, gemm_ms=gemm,
                   hidden_fraction=(base["ms"] - best["ms"]) / min(comm, gemm))
    return out


def plot(results: dict[int, dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib
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
                show_progress: bool = True) -> dict:
    from longmoe.backends import get_backend
    from longmoe.bench.moe_layer import run_bench
    from longmoe.config import get_preset
    from longmoe.console import Progress
    from longmoe.tuning.cache import interconnect_signature, make_key, save
    backend = get_backend(device)
    cfg = smoke_model() if smoke else get_preset(preset)
    dtype = "float32" if backend.device_type == "cpu" else "bfloat16"
    check_inputs(seq_lens, chunks, ep, cfg.num_experts)
    count = backend.probe().get("device_count") or 0
    if backend.device_type != "cpu" and ep > count:
        raise UserError(f"--ep: {ep} ranks but only {count} {backend.name} device(s)")
    transports = [t for t in backend.collective.a2a_transports
                  if backend.collective.a2a_unavailable(t, backend.device(0)) is None]
    prio = backend.comm_stream_priority
    probe = backend.probe()
    sig = interconnect_signature(probe)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results, entries, reports = {}, {}, []
    trace_len = trace_len or seq_lens[len(seq_lens) // 2]
    # One step per length (every chunk count and transport at it), then the two profiled runs.
    bar = Progress("tune chunks", len(seq_lens) + 1) if show_progress else None
    for i, T in enumerate(seq_lens, 1):
        rep = run_bench([T], chunks, transports, [prio], iters, ep, device,
                        preset=preset, dtype=dtype, smoke=smoke)
        reports.append(rep)
        res = choose(rep["rows"], T)
        results[T] = res
        key = make_key(backend.name, backend.arch, sig, ep, cfg.hidden_size, cfg.top_k,
                       dtype, T)
        entries[key] = {**{k: res[k] for k in ("chunks", "transport", "ms", "nochunk_ms",
                                                "speedup")},
                        "hidden_fraction": res.get("hidden_fraction"), "local_tokens": T,
                        "chunk_by": rep["chunk_by"],
                        "device": rep["device"], "date": rep["date"],
                        "torch": rep["versions"].get("torch")}
        if bar:
            bar.update(i, f"T={T}: best {res['chunks']} chunks ({res['transport']})")
    best = results[trace_len] if trace_len in results else results[seq_lens[-1]]
    run_bench([trace_len], sorted({1, best["chunks"]}), [best["transport"]], [prio], 1, ep,
              device, preset=preset, dtype=dtype, trace_tokens=trace_len,
              trace_dir=out / "traces", trace_chunks=sorted({1, best["chunks"]}), smoke=smoke)
    if bar:
        bar.update(len(seq_lens) + 1, f"profiled T={trace_len}")
    cache_file = save(out, entries)
    title = f"{probe.get('device_name') or backend.name} x{ep} ({sig}), H={cfg.hidden_size}, " \
            f"top-{cfg.top_k}, {dtype}"
    png = plot(results, out / f"chunks_{backend.name}_{backend.arch}_{sig}_ep{ep}.png", title)
    summary = {"cache": str(cache_file), "plot": str(png) if png else None,
               "plot_note": None if png else "matplotlib missing: pip install longmoe[tune]",
               "traces": sorted(str(p) for p in (out / "traces").glob("*.json.gz")),
               "model": preset if not smoke else "tiny (smoke)", "ep": ep, "dtype": dtype,
               "results": {str(T): r for T, r in results.items()},
               "hidden": cfg.hidden_size, "top_k": cfg.top_k}
    (out / f"sweep_{backend.name}_{backend.arch}_{sig}_ep{ep}.json").write_text(
        json.dumps({"summary": summary, "reports": reports}, indent=1))
    if bar:
        bar.finish(f"{len(seq_lens)} lengths x {len(chunks)} chunk counts on {backend.name} x{ep}")
    return summary


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
