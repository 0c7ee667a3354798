"""`longmoe bench packing`: a GRPO batch of variable-length samples trained packed into token-budget
micro-batches, against the same distribution in padded rows, and against full single-sample rows
of the longest length (the throughput a row of the budget reaches when it is all one sample).

Arms, each one `longmoe train` subprocess (longmoe.bench.train_path's runner) on the synthetic
rule task with log-normal response lengths (data.response_len):

  full rows  every sample exactly --max-len tokens, one per micro-batch row: the reference rate
  packed     --samples samples, packed end to end into micro-batches of --budget tokens
             (data.max_tokens_per_micro_batch; rows padded to a multiple of --row-multiple)
  padded     the same distribution, one sample per micro-batch padded to the budget
             (data.packing=false); every row costs the same, so --padded-samples (fewer) measure
             its rate
  packed, static shapes
             the packed arm with LONGMOE_COMPILE_SHAPES=static (longmoe.ops.compiled): every
             packed row length compiles the row-wise pieces again; only with --arms packed-static
  packed, empty caches / packed, empty caches, kernel manifest
             the packed arm twice, each with Triton and inductor caches of its own, empty at its
             start: the first records train.kernel_manifest (its first step compiles every
             variant), the second compiles that manifest ahead (longmoe.ops.kernels.precompile);
             only with --arms packed-manifest

The other arms run one after another on the same machine and share torch's and Triton's on-disk
caches, so an arm's first step finds what earlier arms compiled for the same graphs (the
full-rows arm runs first, and its first step pays the process's compiles from cold).

Every step of an arm trains the same samples (data.num_samples = the batch), so its row shapes
repeat and only the first step compiles. Per arm: the first step's time and its ratio to the
steady step (what compiling costs); over the steps after the first: the median
useful tokens/s (the samples' own tokens, padding excluded, per second), step time, padding
share, micro-batches per step, hardware TFLOPS, and the peak memory over all steps. The report
adds the packed and padded rates over the full-rows rate, the packed arm's peak over the full
rows' peak, and padded rows' rate at the packed arm's batch (the padded arm's seconds per row
times the packed arm's sample count).
"""

from __future__ import annotations

import datetime
import getpass
import json
import os
import statistics
import tempfile
from pathlib import Path

from longmoe.bench import write_json_and_table
from longmoe.bench.train_path import _rows, _run

# The full-size run: one H200 rank's share of a 64-sample GRPO step (mean response 6K tokens,
# at most 32K with the prompt) in micro-batches of 32K tokens. "nproc": None runs the config's
# own train.nproc (after the --set overrides), which its parallel layout was written for.
FULL = {"config": "gpu_smoke", "samples": 64, "mean": 6144, "max_len": 32768, "budget": 32768,
        "prompt_len": 1024, "steps": 2, "padded_samples": 6, "ref_samples": 2,
        "row_multiple": 1024, "nproc": None, "extra": {}}
# The smoke run: one CPU rank (EP 1), whatever the config's layout.
SMOKE = {"config": "cpu_demo", "samples": 8, "mean": 24, "max_len": 96, "budget": 128,
         "prompt_len": 8, "steps": 2, "padded_samples": 4, "ref_samples": 2, "row_multiple": 1,
         "nproc": None, "extra": {"parallel.ep": 1, "train.nproc": 1, "data.group_size": 4}}


# --arms names -> arm names, in the order they run; the default runs the first three.
ARMS = {"full-rows": "full rows", "packed": "packed", "padded": "padded",
        "packed-static": "packed, static shapes",
        "packed-manifest": ("packed, empty caches", "packed, empty caches, kernel manifest")}
DEFAULT_ARMS = ("full-rows", "packed", "padded")
# Environment of an arm's training run, beside the --set overrides.
ARM_ENV = {"packed, static shapes": {"LONGMOE_COMPILE_SHAPES": "static"}}
# Arms with caches of their own, empty at their start, and train.kernel_manifest in the run's
# temporary directory: the first writes the manifest (its first step compiles everything), the
# second compiles it ahead (longmoe.ops.kernels.precompile).
FRESH_CACHES = ARMS["packed-manifest"]


def arms(samples: int, mean: int, max_len: int, budget: int, prompt_len: int,
         padded_samples: int, ref_samples: int, row_multiple: int) -> list[tuple[str, dict]]:
    """(name, --set overrides) of each arm."""
    from longmoe.errors import UserError
    if max_len <= prompt_len:
        raise UserError(f"--max-len: {max_len} leaves no response after --prompt-len {prompt_len}")
    if budget < max_len:
        raise UserError(f"--budget: {budget} is shorter than the longest sample (--max-len "
                        f"{max_len}); the padded and full-rows arms need a row of it")
    if not 1 <= mean < max_len - prompt_len:
        raise UserError(f"--mean: must be in [1, {max_len - prompt_len}) (the longest response)")
    for flag, v in (("--samples", samples), ("--padded-samples", padded_samples),
                    ("--ref-samples", ref_samples), ("--row-multiple", row_multiple)):
        if v < 1:
            raise UserError(f"{flag}: must be >= 1, got {v}")
    resp_max = max_len - prompt_len
    # data.num_samples = the batch: every step trains the same samples, so the packed rows'
    # shapes repeat and only the first step compiles.
    common = {"data.source": "synthetic", "data.prompt_len": prompt_len,
              "data.seq_len": max_len, "data.max_tokens_per_micro_batch": budget}
    lognormal = f"lognormal:{mean}:{resp_max}"
    packed = {**common, "data.batch_size": samples, "data.num_samples": samples,
              "data.packing": "true", "data.row_multiple": row_multiple,
              "data.response_len": lognormal}
    return [
        ("full rows", {**common, "data.batch_size": ref_samples, "data.num_samples": ref_samples,
                       "data.packing": "false", "data.max_tokens_per_micro_batch": max_len,
                       "data.response_len": f"fixed:{resp_max}"}),
        ("packed", packed),
        ("padded", {**common, "data.batch_size": padded_samples,
                    "data.num_samples": padded_samples, "data.packing": "false",
                    "data.response_len": lognormal}),
        ("packed, static shapes", packed),
        *((name, packed) for name in FRESH_CACHES),
    ]


def selected_arms(names: str | None) -> list[str]:
    """The arm names of a comma-separated --arms value (None: the default three), run order."""
    from longmoe.errors import UserError
    keys = DEFAULT_ARMS if names is None else [k.strip() for k in names.split(",") if k.strip()]
    bad = [k for k in keys if k not in ARMS]
    if bad or not keys:
        raise UserError(f"--arms: {', '.join(bad) or 'none given'}; choose from "
                        f"{', '.join(ARMS)}")
    out = []
    for k in ARMS:
        if k in keys:
            out += list(ARMS[k]) if isinstance(ARMS[k], tuple) else [ARMS[k]]
    return out


def _summary(rows: list[dict]) -> dict:
    timed = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in timed if r.get(k) is not None)  # noqa: E731
    first, steady = rows[0]["step_time_s"], med("step_time_s")
    return {"useful_tokens_per_s": med("tokens_per_s"), "step_time_s": steady,
            "first_step_s": first, "first_over_steady": first / steady if steady else None,
            "padding_share": med("padding_share"), "micro_batches": med("micro_batches"),
            "useful_tokens_per_step": med("useful_tokens"), "tokens_per_step": med("tokens"),
            "rank_cost_imbalance": med("rank_cost_imbalance"),
            "hw_tflops_per_gpu": med("hw_tflops_per_gpu"),
            "peak_mem_gib": max(r["peak_mem_bytes"] for r in rows) / 2**30,
            "steps_timed": len(timed),
            # Kernel variants compiled in the first step and the compiler's seconds (the step
            # log's CompileWatch fields; None where Triton gave no listener), and any compiled
            # later (a steady step should compile none).
            "first_step_kernel_compiles": rows[0].get("kernel_compiles"),
            "first_step_kernel_compile_s": rows[0].get("kernel_compile_s"),
            "later_kernel_compiles": (sum(r["kernel_compiles"] for r in rows[1:])
                                      if all("kernel_compiles" in r for r in rows) else None),
            # train.kernel_manifest: variants compiled ahead, the pool's seconds from the model
            # build on, and any wait for it after the first step (outside the step's time)
            "precompiled": rows[0].get("kernel_precompiled"),
            "precompile_s": rows[0].get("kernel_precompile_s"),
            "precompile_wait_after_s": rows[0].get("kernel_precompile_wait_after_s")}


def compile_caches() -> dict:
    """Triton's and inductor's on-disk caches as the arms will find them: each one's directory
    (its variable, else the library's default) and how many entries it holds now. A first step
    means "from cold" only where both are empty."""
    home = os.path.expanduser("~")
    dirs = {"triton": os.environ.get("TRITON_CACHE_DIR")
            or os.path.join(os.environ.get("TRITON_HOME") or home, ".triton", "cache"),
            "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")
            or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")}
    out = {}
    for name, d in dirs.items():
        try:
            entries = len(os.listdir(d))
        except OSError:  # not made yet: nothing cached
            entries = 0
        out[name] = {"dir": d, "entries_at_start": entries}
    return out


def config_nproc(config: str, extra: dict) -> int:
    """The ranks a run of `config` with the `--set` overrides `extra` starts: its train.nproc."""
    from longmoe.train.config import load_run_config
    return load_run_config(config, [f"{k}={v}" for k, v in extra.items()]).train.nproc


def run_bench(config: str, nproc: int | None, samples: int, mean: int, max_len: int, budget: int,
              prompt_len: int, steps: int, padded_samples: int, ref_samples: int,
              row_multiple: int, extra: dict, timeout: int, out: str | None = None,
              arm_names: list[str] | None = None) -> dict:
    from longmoe.backends import active_backend
    backend = active_backend()
    nproc = nproc if nproc is not None else config_nproc(config, extra)
    report = {"bench": "packing", "config": config, "nproc": nproc, "samples": samples,
              "response_len": f"lognormal:{mean}:{max_len - prompt_len}",
              "prompt_len": prompt_len, "max_len": max_len, "budget": budget,
              "row_multiple": row_multiple, "steps": steps, "extra": extra,
              "arms_run": arm_names or selected_arms(None),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": backend.probe().get("device_name") or backend.name,
              "versions": backend.versions(), "compile_caches": compile_caches(), "arms": []}
    with tempfile.TemporaryDirectory(prefix="longmoe-packing-") as tmp:
        for name, sets in arms(samples, mean, max_len, budget, prompt_len, padded_samples,
                               ref_samples, row_multiple):
            if name not in report["arms_run"]:
                continue
            slug = name.replace(' ', '_').replace(',', '')
            metrics = Path(tmp) / f"{slug}.jsonl"
            env = ARM_ENV.get(name)
            if name in FRESH_CACHES:
                env = {"TRITON_CACHE_DIR": str(Path(tmp) / slug / "triton"),
                       "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / slug / "inductor")}
                sets = {**sets, "train.kernel_manifest": str(Path(tmp) / "kernels.json")}
            res = _run(config, nproc, {**sets, **extra}, steps, metrics, timeout, env=env)
            row = {"arm": name, "samples": sets["data.batch_size"],
                   "budget": sets["data.max_tokens_per_micro_batch"], "status": res["status"],
                   "cmd": res["cmd"]}
            if name in FRESH_CACHES:  # its own caches, empty at its start
                row["caches"] = env
            if res["status"] == "ok":
                row.update(_summary(_rows(metrics)), first_loss=res["first_loss"],
                           last_loss=res["last_loss"], step_times_s=res["step_times_s"])
            else:
                row.update(error=res.get("error"), log_tail=res.get("log_tail"))
            report["arms"].append(row)
            if out:  # after every arm: a run cut short keeps what it measured
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(report, indent=1))
            said = (f"{row['useful_tokens_per_s']:,.0f} useful tok/s, padding "
                    f"{row['padding_share']:.1%}, peak {row['peak_mem_gib']:.1f} GiB, first "
                    f"step {row['first_step_s']:.1f} s, then {row['step_time_s']:.1f} s"
                    if res["status"] == "ok" else f"{res['status']}: {res.get('error', '')}")
            print(f"{name:<21} {said}", flush=True)
    report["ratios"] = ratios(report["arms"])
    return report


def ratios(rows: list[dict]) -> dict:
    by = {r["arm"]: r for r in rows if r["status"] == "ok"}
    ref = by.get("full rows")
    if not ref:
        return _static_ratios(by) | _manifest_ratios(by)
    out = {}
    for arm in ("packed", "padded"):
        if arm in by:
            out[f"{arm}_tokens_per_s_over_full_rows"] = (by[arm]["useful_tokens_per_s"]
                                                         / ref["useful_tokens_per_s"])
    if "packed" in by:
        out["packed_peak_over_full_rows"] = by["packed"]["peak_mem_gib"] / ref["peak_mem_gib"]
    if "packed" in by and "padded" in by:
        # The padded arm trains fewer samples (each row costs the same whatever its sample):
        # its seconds per row applied to the packed arm's batch give padded rows' rate there.
        pk, pd = by["packed"], by["padded"]
        per_row = pd["step_time_s"] / pd["micro_batches"]
        rate = pk["useful_tokens_per_step"] / (pk["samples"] * per_row)
        out["padded_tokens_per_s_at_packed_batch"] = rate
        out["padded_at_packed_batch_over_full_rows"] = rate / ref["useful_tokens_per_s"]
    return out | _static_ratios(by) | _manifest_ratios(by)


def _manifest_ratios(by: dict) -> dict:
    """From empty caches, the packed arm's first step with the kernel manifest against without."""
    cold, pre = (by.get(n) for n in FRESH_CACHES)
    if not cold or not pre:
        return {}
    return {"manifest_first_step_over_empty_caches": pre["first_step_s"] / cold["first_step_s"]}


def _static_ratios(by: dict) -> dict:
    """The packed arm against its static-shapes twin: first step and steady step."""
    if "packed" not in by or "packed, static shapes" not in by:
        return {}
    pk, st = by["packed"], by["packed, static shapes"]
    return {"packed_first_step_over_static_shapes": pk["first_step_s"] / st["first_step_s"],
            "packed_step_over_static_shapes": pk["step_time_s"] / st["step_time_s"]}


def markdown_table(report: dict) -> str:
    lines = [f"GRPO batch: {report['samples']} samples, prompt {report['prompt_len']} + response "
             f"{report['response_len']} tokens; micro-batches of {report['budget']:,} tokens "
             f"(rows to a multiple of {report['row_multiple']}); medians over steps after the "
             f"first of {report['steps']}; first step: the first step's seconds (it compiles) "
             f"and its ratio to the steady step.", "",
             "| arm | samples/step | useful tok/s | step s | first step s | first step: kernels "
             "compiled (compiler s) | padding | micro-batches | hw TFLOPS/GPU | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["arms"]:
        if r["status"] != "ok":
            lines.append(f"| {r['arm']} | {r['samples']} | {r['status']} | | | | | | | |")
            continue
        first = (f"{r['first_step_s']:.2f} ({r['first_over_steady']:.2f}x)"
                 if r.get("first_step_s") is not None else "not recorded")
        n, sec = r.get("first_step_kernel_compiles"), r.get("first_step_kernel_compile_s")
        comp = f"{n} ({sec:.2f})" if n is not None else "not recorded"
        if r.get("precompiled") is not None:
            if r.get("precompile_wait_after_s") is not None:
                comp += (f"; {r['precompiled']} precompiled in {r['precompile_s']:.1f} s, "
                         f"{r['precompile_wait_after_s']:.1f} s waited for after the step")
            else:  # reports from when the trainer waited for the pool before the first step
                comp += (f"; {r['precompiled']} precompiled, {r['precompile_wait_s']:.1f} s "
                         f"waited for before the step")
        lines.append(f"| {r['arm']} | {r['samples']} | {r['useful_tokens_per_s']:,.0f} | "
                     f"{r['step_time_s']:.2f} | {first} | {comp} | {r['padding_share']:.1%} | "
                     f"{r['micro_batches']:g} | {r['hw_tflops_per_gpu']:.1f} | "
                     f"{r['peak_mem_gib']:.2f} |")
    caches = report.get("compile_caches")
    if caches:  # absent from reports written before it was recorded
        lines += ["", "Compile caches at the start: " + "; ".join(
            f"{k} {v['dir']} ({v['entries_at_start']} entries)" for k, v in caches.items())
            + (" (both empty)"
               if all(v["entries_at_start"] == 0 for v in caches.values()) else "") + "."]
    rt = report.get("ratios") or {}
    if rt:
        lines += ["", "; ".join(f"{k.replace('_', ' ')}: {v:.3f}" for k, v in rt.items())]
    return "\n".join(lines)


def write_report(report: dict, out: str | None):
    write_json_and_table(report, out, markdown_table)
