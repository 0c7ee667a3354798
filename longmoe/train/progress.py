"""Live per-step progress, the JSONL metrics file, and the final summary table (rank 0 only)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


class Progress:
    def __init__(self, enabled: bool, total_steps: int, metrics_out: str | None, memory_label: str):
        self.enabled, self.total = enabled, total_steps
        self.console = Console(stderr=False, highlight=False, width=160)
        self.rows: list[dict] = []
        self.memory_label = memory_label
        self.t0 = time.perf_counter()
        self.out = None
        if enabled and metrics_out:
            Path(metrics_out).parent.mkdir(parents=True, exist_ok=True)
            self.out = open(metrics_out, "a")

    def info(self, msg: str):
        if self.enabled:
            self.console.print(msg)

    def step(self, m: dict):
        if not self.enabled:
            return
        self.rows.append(m)
        if self.out:
            self.out.write(json.dumps(m) + "\n")
            self.out.flush()
        self.console.print(
            f"step {m['step']:>4}/{self.total}  loss {m['loss']:+.5f}  aux {m['aux_loss']:.4f}  "
            f"gnorm {m['grad_norm']:.3f}  {m['tokens_per_s']:,.0f} tok/s  "
            f"peak {_gib(m['peak_mem_bytes'])}  {m['step_time_s']:.2f} s  "
            f"{m['hw_tflops_per_gpu']:.3g} hw TFLOPS/rank"
            + (f"  MFU {m['mfu']:.1%}" if m.get("mfu") else ""))

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
                     last_grad_norm=self.rows[-1]["grad_norm"])
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
        if self.out:
            self.out.close()
        return s
