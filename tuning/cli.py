"""`longmoe tune chunks`: measure (or, with --predict, model) the best chunk count."""

from __future__ import annotations

import json

from longmoe.cli_args import int_list


# --smoke: a tiny layer on CPU-sized lengths, so the whole run takes seconds (its 4 local
# experts at EP 2 allow at most 4 expert chunks).
SMOKE = {"seq_lens": "64,128", "chunks": "1,2", "iters": 2}
FULL = {"seq_lens": "4096,8192,16384,32768,65536", "chunks": "1,2,4,8,16", "iters": 5}
DEFAULT_OUT = "tuning-out"
DEFAULT_EP = 2


def _cmd(a) -> int:
    from longmoe.config import get_preset
    from longmoe.errors import UserError
    if a.smoke and a.predict:
        raise UserError("--smoke: measures a tiny layer; --predict models a real one, pick one")
    defaults = SMOKE if a.smoke else FULL
    seq_lens = int_list(a.seq_lens or defaults["seq_lens"], "--seq-lens")
    chunks = int_list(a.chunks or defaults["chunks"], "--chunks")
    iters = a.iters if a.iters is not None else defaults["iters"]
    ep, ep_note = (a.ep, "") if a.ep is not None else (DEFAULT_EP, " (the --ep default)")
    if a.predict:
        if not a.hardware:
            raise UserError("--hardware: --predict models a part that is not here; name it "
                            "(h100, h200, mi300x, mi325x, mi355x)")
        return _predict(a, get_preset(a.model), seq_lens, chunks, ep, ep_note)
    if a.hardware:
        raise UserError("--hardware: only with --predict; a measurement runs on this machine's "
                        "devices (--device)")
    from longmoe.backends import active_backend
    from longmoe.tuning.tuner import tune_chunks
    device = a.device or active_backend().name
    summary = tune_chunks(a.model, ep, seq_lens, chunks, a.out or DEFAULT_OUT, device, iters,
                          a.trace_seq_len, smoke=a.smoke, show_progress=True, ep_note=ep_note)
    if a.json:
        print(json.dumps(summary, indent=1))
        return 0
    print("| T/rank | best chunks | transport | no-chunk ms | best ms | speedup | hidden |")
    print("|---|---|---|---|---|---|---|")
    from longmoe.tuning.tuner import hidden_cell
    for T, r in summary["results"].items():
        print(f"| {T} | {r['chunks']} | {r['transport']} | {r['nochunk_ms']:.2f} | {r['ms']:.2f} "
              f"| {r['speedup']:+.1%} | {hidden_cell(r)} |")
    hw = summary["hardware"]
    print(f"measured on: {hw['ranks']} x {hw['device']} ({hw['backend']} {hw['arch']}, "
          f"{hw['interconnect']}), EP {summary['ep']}{ep_note}, {summary['model']}, "
          f"{summary['dtype']}")
    print(f"cache: {summary['cache'] or summary['cache_note']}")
    print(f"plot: {summary['plot'] or summary['plot_note']}")
    for t in summary["traces"]:
        print(f"trace: {t}")
    picks = ", ".join(f"{T}: {r['chunks']}" for T, r in summary["results"].items())
    print(f"tuned {len(summary['results'])} lengths (best chunks {picks}); " + (
        f"training reads it with LONGMOE_TUNING_DIR={a.out or DEFAULT_OUT}" if summary["cache"]
        else "no cache written (CPU ranks)"))
    return 0


def _predict(a, cfg, seq_lens, chunks, ep, ep_note) -> int:
    from longmoe.console import note
    from longmoe.tuning.cost_model import predict
    from longmoe.tuning.tuner import check_inputs, write_prediction
    check_inputs(seq_lens, chunks, ep, cfg.num_experts)
    res = predict(a.hardware, cfg, ep, seq_lens, chunks, a.transport)
    written = write_prediction(res, cfg, a.out) if a.out else None
    if a.json:
        print(json.dumps({**res, "written": written}, indent=1))
    else:
        print(f"{res['label']}: {res['hardware']}, EP={ep}{ep_note}, {a.model}, {a.transport}")
        print("| T/rank | best chunks | no-chunk ms | best ms | speedup | GEMM ms | comm ms |")
        print("|---|---|---|---|---|---|---|")
        for T, r in res["results"].items():
            print(f"| {T} | {r['best_chunks']} | {r['nochunk_ms']:.2f} | {r['best_ms']:.2f} | "
                  f"{r['speedup']:+.1%} | {r['gemm_ms']:.2f} | {r['comm_ms']:.2f} |")
        if written:
            print(f"cache: {written['cache']} (entries marked predicted)")
            print(f"plot: {written['plot'] or written['plot_note']}")
    picks = ", ".join(f"{T}: {r['best_chunks']}" for T, r in res["results"].items())
    line = (f"predicted {len(res['results'])} lengths for {res['hardware']} at EP {ep}{ep_note} "
            f"(best chunks {picks}); ") + (
        f"cache and plot in {a.out}" if written else "nothing written (--out DIR writes the "
                                                       "cache and plot)")
    (note if a.json else print)(line)
    return 0


def _cmd_calibrate(a) -> int:
    from pathlib import Path
    from longmoe.config import get_preset
    from longmoe.errors import UserError
    from longmoe.plan.hardware import get_hardware
    from longmoe.tuning import calibrate
    from longmoe.tuning.cost_model import CALIBRATION_FILE, calibration
    try:
        sweep = json.loads(Path(a.from_file).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"--from: cannot read {a.from_file}: {e}") from None
    cal = calibrate.fit(sweep, get_preset(a.model), get_hardware(a.hardware), calibration())
    out = Path(a.out) if a.out else CALIBRATION_FILE
    calibrate.write(cal, out)
    f = cal["_fit"]
    print(f"calibration fitted to {f['rows']} layer rows: median error {f['median_rel_error']:.1%}, "
          f"max {f['max_rel_error']:.1%}; written to {out}")
    for k in ("gemm_fraction_of_peak", "a2a_fraction_of_link", "symmetric_memory_speed"):
        print(f"  {k} = {cal[k]['value']}")
    for k in ("non_gemm", "chunk_overhead"):
        print(f"  {k} = {cal[k]['fixed_us']} us + {cal[k]['passes']} HBM passes")
    for tr, v in cal["hide"].items():
        print(f"  hide[{tr}] = {v['value']}")
    return 0


def add_parser(sub):
    t = sub.add_parser("tune", help="measure and cache tuned settings for this machine")
    tsub = t.add_subparsers(dest="tcmd", required=True)
    c = tsub.add_parser("chunks", help="chunk count of chunked EP for one MoE layer")
    c.add_argument("--model", default="qwen3.5-35b-a3b", help="model preset")
    c.add_argument("--ep", type=int, help=f"expert-parallel ranks, one per device (default "
                   f"{DEFAULT_EP}; the run says when it used the default)")
    c.add_argument("--seq-lens", help=f"local tokens per rank to tune for (default: "
                   f"{FULL['seq_lens']}; with --smoke {SMOKE['seq_lens']})")
    c.add_argument("--chunks", help=f"chunk counts to sweep, 1 = baseline (default: "
                   f"{FULL['chunks']}; with --smoke {SMOKE['chunks']})")
    c.add_argument("--out", help=f"cache, plot and traces go here (default: {DEFAULT_OUT}; with "
                   "--predict nothing is written without it); point LONGMOE_TUNING_DIR at it "
                   "for training runs")
    c.add_argument("--device", help="backend name (default: auto)")
    c.add_argument("--iters", type=int, help=f"timed iterations per point (default: "
                   f"{FULL['iters']}; with --smoke {SMOKE['iters']})")
    c.add_argument("--trace-seq-len", type=int, help="length to profile (default: the middle one)")
    c.add_argument("--smoke", action="store_true",
                   help="a tiny layer at tiny lengths, one start of the ranks: checks the tuner "
                        "runs (~10 s on 2 CPU cores); writes no cache entry on CPU")
    c.add_argument("--predict", action="store_true",
                   help="cost model instead of measuring (for hardware not at hand); keys the "
                        "cache for a full node of --hardware")
    c.add_argument("--hardware", help="with --predict (required there): h100, h200, mi300x, "
                   "mi325x, mi355x")
    c.add_argument("--transport", default="process_group", help="with --predict")
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_cmd)
    k = tsub.add_parser("calibrate", help="fit the chunk cost model to a `bench moe-layer` sweep")
    k.add_argument("--from", dest="from_file", required=True, help="bench moe-layer JSON")
    k.add_argument("--hardware", default="h200", help="the machine the sweep ran on")
    k.add_argument("--model", default="qwen3.5-35b-a3b", help="the sweep's model preset")
    k.add_argument("--out", help="calibration file to write (default: the shipped one)")
    k.set_defaults(fn=_cmd_calibrate)
