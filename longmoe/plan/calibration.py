"""Published and measured peaks the estimator is checked against (docs/recipes.md, tests): the
points are data, calibration.json (each with its source and what the source leaves out); this
module turns them into estimator inputs and compares.

Seed points are from the talk on Qwen3.5-35B-A3B RL at 128K on 32 x H100 80GB, in decimal GB as
its slides count them. `within_10` records whether the docs claim the estimate within 10% for
that point, so a change to the estimator that moves a point across the line fails a test and the
docs get updated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from longmoe.config import get_preset
from longmoe.plan.memory import (GiB, Assumptions, Layout, Workload, estimate, estimate_stage,
                                 moe_layer_bytes)

S128K = 131072


@dataclass(frozen=True)
class Point:
    name: str
    source: str
    measured_bytes: float
    layout: Layout | None = None
    workload: Workload | None = None
    num_layers: int = 0             # 0: the preset's
    num_experts: int = 0            # 0: the preset's (one EP rank's share: a cut run on 1 GPU)
    stage: str = ""                 # compare one pipeline stage ("" = the estimator's max)
    moe_layer: tuple = ()           # (tokens, chunks, ep): the single-MoE-layer experiment
    assumptions: Assumptions = field(default_factory=Assumptions)
    within_10: bool = True
    note: str = ""


GB = 1e9
_FILE = Path(__file__).with_name("calibration.json")
UNITS = {"GB": GB, "GiB": GiB}


def _point(d: dict) -> Point:
    where = f"{_FILE.name}: point {d.get('name')!r}"
    try:
        return Point(name=d["name"], source=d["source"],
                     measured_bytes=d["measured"] * UNITS[d["unit"]],
                     layout=Layout(**d["layout"]) if "layout" in d else None,
                     workload=Workload(**d["workload"]) if "workload" in d else None,
                     num_layers=d.get("num_layers", 0), num_experts=d.get("num_experts", 0),
                     stage=d.get("stage", ""),
                     moe_layer=tuple(d["moe_layer"][k] for k in ("tokens", "chunks", "ep"))
                     if "moe_layer" in d else (),
                     assumptions=Assumptions(**d.get("assumptions", {})),
                     within_10=d["within_10"], note=d.get("note", ""))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: {type(e).__name__}: {e}") from None


def load_points(path: Path = _FILE) -> list[Point]:
    return [_point(d) for d in json.loads(Path(path).read_text())["points"]]


POINTS = load_points()
MODEL = json.loads(_FILE.read_text())["model"]


def point(name: str) -> Point:
    return next(p for p in POINTS if p.name == name)


@dataclass(frozen=True)
class Row:
    point: Point
    estimate_bytes: int
    phase: str

    @property
    def error(self) -> float:
        return self.estimate_bytes / self.point.measured_bytes - 1


def evaluate(p: Point) -> Row:
    cfg = get_preset(MODEL)
    if p.num_layers:
        cfg = cfg.replace(num_layers=p.num_layers)
    if p.num_experts:
        cfg = cfg.replace(num_experts=p.num_experts)
    if p.moe_layer:
        tokens, chunks, ep = p.moe_layer
        return Row(p, moe_layer_bytes(cfg, tokens, chunks, ep, p.assumptions), "MoE layer")
    m = (estimate_stage(cfg, p.layout, p.workload, p.assumptions, p.stage) if p.stage
         else estimate(cfg, p.layout, p.workload, p.assumptions))
    return Row(p, m.peak, f"{m.stage} stage, {m.phase}")


def markdown_table() -> str:
    out = ["| point | layout | published / measured | estimate | error | note |",
           "|---|---|---|---|---|---|"]
    for p in POINTS:
        r = evaluate(p)
        lay = p.layout.label if p.layout else f"EP{p.moe_layer[2]}, {p.moe_layer[1]} chunk(s)"
        meas = (f"{p.measured_bytes / GB:.2f} GB ({p.measured_bytes / GiB:.1f} GiB)"
                if "GiB" not in p.source else f"{p.measured_bytes / GiB:.0f} GiB")
        out.append(f"| {p.name} | {lay} | {meas} | {r.estimate_bytes / GiB:.1f} GiB "
                   f"({r.phase}) | {r.error:+.0%} | {p.note} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown_table())
