"""`longmoe recipe`: a parallel layout that fits, with reasons, the per-rank memory table, and a
run config `longmoe train` accepts.

  longmoe recipe --model qwen3.5-35b-a3b --hardware h100 --gpus 32 --seq-len 131072
                 [--format table|json|yaml] [--out FILE] [--explain]

Wired into longmoe/cli.py by `add_parser(sub)`; `main(argv)` runs it standalone (tests).
No torch import on this path: a plan takes milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import yaml

from longmoe.config import PRESETS, ModelConfig, from_hf_config, get_preset
from longmoe.errors import UserError
from longmoe.plan.hardware import get_hardware, names as hardware_names
from longmoe.plan.memory import Assumptions, GiB, Workload
from longmoe.plan.planner import HEADROOM, Plan, grid, plan


def add_parser(subparsers) -> argparse.ArgumentParser:
    r = subparsers.add_parser("recipe", help="plan TP/PP/EP/CP for a model, GPU type and count, "
                                             "and sequence length; estimate per-GPU memory")
    r.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json")
    r.add_argument("--hardware", required=True, help=f"one of {', '.join(hardware_names())}")
    r.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    r.add_argument("--seq-len", type=int, required=True, help="tokens of one sequence")
    r.add_argument("--micro-batch", type=int, default=1,
                   help="sequences per micro-batch per data-parallel replica (default 1)")
    r.add_argument("--format", default="table", choices=["table", "json", "yaml"])
    r.add_argument("--out", help="write a run config (YAML) for `longmoe train`")
    r.add_argument("--explain", action="store_true",
                   help="also judge every cell of the TP x PP x EP x CP grid")
    r.add_argument("--tp", type=int, help="force a tensor-parallel size (default: 1)")
    r.add_argument("--recompute", default="full", choices=["full", "selective", "none"])
    r.add_argument("--keep-last", default="0", metavar="N|auto",
                   help="trailing layers that store activations instead of recomputing (auto: "
                        "as many as the budget allows; default 0, the table says how many fit)")
    r.add_argument("--keep-attention", nargs="?", const="on", default="auto",
                   choices=["on", "off", "auto"],
                   help="full recompute keeps the attention kernel's tensors in full-attention "
                        "layers (parallel.keep_attention): no second attention forward, ~0.8 "
                        "GiB more a layer per 32K local tokens at the Qwen3.5 shape (auto, the "
                        "default: on where the estimate fits; the flag alone: on)")
    r.add_argument("--sharding", default="fsdp2", choices=["fsdp2", "dist_opt"],
                   help="FSDP2 (longmoe) or a Megatron-style distributed optimizer (comparison)")
    r.add_argument("--logits", default="linear_ce", choices=["linear_ce", "naive"])
    r.add_argument("--ep-chunks", type=int, default=0, help="chunked EP pieces (0: tuning default)")
    r.add_argument("--grad-sync", default="micro_batch", choices=["micro_batch", "step"],
                   help="gradient reduction with several micro-batches a step: after each "
                        "(sharded gradients; default) or once per step (unsharded fp32 "
                        "gradients held across micro-batches, counted in the estimate)")
    r.add_argument("--linear-core", default="kernel", choices=["kernel", "compiled", "chunked"],
                   help="Gated DeltaNet memory: a fused kernel (fla; attention-sized, assumed), "
                        "longmoe's core compiled (counted; the GPU default where fla cannot run) "
                        "or eager (counted)")
    r.add_argument("--headroom", type=float, default=HEADROOM,
                   help="fraction of the budget kept free for estimator error "
                        f"(default {HEADROOM})")
    r.set_defaults(fn=run)
    return r


def resolve_model(name: str) -> ModelConfig:
    if name.endswith(".json"):
        return from_hf_config(name)
    if name not in PRESETS:
        raise UserError(f"--model: unknown model {name!r}; valid: {', '.join(PRESETS)} "
                        "(or a path to a Hugging Face config.json)")
    return get_preset(name)


def make_plan(a) -> tuple[Plan, ModelConfig, Workload]:
    for flag, v, lo in (("--seq-len", a.seq_len, 1), ("--micro-batch", a.micro_batch, 1),
                        ("--ep-chunks", a.ep_chunks, 0)):
        if v < lo:
            raise UserError(f"{flag}: must be >= {lo}, got {v}")
    if a.tp is not None and a.tp < 1:
        raise UserError(f"--tp: must be >= 1, got {a.tp}")
    if not 0 <= a.headroom < 1:
        raise UserError(f"--headroom: must be in [0, 1), got {a.headroom}")
    keep = a.keep_last if a.keep_last == "auto" else _nonneg_int(a.keep_last, "--keep-last")
    cfg, hw = resolve_model(a.model), get_hardware(a.hardware)
    w = Workload(a.seq_len, a.micro_batch, a.recompute, a.sharding, a.logits == "linear_ce",
                 ep_chunks=a.ep_chunks, grad_sync=getattr(a, "grad_sync", "micro_batch"))
    return plan(cfg, hw, a.gpus, w, model_name=a.model, tp=a.tp, headroom=a.headroom,
                a=Assumptions(linear_core=a.linear_core), keep_last=keep,
                keep_attention=getattr(a, "keep_attention", "auto")), cfg, w


def _nonneg_int(v: str, flag: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise UserError(f"{flag}: expected a number or auto, got {v!r}") from None
    if n < 0:
        raise UserError(f"{flag}: must be >= 0, got {n}")
    return n


def trainer_cannot_run(lay) -> str | None:
    """Why `longmoe train` rejects a layout at launch, or None when it runs it."""
    if lay.tp > 1 or lay.pp > 1:
        return (f"longmoe train runs TP = PP = 1 and rejects {lay.label} at launch; "
                "this plan is an estimate until tensor and pipeline parallelism land")
    return None


def run(a) -> int:
    p, cfg, w = make_plan(a)
    # The grid judges every cell as the planner did (the request's workload and keep_attention
    # mode), and the chosen cell is the plan's own estimate: one number per cell.
    cells = (p.explain(grid(cfg, p.hardware, p.gpus, w, headroom=a.headroom,
                            a=Assumptions(linear_core=a.linear_core),
                            keep_attention=getattr(a, "keep_attention", "auto")))
             if a.explain else [])
    cannot = trainer_cannot_run(p.layout)
    if a.format == "table":
        print(render_table(p))
        if a.explain:
            print(render_grid(cells, p.layout))
    else:
        d = p.to_dict()
        d["trainer_runs_it"] = cannot is None
        if cannot:
            print(f"note: {cannot}", file=sys.stderr)
        if a.explain:
            d["grid"] = [{"tp": c.layout.tp, "pp": c.layout.pp, "ep": c.layout.ep,
                          "cp": c.layout.cp, "verdict": c.verdict, "why": c.why,
                          "peak_bytes": c.memory.peak if c.memory else None,
                          "trainer_runs_it": trainer_cannot_run(c.layout) is None}
                         for c in cells]
        print(json.dumps(d, indent=2) if a.format == "json" else
              yaml.safe_dump(d, sort_keys=False, width=100), end="\n" if a.format == "json" else "")
    if a.out:
        text = run_config_yaml(p, command=" ".join(["longmoe", "recipe"] + _argv_of(a)),
                               linear_core=a.linear_core)
        Path(a.out).write_text(text)
        print(f"wrote {a.out}" + (" (longmoe train rejects it at launch: TP or PP > 1)"
                                  if cannot else ""), file=sys.stderr)
    return 0


def _argv_of(a) -> list[str]:
    out = ["--model", a.model, "--hardware", a.hardware, "--gpus", str(a.gpus),
           "--seq-len", str(a.seq_len)]
    if a.micro_batch != 1:
        out += ["--micro-batch", str(a.micro_batch)]
    if a.tp is not None:
        out += ["--tp", str(a.tp)]
    if a.linear_core != "kernel":
        out += ["--linear-core", a.linear_core]
    if getattr(a, "grad_sync", "micro_batch") != "micro_batch":
        out += ["--grad-sync", a.grad_sync]
    if getattr(a, "keep_attention", "auto") != "auto":
        out += ["--keep-attention", a.keep_attention]
    if getattr(a, "keep_last", "0") != "0":
        out += ["--keep-last", a.keep_last]
    return out


def render_table(p: Plan) -> str:
    lay, w, hw, m = p.layout, p.workload, p.hardware, p.memory
    lines = [
        f"recipe: {p.model}, {w.seq_len:,}-token sequences, {p.gpus} x {hw.name} "
        f"({hw.usable_gib} GiB usable, planning budget {p.budget_bytes / GiB:.1f} GiB)",
        f"  {lay.label} (DP {lay.dp}), {w.recompute} recompute, {w.sharding}, "
        f"{'linear CE' if w.linear_ce else 'naive logits'}, {p.ep_chunks} EP chunk(s)",
        f"  local sequence {p.local_seq:,} tokens; estimated peak {m.peak / GiB:.1f} GiB per GPU",
        f"  micro-batch budget {w.tokens_per_micro_batch:,} tokens "
        f"(data.max_tokens_per_micro_batch), gradients reduced per {w.grad_sync}"]
    cannot = trainer_cannot_run(lay)
    if cannot:
        lines.append(f"  NOT RUNNABLE YET: {cannot}")
    if p.keep_fits > w.keep_last:
        lines.append(f"  {p.keep_fits} trailing layer(s) could skip recompute within the budget "
                     f"(--keep-last auto; now {w.keep_last})")
    lines += ["why:"]
    lines += [f"  {k:<10}{v}" for k, v in p.reasons.items()]
    return "\n".join(lines + [m.table()])


def render_grid(cells, chosen=None) -> str:
    """The rejected cells of the TP x PP x EP x CP grid with the reason for each, then the
    fitting ones in one line each (the chosen layout marked)."""
    count = Counter(c.verdict for c in cells)
    fits = [c for c in cells if c.verdict == "fits"]
    rejected = [c for c in cells if c.verdict != "fits"]
    out = [f"grid: {len(cells)} cells of TP x PP x EP x CP: {count['fits']} fit, "
           f"{count['OOM']} OOM, {count['invalid']} invalid"]
    if rejected:
        out += [f"rejected ({len(rejected)}):", f"  {'layout':<18}{'verdict':<9}why"]
        out += [f"  {c.layout.label:<18}{c.verdict:<9}{c.why}" for c in rejected]
    if fits:
        runs = sum(trainer_cannot_run(c.layout) is None for c in fits)
        out += [f"fit ({len(fits)}; {runs} with TP = PP = 1, which longmoe train runs):"]
        out += [f"  {c.layout.label:<18}{c.why}"
                + ("   <- the plan" if chosen is not None and c.layout == chosen else "")
                + ("   (estimate only: TP or PP > 1)" if trainer_cannot_run(c.layout) else "")
                for c in fits]
    return "\n".join(out)


def run_config(p: Plan, linear_core: str = "kernel") -> dict:
    """The `longmoe train` config for a plan (validated with longmoe.train.config.from_dict)."""
    w = p.workload
    if w.recompute == "selective":
        raise UserError("--out: the trainer runs recompute none|full; selective is estimate-only")
    if w.sharding != "fsdp2":
        raise UserError("--out: the trainer shards with FSDP2; dist_opt is estimate-only")
    model = {"preset": p.model} if p.model in PRESETS else {"hf_config": p.model}
    impl = ({"linear_ce": "auto"} if w.linear_ce
            else {"linear_ce": "reference", "policy_loss": "unfused"})
    if linear_core != "kernel":  # the memory was planned for this core: run it
        impl["gated_delta"] = {"chunked": "chunked", "compiled": "chunked_compiled"}[linear_core]
    config = {
        "model": model,
        "parallel": {"ep": p.layout.ep, "chunks": p.ep_chunks, "fsdp": True,
                     "recompute": (w.recompute if not w.keep_last else
                                   [w.recompute] * (p.num_layers - w.keep_last)
                                   + ["none"] * w.keep_last),
                     "param_dtype": "bfloat16",
                     "reduce_dtype": "float32", "cp": p.layout.cp, "pp": p.layout.pp,
                     "tp": p.layout.tp, "grad_sync": w.grad_sync},
        "impl": impl,
        # data.batch_size is global: micro_batch sequences on each data-parallel replica
        # The planned token budget of one micro-batch row (each GPU of its CP x TP group holds
        # 1/(CP x TP) of it); seq_len is the synthetic samples' length.
        "data": {"source": "synthetic", "batch_size": w.micro_batch * p.layout.dp,
                 "seq_len": w.seq_len,
                 "prompt_len": min(2048, w.seq_len // 2),
                 "max_tokens_per_micro_batch": w.tokens_per_micro_batch},
        "loss": {"type": "grpo"},
        "train": {"nproc": min(p.gpus, p.hardware.gpus_per_node)},
    }
    if w.keep_attention:
        config["parallel"]["keep_attention"] = True
    return config


def run_config_yaml(p: Plan, command: str, linear_core: str = "kernel") -> str:
    from longmoe.train.config import from_dict
    cfg = run_config(p, linear_core)
    from_dict(cfg)   # the file must load as a RunConfig; a failure here is a planner bug
    lay = p.layout
    head = [f"# Planned by: {command}",
            f"# {lay.label} on {p.gpus} x {p.hardware.name}: estimated peak "
            f"{p.memory.peak / GiB:.1f} GiB per GPU of {p.hardware.usable_gib} GiB "
            f"(budget {p.budget_bytes / GiB:.1f} GiB); local sequence {p.local_seq:,} tokens."]
    head += [f"#   {k}: {v}" for k, v in p.reasons.items()]
    cannot = trainer_cannot_run(lay)
    if cannot:
        head.append(f"# NOT RUNNABLE YET: {cannot} (the fields are the plan, kept for then).")
    nodes = -(-p.gpus // p.hardware.gpus_per_node)
    if nodes > 1:
        head.append(f"# {nodes} nodes: start one process per GPU with torchrun on each node; "
                    "train.nproc is the per-node count.")
    body = yaml.safe_dump(cfg, sort_keys=False)
    # data.batch_size is global; say how it divides (YAML dumpers keep no comments).
    split = "·".join([f"TP{lay.tp}"] * (lay.tp > 1) + [f"PP{lay.pp}"] * (lay.pp > 1)
                     + [f"CP{lay.cp}"])
    each = ("one sequence" if p.workload.micro_batch == 1
            else f"{p.workload.micro_batch} sequences")
    line = f"  batch_size: {cfg['data']['batch_size']}\n"
    body = body.replace(line, f"{line[:-1]}       # global: {each} per data rank "
                              f"({p.gpus} GPUs / {split})\n", 1)
    return "\n".join(head) + "\n" + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="longmoe")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["recipe"] + list(sys.argv[1:] if argv is None else argv))
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
