"""`longmoe paired PRIMITIVE`: the Skill -> Change -> Paired test -> Compose loop's middle step.
Runs the candidate and the reference on the same fresh inputs and reports the largest relative
differences of loss/outputs and gradients, peak memory and time; exits 1 when out of tolerance."""

from __future__ import annotations

import json
import random

from rich.console import Console
from rich.table import Table

from longmoe.console import note
from longmoe.errors import UserError

# primitive -> what is compared (the `longmoe paired --help` list)
PRIMITIVES = {
    "linear_ce": "linear cross-entropy: log-probs, entropy, CE loss and their gradients",
    "policy_loss": "the policy objective fused into the LM head (clip, dual clip, KL, TIS, "
                   "entropy, per-sample mean on packed rows), with its gradients",
    "grouped_mm": "the experts' grouped GEMM, output and gradients",
    "moe_rows": "the MoE layer's row ops: combine, dispatch gradient, SwiGLU",
    "router_matmul": "the router's logits GEMMs (bf16 in, fp32 out) and their gradients",
    "gated_delta": "the Gated DeltaNet core: output, final state, every gradient",
    "moe_megatron": "longmoe's MoE layer against megatron-core's MoE utilities (peers extra)",
    "recompute": "activation recompute against stored activations: loss and gradients",
    "ep": "expert parallelism on --nproc gloo ranks against one process",
    "fsdp": "an FSDP2 training step on --nproc ranks against one rank",
    "step": "a training step with EP, FSDP2, EP chunks and recompute against one rank",
}
DISTRIBUTED = ("ep", "fsdp", "step")


def primitives_help() -> str:
    width = max(map(len, PRIMITIVES))
    return "primitives:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in PRIMITIVES.items())


def run_paired(primitive: str, impl: str = "auto", nproc: int = 2, seed: int | None = None):
    from longmoe.paired import cases, dist_cases
    from longmoe.ops import ImplUnavailable
    seed = random.randrange(2**31) if seed is None else seed
    if primitive not in PRIMITIVES:
        raise UserError(f"primitive: unknown {primitive!r}; valid: {', '.join(PRIMITIVES)}")
    if primitive in DISTRIBUTED and nproc < 2:
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
                                        linear_ce="reference")
        return dist_cases.step_case(nproc, seed, ep=nproc if 8 % nproc == 0 else 1)
    except ImplUnavailable as e:
        raise UserError(f"--impl: {e}") from None


def summary_line(res) -> str:
    head = f"paired {res.primitive}: {res.candidate} vs {res.reference}, "
    if res.nothing_compared:
        return head + f"FAIL: {res.nothing_compared}"
    bad = sum(1 for v in res.errors.values() if not v <= res.tolerance)
    return head + (f"{len(res.errors)} quantities, max relative error {res.max_error:.2e} "
                   f"(tolerance {res.tolerance:.0e}): "
                   + ("PASS" if res.ok else f"FAIL ({bad} out of tolerance)"))


def run_paired_cli(primitive: str, impl: str = "auto", nproc: int = 2, as_json: bool = False,
                   seed: int | None = None) -> int:
    if primitive not in PRIMITIVES:
        raise UserError(f"primitive: unknown {primitive!r}; valid: {', '.join(PRIMITIVES)}")
    seed = random.randrange(2**31) if seed is None else seed
    ranks = f"{nproc} ranks, " if primitive in DISTRIBUTED else ""
    note(f"paired {primitive}: impl {impl}, {ranks}seed {seed} (--seed {seed} reruns it)")
    res = run_paired(primitive, impl, nproc, seed)
    if as_json:
        print(json.dumps(res.to_dict(), indent=1))
        note(summary_line(res))
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
    print(summary_line(res))
    return 0 if res.ok else 1
