"""The `longmoe` command: a table of contents of what the package does.

  train     the RL policy update on N local ranks (every primitive configurable)
  doctor    backend, devices, library versions, what is missing
  paired    a candidate implementation against its plain-PyTorch reference
  kernels   compile every Triton kernel config for every GPU target (no GPU needed)
  bench     benchmarks whose JSON results are committed (linear-ce, moe-layer, packing, ...)
  recipe    plan TP/PP/EP/CP, recompute and chunks for a model, GPU type, count and length
  tune      measure and cache the chunk count of chunked EP for this machine (or --predict)
  checkpoint  verify checkpoints against their manifests without loading them
"""

from __future__ import annotations

import argparse
import logging
import sys

from longmoe.cli_args import int_list
from longmoe.errors import UserError


def _cmd_train(a) -> int:
    from longmoe.train.config import load_run_config
    from longmoe.train.launch import launch
    from longmoe.train.trainer import RunOptions

    overrides = list(a.set or [])
    if a.steps is not None:
        if a.steps < 0:
            raise UserError(f"--steps: must be >= 0, got {a.steps}")
        overrides.append(f"train.steps={a.steps}")
    if a.nproc is not None:
        if a.nproc < 1:
            raise UserError(f"--nproc: must be >= 1, got {a.nproc}")
        overrides.append(f"train.nproc={a.nproc}")
    if a.resume and not a.checkpoint_dir:
        raise UserError("--resume: needs --checkpoint-dir")
    if a.overwrite and (a.resume or not a.checkpoint_dir):
        raise UserError("--overwrite: needs --checkpoint-dir, and excludes --resume")
    if a.allow_batch_change and not a.resume:
        raise UserError("--allow-batch-change: applies only with --resume")
    run = load_run_config(a.config, overrides)
    if a.checkpoint_dir and not run.parallel.fsdp and run.parallel.param_dtype != "float32":
        raise UserError("parallel.fsdp: checkpoints of fsdp=false runs need param_dtype=float32 "
                        f"(got {run.parallel.param_dtype}: fp32 master copies are not saved)")
    opts = RunOptions(metrics_out=a.metrics_out, checkpoint_dir=a.checkpoint_dir, resume=a.resume,
                      profile_dir=a.profile, overwrite=a.overwrite,
                      allow_batch_change=a.allow_batch_change)
    return launch(run, run.train.nproc, opts)


def _cmd_doctor(a) -> int:
    from longmoe.doctor import run_doctor
    return run_doctor(as_json=a.json)


def _cmd_paired(a) -> int:
    from longmoe.paired.cli import run_paired_cli
    return run_paired_cli(a.primitive, impl=a.impl, nproc=a.nproc, as_json=a.json, seed=a.seed)


def _cmd_kernels(a) -> int:
    from longmoe.ops.kernels.aot_cli import run_kernels_cli
    return run_kernels_cli(a.target, as_json=a.json, fla=a.fla, verbose=a.verbose, only=a.only)


def _cmd_bench(a) -> int:
    import torch
    from longmoe.bench.linear_ce import run_bench, write_report
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    if a.smoke:
        tokens, H, V, iters = [512], 256, 4096, 2
    else:
        tokens, H, V, iters = int_list(a.tokens, "--tokens"), a.hidden, a.vocab, a.iters
    impls = a.impls.split(",") if a.impls else None
    chunks = [int(x) for x in a.chunks.split(",")] if a.chunks else None
    report = run_bench(tokens, H, V, dtype, impls, chunks, iters=iters)
    write_report(report, a.out)
    return 0


def _cmd_bench_gmm(a) -> int:
    from longmoe.backends import active_backend
    from longmoe.bench import parse_configs, write_json_and_table
    from longmoe.bench.grouped_mm import markdown_table, run_bench
    from longmoe.ops.grouped_mm import GROUPED_MM
    impls = a.impls.split(",")
    for name in impls:
        if name == "auto":
            raise UserError("--impls: name implementations (auto is not one); "
                            f"valid: {', '.join(GROUPED_MM.names())}")
        GROUPED_MM.check_name(name, "--impls")
    try:
        configs = parse_configs(a.configs)
    except ValueError as e:
        raise UserError(f"--configs: {e}") from None
    report = run_bench(int_list(a.tokens, "--tokens"), a.top_k, a.experts, a.hidden, a.ffn, a.dtype,
                       impls, configs, a.iters, a.device or active_backend().name)
    write_json_and_table(report, a.out, markdown_table)
    return 0


def _cmd_bench_rows(a) -> int:
    from longmoe.backends import active_backend
    from longmoe.bench import parse_configs, write_json_and_table
    from longmoe.bench.moe_rows import markdown_table, run_bench
    try:
        configs = parse_configs(a.configs)
    except ValueError as e:
        raise UserError(f"--configs: {e}") from None
    report = run_bench(int_list(a.tokens, "--tokens"), a.top_k, a.hidden, a.ffn, a.dtype, configs,
                       a.iters, a.device or active_backend().name)
    write_json_and_table(report, a.out, markdown_table)
    return 0


def _cmd_bench_moe(a) -> int:
    from longmoe.backends import active_backend, get_backend
    from longmoe.bench.moe_layer import run_bench, write_report
    device = a.device or active_backend().name
    backend = get_backend(device)
    if a.smoke:
        tokens, chunks, iters = [64], [1, 2], 1
    else:
        tokens, chunks, iters = int_list(a.tokens, "--tokens"), int_list(a.chunks, "--chunks"), a.iters
    transports = a.transports.split(",") if a.transports else [backend.a2a_transport]
    for t in transports:
        try:
            backend.a2a(t, backend.device(0))
        except ValueError as e:
            raise UserError(f"--transports: {e}") from None
    prios = ([int(p) for p in a.priorities.split(",")] if a.priorities
             else [backend.comm_stream_priority])
    count = backend.probe().get("device_count") or 0
    if backend.device_type != "cpu" and a.nproc > count:
        raise UserError(f"--nproc: {a.nproc} ranks but only {count} {backend.name} device(s)")
    from longmoe.parallel.expert_parallel import CHUNK_BY
    if a.chunk_by not in CHUNK_BY:
        raise UserError(f"--chunk-by: must be one of {', '.join(CHUNK_BY)}, got {a.chunk_by!r}")
    if a.baseline not in (None, "megatron"):
        raise UserError(f"--baseline: only 'megatron' is known, got {a.baseline!r}")
    if a.baseline and backend.device_type == "cpu":
        raise UserError("--baseline: megatron's dispatcher runs on GPUs only (CUDA streams)")
    if a.baseline:
        try:
            import megatron.core  # noqa: F401
        except ImportError as e:
            raise UserError(f"--baseline: megatron-core is not importable ({e})") from None
    from longmoe.ops.moe_rows import MOE_ROWS
    MOE_ROWS.check_name(a.rows_impl, "--rows-impl")
    if a.fp32_matmul not in (None, "high", "highest"):
        raise UserError(f"--fp32-matmul: must be high or highest, got {a.fp32_matmul!r}")
    from longmoe.ops.router_matmul import ROUTER_MATMUL
    ROUTER_MATMUL.check_name(a.router_matmul, "--router-matmul")
    from longmoe.parallel.moe_pipeline import WGRAD
    wgrads = [w.strip() for w in a.wgrad.split(",")]
    for w in wgrads:
        if w not in WGRAD:
            raise UserError(f"--wgrad: each must be one of {', '.join(WGRAD)}, got {w!r}")
    if len(set(wgrads)) < len(wgrads):
        raise UserError(f"--wgrad: a schedule is listed twice in {a.wgrad!r}")
    if a.experts is not None and (a.experts < 1 or a.experts % a.nproc):
        raise UserError(f"--experts: must be a positive multiple of --nproc ({a.nproc}), "
                        f"got {a.experts}")
    report = run_bench(tokens, chunks, transports, prios, iters, a.nproc, device,
                       trace_tokens=a.trace_tokens, trace_dir=a.trace_dir,
                       trace_chunks=int_list(a.trace_chunks, "--trace-chunks"), smoke=a.smoke,
                       chunk_by=a.chunk_by, baseline=a.baseline, rows_impl=a.rows_impl,
                       wgrad=wgrads, fp32_matmul=a.fp32_matmul, router_matmul=a.router_matmul,
                       experts=a.experts)
    write_report(report, a.out)
    return 0


def _cmd_bench_delta(a) -> int:
    from longmoe.bench.gated_delta import run_bench, write_report
    from longmoe.config import get_preset
    get_preset(a.preset)  # one-line error naming model.preset
    if a.smoke:
        tokens, iters, preset = [128], 1, "tiny-hybrid"
    else:
        tokens, iters, preset = int_list(a.tokens, "--tokens"), a.iters, a.preset
    from longmoe.ops.attention import SDPA_NAMES
    from longmoe.ops.gated_delta import GATED_DELTA
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        impl, _, prec = v.partition("@")
        if prec and prec not in ("highest", "high"):
            raise UserError(f"--variants: {v!r}: precision must be highest or high")
        kind, _, sdpa = impl.partition(":")
        if kind == "sdpa":
            if sdpa and sdpa not in SDPA_NAMES:
                raise UserError(f"--variants: {v!r}: SDPA backend must be one of "
                                f"{', '.join(SDPA_NAMES)}")
        elif impl == "fla_direct":
            if prec:
                raise UserError(f"--variants: {v!r}: fla_direct takes no precision")
        elif impl not in GATED_DELTA.names():
            raise UserError(f"--variants: {v!r}: unknown core; valid: "
                            f"{', '.join(GATED_DELTA.names())}, fla_direct, sdpa[:backend]")
    report = run_bench(tokens, variants, preset, iters=iters, profile=a.profile,
                       profile_dir=a.profile_dir)
    write_report(report, a.out)
    return 0


def _set_overrides(items) -> dict[str, str]:
    """A bench's repeated `--set key=value`, checked with train's --set syntax, as {key: value}
    (passed on to the `longmoe train` runs it starts)."""
    from longmoe.train.config import apply_overrides
    extra = {}
    for item in items or []:
        apply_overrides({}, [item])
        k, v = item.split("=", 1)
        extra[k.strip()] = v
    return extra


def _cmd_bench_path(a) -> int:
    from longmoe.bench.train_path import run_path, write_report
    extra = _set_overrides(a.set)
    stages = a.stages.split(",") if a.stages else None
    report = run_path(a.config, a.nproc, int_list(a.tokens, "--tokens"), a.steps, extra, stages,
                      a.timeout, a.out, a.profile)
    write_report(report, a.out)
    return 0


def _cmd_bench_packing(a) -> int:
    from longmoe.bench.packing import FULL, SMOKE, run_bench, selected_arms, write_report
    extra = _set_overrides(a.set)
    base = SMOKE if a.smoke else FULL
    kw = {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in base.items()
          if k != "extra"}
    kw["extra"] = {**base["extra"], **extra}
    if kw["steps"] < 1:
        raise UserError(f"--steps: must be >= 1, got {kw['steps']}")
    report = run_bench(**kw, timeout=a.timeout, out=a.out, arm_names=selected_arms(a.arms))
    write_report(report, a.out)
    return 0 if all(r["status"] == "ok" for r in report["arms"]) else 1


def _expert_shape_args(p):
    """The flags the expert-kernel benches share: the layer's shape, tiles, timing, output."""
    p.add_argument("--tokens", default="16384,65536")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--configs", help="JSON list of Triton tile overrides (default: shipped)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--device", help="backend name (default: auto)")
    p.add_argument("--out", help="write the JSON report here")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="longmoe", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run the RL policy update")
    t.add_argument("--config", required=True, help="YAML file or a shipped recipe name")
    t.add_argument("--nproc", type=int, help="local ranks (default: train.nproc)")
    t.add_argument("--steps", type=int, help="optimizer steps (default: train.steps)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. parallel.chunks=4 (repeatable)")
    t.add_argument("--metrics-out", help="write one JSON object per step to this file")
    t.add_argument("--checkpoint-dir", help="save DCP checkpoints here")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    t.add_argument("--overwrite", action="store_true",
                   help="train from step 0 into a --checkpoint-dir that holds checkpoints: they "
                        "stay until this run publishes its first one, then are removed")
    t.add_argument("--allow-batch-change", action="store_true",
                   help="--resume at another global batch than the checkpoint was trained with")
    t.add_argument("--profile", metavar="DIR",
                   help="profile the third step: per-rank op table and Chrome trace into DIR")
    t.set_defaults(fn=_cmd_train)

    d = sub.add_parser("doctor", help="backend, devices, versions, what is missing")
    d.add_argument("--json", action="store_true")
    d.set_defaults(fn=_cmd_doctor)

    from longmoe.paired.cli import PRIMITIVES, primitives_help
    q = sub.add_parser("paired", help="candidate vs reference: loss, grads, peak memory, time",
                       epilog=primitives_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("primitive", help=" | ".join(PRIMITIVES))
    q.add_argument("--impl", default="auto", help="candidate implementation (default: auto)")
    q.add_argument("--nproc", type=int, default=2, help="ranks for distributed primitives")
    q.add_argument("--seed", type=int, default=None,
                   help="input seed (default: a fresh one, printed so that a failure can be rerun)")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=_cmd_paired)

    b = sub.add_parser("bench", help="benchmarks (results as JSON with device, versions, date)")
    bsub = b.add_subparsers(dest="bcmd", required=True)
    bl = bsub.add_parser("linear-ce", help="linear CE fwd+bwd: ours vs naive, liger, cut-cross-entropy")
    bl.add_argument("--tokens", default="8192,32768,65536")
    bl.add_argument("--hidden", type=int, default=2048)
    bl.add_argument("--vocab", type=int, default=248320)
    bl.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    bl.add_argument("--impls", help="comma list of ours,ours_rl,ours_split,ours_rl_split,"
                    "ours_lowp,ours_rl_lowp,naive,liger,cce (default: all)")
    bl.add_argument("--chunks", help="comma list of chunk sizes (tokens) to sweep for ours; 0 = default")
    bl.add_argument("--iters", type=int, default=5)
    bl.add_argument("--out", help="write the JSON report here")
    bl.add_argument("--smoke", action="store_true", help="tiny shapes: check the bench runs")
    bl.set_defaults(fn=_cmd_bench)

    bm = bsub.add_parser("moe-layer", help="one MoE layer under EP: no chunks vs chunked, "
                                          "per transport; comm-alone and GEMM-alone times")
    bm.add_argument("--tokens", default="4096,8192,16384,32768,65536", help="local tokens/rank")
    bm.add_argument("--chunks", default="1,2,4,8,16", help="chunk counts (1 = the baseline)")
    bm.add_argument("--transports", help="comma list: process_group,symmetric_memory "
                                         "(default: the backend's auto choice)")
    bm.add_argument("--priorities", help="comm-stream priorities (default: the backend's)")
    bm.add_argument("--nproc", type=int, default=2, help="EP ranks (one per device)")
    bm.add_argument("--chunk-by", default="experts",
                    help="experts (ranges of each rank's experts, the default) or tokens")
    bm.add_argument("--baseline", help="megatron: also time the layer with megatron-core's "
                                       "all-to-all token dispatcher (GPUs)")
    bm.add_argument("--rows-impl", default="auto",
                    help="the layer's row kernels (combine, SwiGLU): auto, triton or reference")
    bm.add_argument("--wgrad", default="auto",
                    help="the pipeline's weight gradients, one or a comma list timed in the "
                         "same rounds: in_chunks (inside each chunk's step where it owns its "
                         "experts), delayed (all at the end of the layer) or auto (in_chunks "
                         "where an all-to-all runs beside them or there is one chunk)")
    bm.add_argument("--experts", type=int,
                    help="the layer's expert count in place of the preset's (e.g. 32 on one "
                         "rank: one EP = 8 rank's share)")
    bm.add_argument("--fp32-matmul", help="fp32 GEMM precision on GPUs (the router's): high "
                                          "(TF32) or highest; default: the trainer's "
                                          "impl.fp32_matmul")
    bm.add_argument("--router-matmul", default="auto",
                    help="the router's logits GEMMs: auto, mixed (bf16 with fp32 output) or "
                         "reference (fp32 casts)")
    bm.add_argument("--device", help="backend name (default: auto)")
    bm.add_argument("--iters", type=int, default=5)
    bm.add_argument("--trace-tokens", type=int, help="also write profiler traces at this T")
    bm.add_argument("--trace-dir", help="where the traces go")
    bm.add_argument("--trace-chunks", default="1,8", help="chunk counts to trace")
    bm.add_argument("--out", help="write the JSON report here")
    bm.add_argument("--smoke", action="store_true", help="tiny layer on CPU ranks: check it runs")
    bm.set_defaults(fn=_cmd_bench_moe)

    br = bsub.add_parser("moe-rows", help="the MoE layer's row ops: eager vs Triton kernels and "
                                          "tile configs")
    _expert_shape_args(br)
    br.set_defaults(fn=_cmd_bench_rows)

    bg = bsub.add_parser("grouped-mm", help="the experts' six grouped GEMMs per implementation "
                                            "and Triton tile config")
    _expert_shape_args(bg)
    bg.add_argument("--experts", type=int, default=128, help="experts on the rank (256 / EP)")
    bg.add_argument("--impls", default="torch,triton")
    bg.set_defaults(fn=_cmd_bench_gmm)

    bd = bsub.add_parser("gated-delta", help="Gated DeltaNet core fwd/fwd+bwd per impl and matmul "
                                             "precision, beside causal SDPA at the same length")
    bd.add_argument("--tokens", default="16384,32768,65536")
    bd.add_argument("--variants", default="chunked,chunked@high,chunked_compiled,"
                                          "chunked_compiled@high,chunked_triton,"
                                          "chunked_triton@high,fla,fla_direct,sdpa",
                    help="impl[@highest|high] list; the first is the error reference; sdpa = "
                         "attention; fla_direct = fla's kernel called directly (the anchor of "
                         "the *_vs_fla_fwd ratios)")
    bd.add_argument("--preset", default="qwen3.5-35b-a3b", help="model preset giving the head shapes")
    bd.add_argument("--iters", type=int, default=5)
    bd.add_argument("--profile", help="variant to profile (op table per T into --profile-dir)")
    bd.add_argument("--profile-dir")
    bd.add_argument("--out", help="write the JSON report here")
    bd.add_argument("--smoke", action="store_true", help="tiny shapes: check the bench runs")
    bd.set_defaults(fn=_cmd_bench_delta)

    bp = bsub.add_parser("train-path", help="the seeds' optimisation path as training runs: "
                                            "baseline, +linear CE, +FSDP2, +chunked EP")
    bp.add_argument("--config", required=True, help="base run config (YAML or recipe name)")
    bp.add_argument("--nproc", type=int, default=1)
    bp.add_argument("--tokens", default="32768,65536", help="tokens per GPU (one sequence)")
    bp.add_argument("--steps", type=int, default=6)
    bp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every stage")
    bp.add_argument("--stages", help="comma list of stages to run (default: all)")
    bp.add_argument("--timeout", type=int, default=1800, help="seconds per stage")
    bp.add_argument("--out", help="write the JSON report here")
    bp.add_argument("--profile", metavar="DIR",
                    help="profile each run's third step into DIR/<stage>-<tokens>/")
    bp.set_defaults(fn=_cmd_bench_path)
    __import__("longmoe.bench.weight_sync", fromlist=["add_parser"]).add_parser(bsub)
    __import__("longmoe.bench.logprobs", fromlist=["add_parser"]).add_parser(bsub)
    __import__("longmoe.bench.gated_delta_tiles", fromlist=["add_parser"]).add_parser(bsub)

    bk = bsub.add_parser("packing", help="a GRPO batch of log-normal lengths: packed token-budget "
                                         "micro-batches vs padded rows vs full single-sample rows")
    # Defaults: longmoe.bench.packing.FULL (SMOKE with --smoke); flags given win over both.
    bk.add_argument("--config", help="base run config (YAML or recipe name; default gpu_smoke)")
    bk.add_argument("--nproc", type=int,
                    help="ranks per arm (default: the config's train.nproc; 1 with --smoke)")
    bk.add_argument("--samples", type=int, help="samples of the packed arm's step (default 64)")
    bk.add_argument("--mean", type=int, help="mean response tokens, log-normal (default 6144)")
    bk.add_argument("--max-len", type=int,
                    help="the longest sample, prompt included (default 32768; the response cap "
                         "is this less --prompt-len); also the full-rows arm's sample")
    bk.add_argument("--budget", type=int,
                    help="data.max_tokens_per_micro_batch (default 32768; at least --max-len)")
    bk.add_argument("--prompt-len", type=int, help="default 1024")
    bk.add_argument("--row-multiple", type=int,
                    help="packed rows padded to a multiple of this: fewer shapes to compile "
                         "(default 1024)")
    bk.add_argument("--padded-samples", type=int,
                    help="samples of the padded arm's step, each a full row (default 6)")
    bk.add_argument("--ref-samples", type=int,
                    help="samples of the full-rows arm's step (default 2)")
    bk.add_argument("--steps", type=int, help="steps per arm; the first compiles (default 2)")
    bk.add_argument("--arms", help="comma-separated arms to run, in their fixed order: "
                                   "full-rows, packed, padded (the default), packed-static (the "
                                   "packed arm with every row length compiled apart), "
                                   "packed-manifest (the packed arm twice from empty caches of "
                                   "its own: recording train.kernel_manifest, then from it)")
    bk.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every arm")
    bk.add_argument("--timeout", type=int, default=900, help="seconds per arm")
    bk.add_argument("--out", help="write the JSON report here")
    bk.add_argument("--smoke", action="store_true",
                    help="tiny shapes on the cpu_demo model: check the bench runs (seconds)")
    bk.set_defaults(fn=_cmd_bench_packing)

    k = sub.add_parser("kernels", help="compile-check every Triton kernel config per GPU target")
    ksub = k.add_subparsers(dest="kcmd", required=True)
    kc = ksub.add_parser("compile", help="registers/VGPRs, shared/LDS, spills per kernel config")
    kc.add_argument("--target", default="all",
                    help="a compile target registered by longmoe.backends, or all (default)")
    kc.add_argument("--json", action="store_true",
                    help="every config's report as JSON on stdout (the summary on stderr)")
    kc.add_argument("--verbose", action="store_true",
                    help="the per-config table (registers, shared memory, spills), not only "
                         "the configs that fail")
    kc.add_argument("--only", metavar="PREFIX",
                    help="the kernel variants whose name starts with PREFIX (e.g. grouped_mm)")
    kc.add_argument("--fla", action="store_true",
                    help="flash-linear-attention's Gated DeltaNet kernels instead of ours")
    kc.set_defaults(fn=_cmd_kernels)

    from longmoe.checkpoint.verify import add_parser as add_checkpoint_parser
    add_checkpoint_parser(sub)
    from longmoe.plan.cli import add_parser as add_recipe_parser
    add_recipe_parser(sub)
    from longmoe.tuning.cli import add_parser as add_tune_parser
    add_tune_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a rank died: show its last line, not the launcher's traceback
        from torch.multiprocessing import ProcessRaisedException
        if isinstance(e, ProcessRaisedException):
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            last = lines[-1] if lines else str(e)
            user = "longmoe.errors.UserError: "
            if user in last or "ConfigError: " in last:  # a user error only a rank could see
                print(f"error: {last.split(': ', 1)[1]}", file=sys.stderr)
                return 2
            print(f"error: a rank failed: {last}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
