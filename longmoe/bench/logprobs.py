"""`longmoe bench logprobs`: forward-only log-probs (an RL step's old and reference log-probs)
against the training step, on the same batch and model, on one device.

The model and the batch are built as `longmoe train` builds them from the same run config: one
step's micro-batches from the data feed (packed under `data.max_tokens_per_micro_batch` when the
config packs). Timed per pass over every micro-batch (median over `--iters` after one warm-up
pass, device synchronised):
  train      the training step's forward and backward of each micro-batch (train.step.accumulate:
             the fused policy loss, the gradient reduction; no optimizer step);
  logprobs   longmoe.rl.logprobs.compute_logprobs of each micro-batch (no gradient, no logits);
  logprobs+entropy  the same with the full-softmax entropy.
Reports the trained (useful) tokens of the pass, tokens/s and peak device memory of each mode, and
the log-probs' rate over the training rate.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time


def _pass_fn(mode, model, data, run, layout, device, counts):
    from longmoe.rl.logprobs import compute_logprobs
    from longmoe.train.step import accumulate, local_micro_batch

    def train():
        model.zero_grad(set_to_none=True)
        accumulate(model, data.micro, run, layout, counts[0], device, counts[1])

    def logprobs(entropy: bool):
        for mb in data.micro:
            batch, positions, packing = local_micro_batch(mb, layout, device)
            compute_logprobs(model, batch.input_ids, batch.labels, positions, packing,
                             with_entropy=entropy)

    return {"train": train, "logprobs": lambda: logprobs(False),
            "logprobs+entropy": lambda: logprobs(True)}[mode]


def run_bench(config: str | None, overrides: list[str], iters: int) -> dict:
    import torch
    import torch.distributed as dist

    from longmoe.parallel.mesh import build_layout
    from longmoe.train.config import load_run_config
    from longmoe.train.feed import Feed
    from longmoe.train.setup import build_model
    from longmoe.train.step import step_counts
    from longmoe.train.trainer import init_distributed, resolve_backend

    run = load_run_config(config, overrides)
    backend = resolve_backend(run.train.device)
    owned = not dist.is_initialized()
    if owned:  # FSDP2 needs a process group, even of one rank
        rendezvous = os.path.join(tempfile.mkdtemp(prefix="longmoe-bench-"), "rendezvous")
        init_distributed(backend, 0, 1, 0, f"file://{rendezvous}")
    try:
        if backend.device_type != "cpu":
            torch.set_float32_matmul_precision(run.impl.fp32_matmul)
        torch.manual_seed(run.train.seed)
        layout = build_layout(backend.device_type, run.parallel.ep, run.parallel.cp)
        device = backend.device(0)
        model = build_model(run, layout, device)
        data = Feed(run, layout.data_rank, layout.data_world).step(0)
        counts = step_counts(data.trained_tokens, data.trained_samples, layout, device)
        modes = {}
        for mode in ("train", "logprobs", "logprobs+entropy"):
            fn = _pass_fn(mode, model, data, run, layout, device, counts)
            fn()  # warm-up: compiles, trial calls, allocator
            backend.synchronize()
            times, peak = [], None
            for _ in range(max(1, iters)):
                if backend.device_type != "cpu":
                    backend.reset_peak_memory()
                t0 = time.perf_counter()
                fn()
                backend.synchronize()
                times.append(time.perf_counter() - t0)
                if backend.device_type != "cpu":
                    peak = max(peak or 0, backend.peak_memory_bytes())
            s = statistics.median(times)
            modes[mode] = {"s": s, "s_all": times, "tokens_per_s": data.trained_tokens / s,
                           "peak_bytes": peak}
        model.zero_grad(set_to_none=True)
    finally:
        if owned:
            dist.destroy_process_group()
    train_rate = modes["train"]["tokens_per_s"]
    return {"bench": "logprobs", "model": run.model.source, "layers": run.model.num_layers,
            "num_experts": run.model.num_experts, "micro_batches": len(data.micro),
            "trained_tokens": data.trained_tokens, "budget": run.data.max_tokens_per_micro_batch,
            "packing": run.data.packing, "recompute": run.parallel.recompute,
            "fsdp": run.parallel.fsdp, "modes": modes,
            "logprobs_over_train": modes["logprobs"]["tokens_per_s"] / train_rate,
            "logprobs_entropy_over_train": modes["logprobs+entropy"]["tokens_per_s"] / train_rate}


def markdown_table(r: dict) -> str:
    rows = [f"{r['layers']} layers, {r['num_experts']} experts; {r['micro_batches']} micro-batches, "
            f"{r['trained_tokens']:,} trained tokens a pass; recompute {r['recompute']}, "
            f"fsdp {r['fsdp']}", "",
            "| mode | s a pass | tokens/s | over train | peak GiB |", "|---|---|---|---|---|"]
    base = r["modes"]["train"]["tokens_per_s"]
    for mode, m in r["modes"].items():
        peak = "-" if m["peak_bytes"] is None else f"{m['peak_bytes'] / 2**30:.2f}"
        rows.append(f"| {mode} | {m['s']:.3f} | {m['tokens_per_s']:,.0f} "
                    f"| {m['tokens_per_s'] / base:.2f}x | {peak} |")
    return "\n".join(rows)


def _cmd(a) -> int:
    from longmoe.bench import write_json_and_table
    overrides = list(a.set or [])
    if a.smoke:
        overrides = ["model.preset=tiny-hybrid", "data.seq_len=128", "data.prompt_len=8",
                     "data.batch_size=4", "data.packing=true",
                     "data.max_tokens_per_micro_batch=128",
                     "data.response_len=lognormal:40:100"] + overrides
    report = run_bench(a.config, overrides, 1 if a.smoke else a.iters)
    write_json_and_table(report, a.out, markdown_table)
    return 0


def add_parser(bsub):
    p = bsub.add_parser("logprobs", help="forward-only log-probs against the training step on "
                                         "the same batch (one device)")
    p.add_argument("--config", help="run config (YAML or recipe name); default: the tiny model")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override")
    p.add_argument("--iters", type=int, default=3, help="timed passes per mode (median reported)")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--smoke", action="store_true", help="tiny-hybrid model: check the bench runs")
    p.set_defaults(fn=_cmd)
