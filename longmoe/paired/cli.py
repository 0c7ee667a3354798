"""`longmoe paired PRIMITIVE`: the Skill -> Change -> Paired test -> Compose loop's middle step.
Runs the candidate and the reference on the same fresh inputs and reports the largest relative
differences of loss/outputs and gradients, peak memory and time; exits 1 when out of tolerance."""

from __future__ import annotations

import json
import random

from rich.console import Console
from rich.table import Table

from longmoe.errors import UserError

PRIMITIVES = ("linear_ce", "policy_loss", "grouped_mm", "moe_rows", "router_matmul", "gated_delta",
              "moe_megatron",
              "recompute",
              "ep", "fsdp", "step")


def run_paired(primitive: str, impl: str = "auto", nproc: int = 2, seed: int | None = None):
    from longmoe.paired import cases, dist_cases
    from longmoe.ops import ImplUnavailable
    seed = random.randrange(2**31) if seed is None else seed
    if primitive not in PRIMITIVES:
        raise UserError(f"primitive: unknown {primitive!r}; valid: {', '.join(PRIMITIVES)}")
    if primitive in ("ep", "fsdp", "step") and nproc < 2:
        raise UserError(f"--nproc: {primitive} needs at least 2 ranks, got {nproc}")
    if primitive == "ep" and 8 % nproc:
        raise UserError(f"--nproc: {nproc} does not divide the tiny preset's 8 experts")
    try:
        if primitive == "linear_ce":
            return cases.linear_ce_case(impl, seed)
        if primitive == "policy_loss":
            return cases.policy_loss_case(impl, seed)
        if primitive == "grouped_mm":
            return cases.grouped_mm_case(impl, seed)
        if primitive == "moe_rows":
            return cases.moe_rows_case(impl, seed)
        if primitive == "router_matmul":
            return cases.router_matmul_case(impl, seed)
        if primitive == "moe_megatron":
            return cases.megatron_moe_case(seed)
        if primitive == "gated_delta":
            return cases.gated_delta_case(impl, seed)
        if primitive == "recompute":
            return cases.recompute_case(impl, seed)
        if primitive == "ep":
            return dist_cases.ep_case(nproc, seed)
        if primitive == "fsdp":
            return dist_cases.step_case(nproc, seed, ep=1, chunks=1, recompute="none",
                                        linear_ce="naive")
        return dist_cases.step_case(nproc, seed, ep=nproc if 8 % nproc == 0 else 1)
    except ImplUnavailable as e:
        raise UserError(f"--impl: {e}") from None


def run_paired_cli(primitive: str, impl: str = "auto", nproc: int = 2, as_json: bool = False,
                   seed: int | None = None) -> int:
    res = run_paired(primitive, impl, nproc, seed)
    if as_json:
        print(json.dumps(res.to_dict(), indent=1))
        return 0 if res.ok else 1
    con = Console(width=120)
    t = Table(title=f"paired {res.primitive}: {res.candidate} vs {res.reference}")
    t.add_column("quantity")
    t.add_column("relative error", justify="right")
    t.add_column("ok", justify="center")
    for k, v in res.errors.items():
        t.add_row(k, f"{v:.2e}", "yes" if v <= res.tolerance else "NO")
    con.print(t)
    for what, d in (("peak memory (bytes)", res.peak_bytes), ("median time (ms)", res.time_ms)):
        if d:
            con.print(f"{what}: " + ", ".join(f"{k} {v:,.1f}" if isinstance(v, float) else
                                              f"{k} {v:,}" for k, v in d.items()))
    con.print(f"inputs: {res.info}")
    con.print(f"max relative error {res.max_error:.2e} (tolerance {res.tolerance:.0e}): "
              + ("PASS" if res.ok else "FAIL"))
    return 0 if res.ok else 1
