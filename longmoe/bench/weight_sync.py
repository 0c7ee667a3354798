"""`longmoe bench weight-sync`: handing the policy's weights to a rollout engine, on one device or
on `--nproc` local ranks.

Times `named_weights_for_rollout` producing every bucket into a receiving buffer preallocated on
the same device (what an engine colocated with the trainer receives; a remote engine adds its
link's time), the bytes sent, the peak device memory the hand-off adds on top of the model, and
`export_hf` of the same model to local disk. The model is built from a run config as training
builds it (one rank: the whole model is this rank's share).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time


def _handoff(model, run, layout, backend, bucket_mb, dtype, iters, aligned) -> dict:
    """This rank's hand-off: buckets, bytes, median seconds, peak device bytes added."""
    import torch

    from longmoe.rl.weights import named_weights_for_rollout
    bucket_bytes = int(bucket_mb * 2**20)

    def handoff(recv):
        n = nbytes = 0
        for bucket in named_weights_for_rollout(model, run, layout, bucket_bytes, dtype):
            for k, t in bucket:
                recv[k].copy_(t, non_blocking=True)
                nbytes += t.numel() * t.element_size()
            n += 1
            del bucket
        return n, nbytes

    recv = {k: torch.empty_like(t) for b in named_weights_for_rollout(
        model, run, layout, bucket_bytes, dtype) for k, t in b}
    times, peak = [], None
    for _ in range(max(1, iters)):
        backend.synchronize()
        aligned()
        if backend.device_type != "cpu":
            base = backend.memory_allocated()
            backend.reset_peak_memory()
        t0 = time.perf_counter()
        buckets, sent = handoff(recv)
        backend.synchronize()
        times.append(time.perf_counter() - t0)
        if backend.device_type != "cpu":
            peak = max(peak or 0, backend.peak_memory_bytes() - base)
    return {"bucket_bytes": bucket_bytes, "buckets": buckets, "bytes": sent,
            "tensors": len(recv), "receive_buffer_bytes": sum(
                t.numel() * t.element_size() for t in recv.values()),
            "handoff_s": statistics.median(times), "handoff_s_all": times, "peak": peak}


def _rank(rank, world, backend, config, overrides, bucket_mb, dtype_name, iters):
    import torch.distributed as dist

    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import load_run_config
    from longmoe.train.setup import build_model, torch_dtype
    run = load_run_config(config, overrides)
    layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
    model = build_model(run, layout, backend.device(0))
    return _handoff(model, run, layout, backend, bucket_mb, torch_dtype(dtype_name), iters,
                    dist.barrier)


def run_bench(config: str | None, overrides: list[str], bucket_mb: float, dtype_name: str,
              iters: int, export_dir: str | None, export: bool = True, nproc: int = 1) -> dict:
    """One rank (`nproc` 1: the whole model is its share) or `nproc` local ranks in the run
    config's layout, each sending what it owns (`senders="owners"`); ranks start each timed
    hand-off together and the slowest one's time is reported. export_hf is timed on one rank
    only."""
    from longmoe.backends import active_backend
    from longmoe.errors import UserError
    from longmoe.model.hf import export_hf
    from longmoe.parallel.mesh import Layout
    from longmoe.train.config import load_run_config
    from longmoe.train.setup import build_model, torch_dtype
    run = load_run_config(config, overrides)
    backend = active_backend()
    dtype = torch_dtype(dtype_name)
    per = run.parallel.ep * run.parallel.cp
    if nproc < 1 or nproc % per:
        raise UserError(f"--nproc: {nproc} ranks cannot hold parallel.ep x parallel.cp = {per}")
    if nproc > 1:
        from longmoe.api import run_local
        ranks = run_local(_rank, nproc, config, overrides, bucket_mb, dtype_name, iters,
                          device=backend.device_type)
        model = None
    else:
        alone = Layout(1, 0, 1, None, None, None)
        model = build_model(run, alone, backend.device(0))
        ranks = [_handoff(model, run, alone, backend, bucket_mb, dtype, iters, lambda: None)]
    slowest = max(r["handoff_s"] for r in ranks)
    sent = [r["bytes"] for r in ranks]
    peaks = [r["peak"] for r in ranks]
    report = {"bench": "weight_sync", "model": run.model.source, "layers": run.model.num_layers,
              "num_experts": run.model.num_experts, "dtype": dtype_name, "nproc": nproc,
              "ep": run.parallel.ep, "cp": run.parallel.cp,
              "bucket_bytes": ranks[0]["bucket_bytes"], "buckets": max(r["buckets"] for r in ranks),
              "bytes_per_rank": sent[0] if nproc == 1 else sent, "bytes_total": sum(sent),
              "tensors": sum(r["tensors"] for r in ranks),
              "receive_buffer_bytes": sum(r["receive_buffer_bytes"] for r in ranks),
              "handoff_s": slowest, "handoff_s_all": [r["handoff_s_all"] for r in ranks]
              if nproc > 1 else ranks[0]["handoff_s_all"],
              "handoff_GBps": sum(sent) / slowest / 1e9,
              "peak_extra_device_bytes": peaks[0] if nproc == 1 else (
                  None if None in peaks else max(peaks)),
              "ranks": ranks if nproc > 1 else None}
    if export and model is not None:
        out = export_dir or tempfile.mkdtemp(prefix="longmoe-export-")
        try:
            t0 = time.perf_counter()
            export_hf(model, run.model, out, dtype=dtype)
            report["export_hf_s"] = time.perf_counter() - t0
            report["export_dir"] = out if export_dir else "(temporary)"
        finally:
            if export_dir is None:
                shutil.rmtree(out, ignore_errors=True)
    return report


def markdown_table(r: dict) -> str:
    gb = r.get("bytes_total", r["bytes_per_rank"]) / 1e9
    peak = r["peak_extra_device_bytes"]
    rows = ["| model | layers | experts | ranks | dtype | bucket MiB | buckets | GB sent | hand-off s "
            "| GB/s | peak extra GiB | export_hf s |", "|" + "---|" * 12,
            f"| {r['model']} | {r['layers']} | {r['num_experts']} | {r.get('nproc', 1)} "
            f"| {r['dtype']} "
            f"| {r['bucket_bytes'] / 2**20:g} | {r['buckets']} | {gb:.3f} | {r['handoff_s']:.3f} "
            f"| {r['handoff_GBps']:.2f} | {'-' if peak is None else f'{peak / 2**30:.2f}'} "
            f"| {r.get('export_hf_s', float('nan')):.2f} |"]
    if r.get("ranks"):
        rows += ["", "| rank | GB sent | tensors | hand-off s |", "|---|---|---|---|"]
        rows += [f"| {i} | {x['bytes'] / 1e9:.3f} | {x['tensors']} | {x['handoff_s']:.3f} |"
                 for i, x in enumerate(r["ranks"])]
    return "\n".join(rows)


def _cmd(a) -> int:
    from longmoe.bench import write_json_and_table
    overrides = list(a.set or [])
    if a.smoke:
        overrides = ["model.preset=tiny-hybrid", "parallel.fsdp=false"] + overrides
    report = run_bench(a.config, overrides, a.bucket_mb, a.dtype, 1 if a.smoke else a.iters,
                       a.export_dir, export=not a.no_export, nproc=a.nproc)
    write_json_and_table(report, a.out, markdown_table)
    return 0


def add_parser(bsub):
    p = bsub.add_parser("weight-sync", help="weights to a rollout engine: buckets into a device "
                                            "buffer, and export_hf to local disk (one device)")
    p.add_argument("--config", help="run config (YAML or recipe name); default: the tiny model")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    p.add_argument("--bucket-mb", type=float, default=512.0, help="bucket size in MiB")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=3, help="timed hand-offs (median reported)")
    p.add_argument("--export-dir", help="keep the export here (default: a temporary directory)")
    p.add_argument("--no-export", action="store_true", help="skip timing export_hf")
    p.add_argument("--nproc", type=int, default=1, help="local ranks in the config's layout "
                                                        "(each sends what it owns)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--smoke", action="store_true", help="tiny-hybrid model: check the bench runs")
    p.set_defaults(fn=_cmd)
