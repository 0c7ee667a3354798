"""`longmoe bench train-path`: the optimisation path, stage by stage, as training runs.

Stages (each adds one mechanism to the previous one), per tokens-per-GPU value:
  baseline     selective recompute, naive cross-entropy (full logits), FSDP off, no EP chunks
  +linear CE   linear cross-entropy (logits never materialised)
  +FSDP2       parameters, gradients and optimizer state sharded
  +chunked EP  full recompute and chunked expert parallelism (chunks: auto)

Each stage is one `longmoe train` subprocess (a fresh process, so one stage's allocator state or
OOM cannot leak into the next) with its metrics file; the report keeps, per stage, the median
over steps after the first of hardware/model TFLOPS per GPU and MFU, the max peak memory, the
last loss, or "oom"/"failed" with the error's last line.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from longmoe.bench import write_json_and_table
from longmoe.child import child_env, longmoe_command

STAGES = [
    ("baseline", {"parallel.recompute": "selective", "impl.linear_ce": "reference",
                  "impl.policy_loss": "unfused", "parallel.fsdp": "false", "parallel.chunks": 1}),
    ("+linear CE", {"impl.linear_ce": "auto", "impl.policy_loss": "auto"}),
    ("+FSDP2", {"parallel.fsdp": "true"}),
    ("+chunked EP", {"parallel.recompute": "full", "parallel.chunks": "auto"}),
]


def _run(config: str, nproc: int, overrides: dict, steps: int, metrics: Path, timeout: int,
         profile: str | None = None, env: dict[str, str] | None = None):
    """One `longmoe train` subprocess; `env`: variables set for it on top of this process's."""
    cmd = longmoe_command("train", "--config", config, "--nproc", str(nproc),
                          "--steps", str(steps), "--metrics-out", str(metrics))
    if profile:
        cmd += ["--profile", profile]
    for k, v in overrides.items():
        cmd += ["--set", f"{k}={v}"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=child_env({**os.environ, **(env or {})}))
    except subprocess.TimeoutExpired as e:  # keep what the run printed and the steps it finished
        rows = _rows(metrics)
        return {"status": "timeout", "cmd": " ".join(cmd[2:]), "steps_done": len(rows),
                "step_time_s": [r.get("step_time_s") for r in rows],
                "log_tail": _tail(e.stdout) + _tail(e.stderr)}
    rows = _rows(metrics)
    out = {"cmd": " ".join(cmd[2:]), "returncode": p.returncode}
    if p.returncode != 0 or not rows:
        err = (p.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        oom = "out of memory" in p.stderr.lower()
        if oom and "Tried to allocate" in p.stderr:  # the size, not the allocator's advice
            at = p.stderr.index("Tried to allocate")
            err = p.stderr[at:].split(". ")[0] + "."
        out.update(status="oom" if oom else "failed", error=err[:300], log_tail=_tail(p.stderr))
        return out
    timed = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in timed if r.get(k) is not None)  # noqa: E731
    out.update(status="ok", steps=len(rows), hw_tflops_per_gpu=med("hw_tflops_per_gpu"),
               model_tflops_per_gpu=med("model_tflops_per_gpu"),
               mfu=med("mfu") if any(r.get("mfu") for r in timed) else None,
               tokens_per_s=med("tokens_per_s"), step_time_s=med("step_time_s"),
               peak_mem_gib=max(r["peak_mem_bytes"] for r in rows) / 2**30,
               first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"],
               step_times_s=[r.get("step_time_s") for r in rows], log_tail=_tail(p.stdout, 4))
    out.update(_setup(p.stdout))
    return out


def _setup(stdout: str) -> dict:
    """What the trainer chose at start-up (chunk count and all-to-all transport) from its log;
    the console may wrap lines, so match on the text with newlines flattened."""
    flat = " ".join((stdout or "").split())
    m = re.search(r"chunked EP: chunks=(\d+) \((.+?)\), all-to-all (\w+) \((.+?)\), overlap", flat)
    return {"ep_chunks": int(m.group(1)), "ep_chunks_source": m.group(2),
            "a2a_transport": m.group(3), "a2a_transport_source": m.group(4)} if m else {}


def _parallel(config: str, overrides: dict):
    from longmoe.train.config import load_run_config
    return load_run_config(config, [f"{k}={v}" for k, v in overrides.items()]).parallel


def _ep(config: str, overrides: dict) -> int:
    return _parallel(config, overrides).ep


def stage_note(config: str, stage: str, overrides: dict) -> str | None:
    """The chunked-EP stage on one EP rank has no all-to-all to chunk: say what it changes."""
    if stage == "+chunked EP" and _ep(config, overrides) == 1:
        rc = overrides.get("parallel.recompute", "full")
        return f"EP=1: no all-to-all, so this stage adds recompute={rc} only"
    return None


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _tail(text, n: int = 8) -> list[str]:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "").strip().splitlines()[-n:]


def run_path(config: str, nproc: int, tokens: list[int], steps: int, extra: dict,
             stages: list[str] | None = None, timeout: int = 1800, out: str | None = None,
             profile: str | None = None) -> dict:
    from longmoe.backends import active_backend
    backend = active_backend()
    names = [s for s, _ in STAGES]
    for s in stages or []:
        if s not in names:
            from longmoe.errors import UserError
            raise UserError(f"--stages: unknown stage {s!r}; valid: {', '.join(names)}")
    report = {"bench": "train-path", "config": config, "nproc": nproc,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "device": backend.probe().get("device_name") or backend.name,
              "versions": backend.versions(), "extra": extra, "runs": []}
    with tempfile.TemporaryDirectory(prefix="longmoe-path-") as tmp:
        for T in tokens:
            # one sequence per data rank (data.batch_size is global: ranks / cp of them)
            acc: dict = {"data.seq_len": T}
            acc["data.batch_size"] = nproc // _parallel(config, {**acc, **extra}).cp
            for name, change in STAGES:
                acc = {**acc, **change}
                if stages and name not in stages:
                    continue
                tag = f"{name.strip('+').replace(' ', '_')}-{T}"
                # --set wins over the stage's own settings (e.g. a per-layer recompute list)
                res = _run(config, nproc, {**acc, **extra}, steps, Path(tmp) / f"{tag}.jsonl",
                           timeout,
                           str(Path(profile) / tag) if profile else None)
                # one sequence of T tokens; context parallelism splits it over its ranks
                row = {"stage": name, "seq_len": T,
                       "tokens_per_gpu": T // _parallel(config, {**acc, **extra}).cp, **res}
                note = stage_note(config, name, {**acc, **extra})
                if note:
                    row["note"] = note
                report["runs"].append(row)
                if out:  # after every run: a sweep cut short keeps what it measured
                    Path(out).parent.mkdir(parents=True, exist_ok=True)
                    Path(out).write_text(json.dumps(report, indent=1))
                print(f"T={T:>6} {name:<12} " + (
                    f"{res['hw_tflops_per_gpu']:.1f} hw TFLOPS/GPU, peak {res['peak_mem_gib']:.1f}"
                    f" GiB, loss {res['last_loss']:+.4f}" if res["status"] == "ok"
                    else f"{res['status']}: {res.get('error', '')}"), flush=True)
    return report


def markdown_table(report: dict) -> str:
    lines = ["| tokens/GPU | stage | hw TFLOPS/GPU | model TFLOPS/GPU | MFU | step s | peak GiB |"
             " last loss |", "|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        if r["status"] == "ok":
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "n/a"
            step = f"{r['step_time_s']:.3f}" if r.get("step_time_s") else ""
            stage = r["stage"] + (f" ({r['note'].split(',')[0]})" if r.get("note") else "")
            lines.append(f"| {r['tokens_per_gpu']} | {stage} | {r['hw_tflops_per_gpu']:.1f} | "
                         f"{r['model_tflops_per_gpu']:.1f} | {mfu} | {step} | "
                         f"{r['peak_mem_gib']:.1f} | {r['last_loss']:+.4f} |")
        else:
            lines.append(f"| {r['tokens_per_gpu']} | {r['stage']} | {r['status']} | | | | | |")
    return "\n".join(lines)


def write_report(report: dict, out: str | None):
    write_json_and_table(report, out, markdown_table)
