"""Live per-step progress, the JSONL metrics file, and the final summary table (rank 0 only).

The metrics file is strict JSON, one object per step: non-finite numbers are written as null.
A run rewrites it from its first step on: rows of a run it resumed stay up to the step it resumed
from, later ones (trained again now) go, and a fresh run starts it empty.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


def strict(v):
    """`v` with every non-finite float replaced by None (JSON null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: strict(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [strict(x) for x in v]
    return v


def dumps(row: dict) -> str:
    return json.dumps(strict(row), allow_nan=False)


def _packing_note(m: dict) -> str:
    """Micro-batches, padding and the overlong policy's work, when there is any to report."""
    out = ""
    if m.get("micro_batches", 1) > 1 or m.get("padding_share"):
        out += (f"  {m['micro_batches']} mb, {m['useful_tokens']:,} useful tok, pad "
                f"{m['padding_share']:.1%}, imbalance {m.get('rank_cost_imbalance', 1.0):.3f}")
    if m.get("dropped_samples") or m.get("truncated_samples"):
        out += (f"  data.overlong: {m.get('dropped_samples', 0)} dropped, "
                f"{m.get('truncated_samples', 0)} truncated")
    return out


def _compile_note(m: dict) -> str:
    """Kernel variants the step compiled (a first step, or a new shape): where its time went."""
    n = m.get("kernel_compiles") or 0
    return f"  compiled {n} kernel(s) in {m['kernel_compile_s']:.1f} s" if n else ""


def _objective_note(m: dict) -> str:
    """The objective's terms beyond the plain surrogate, when the run's objective has them."""
    out = ""
    if "kl" in m:
        out += f"  kl {m['kl']:.4g}"
    if "tis_weight" in m:
        out += f"  tis {m['tis_weight']:.3f} (capped {m['tis_clip_frac']:.1%})"
    if "dual_clip_frac" in m:
        out += f"  dual-clip {m['dual_clip_frac']:.1%}"
    if out and "ratio" in m:
        out = f"  ratio {m['ratio']:.4f}" + out
    return out


def _skip_note(m: dict) -> str:
    if m.get("skipped") == "nonfinite":
        return (f"  SKIPPED: non-finite loss or gradient norm ({m.get('bad_steps', 1)} in a row), "
                f"no update")
    if m.get("skipped") == "no_tokens":
        return "  SKIPPED: no trained tokens, no update"
    return ""


class Progress:
    def __init__(self, enabled: bool, total_steps: int, metrics_out: str | None, memory_label: str):
        self.enabled, self.total = enabled, total_steps
        # A log (stdout a file or a pipe) gets every line whole: rich would otherwise fold lines
        # at the console's width, splitting a step line in two for whoever parses the log. A
        # terminal gets the same 160 columns as before (tables are laid out to that width).
        # No markup: the lines carry text such as a tuning-cache key in brackets, which rich
        # would take for a style tag and drop.
        tty = sys.stdout.isatty()
        self.console = Console(stderr=False, highlight=False, markup=False, width=160,
                               soft_wrap=not tty)
        self.rows: list[dict] = []
        self.memory_label = memory_label
        self.t0 = time.perf_counter()
        self.metrics_out = metrics_out if enabled else None
        self.out = None

    def info(self, msg: str):
        if self.enabled:
            self.console.print(msg)

    def _open(self, first_step: int):
        """Keep the file's rows up to step first_step - 1 (strict JSON), then append."""
        path = Path(self.metrics_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)  # lenient: an older file may hold bare NaN
                except ValueError:
                    continue  # a line a killed run left half-written
                if isinstance(row, dict) and isinstance(row.get("step"), int) and \
                        row["step"] < first_step:
                    kept.append(dumps(row) + "\n")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)
        self.out = open(path, "a")

    def step(self, m: dict):
        if not self.enabled:
            return
        self.rows.append(m)
        if self.metrics_out and self.out is None:
            self._open(m["step"])
        if self.out:
            self.out.write(dumps(m) + "\n")
            self.out.flush()
        masked = m.get("masked_samples") or 0
        self.console.print(
            f"step {m['step']:>4}/{self.total}  loss {m['loss']:+.5f}  aux {m['aux_loss']:.4f}  "
            f"gnorm {m['grad_norm']:.3f}  {m['tokens_per_s']:,.0f} tok/s  "
            f"peak {_gib(m['peak_mem_bytes'])}  {m['step_time_s']:.2f} s  "
            f"{m['hw_tflops_per_gpu']:.3g} hw TFLOPS/rank"
            + (f"  MFU {m['mfu']:.1%}" if m.get("mfu") else "")
            + (f"  {masked} sample(s) with no trained token" if masked else "")
            + _objective_note(m) + _packing_note(m) + _compile_note(m) + _skip_note(m))

    def close(self):
        if self.out:
            self.out.close()
            self.out = None

    def summary(self, extra: dict | None = None) -> dict:
        if not self.enabled:
            return {}
        wall = time.perf_counter() - self.t0
        s = {"steps": len(self.rows), "wall_s": round(wall, 2)}
        if self.rows:
            tps = [r["tokens_per_s"] for r in self.rows[1:]] or [self.rows[0]["tokens_per_s"]]
            hw = [r["hw_tflops_per_gpu"] for r in self.rows[1:]] or [self.rows[0]["hw_tflops_per_gpu"]]
            s.update(first_loss=self.rows[0]["loss"], last_loss=self.rows[-1]["loss"],
                     mean_tokens_per_s=sum(tps) / len(tps),
                     mean_hw_tflops_per_gpu=sum(hw) / len(hw),
                     peak_mem_bytes=max(r["peak_mem_bytes"] for r in self.rows),
                     last_grad_norm=self.rows[-1]["grad_norm"],
                     skipped_steps=sum(1 for r in self.rows if r.get("skipped")))
        s.update(extra or {})
        t = Table(title="longmoe train: summary")
        t.add_column("metric")
        t.add_column("value", justify="right")
        for k, v in s.items():
            if k == "peak_mem_bytes":
                k, v = f"peak memory ({self.memory_label})", _gib(v)
            elif isinstance(v, float):
                v = f"{v:,.5f}" if abs(v) < 100 else f"{v:,.1f}"
            t.add_row(k, str(v))
        self.console.print(t)
        self.close()
        return s
