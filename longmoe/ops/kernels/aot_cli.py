"""`longmoe kernels compile`: every shipped kernel config (or flash-linear-attention's Gated
DeltaNet kernels, --fla) compiled for each GPU target, with progress per target on stderr and
one summary line at the end; the per-config table with --verbose, or all of it as --json."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict

from longmoe.console import Progress, note
from longmoe.errors import UserError
from longmoe.ops.kernels.aot import CompileReport, compile_all, compile_targets


def outcome(r: CompileReport) -> str:
    """ok | spills (compiled, but registers spill) | failed (did not compile, or over the
    target's register or shared-memory/LDS budget)."""
    if r.ok:
        return "ok"
    return "spills" if r.regs is not None and r.spills else "failed"


def summary_line(reports: list[CompileReport], targets: list[str]) -> str:
    c = Counter(outcome(r) for r in reports)
    n_t = len(targets)
    return (f"{len(reports)} configs compiled for {n_t} target{'s' if n_t != 1 else ''}: "
            f"{c['ok']} ok, {c['spills']} spills, {c['failed']} failed")


def _compile_target(target: str, fla: bool, only: str | None) -> list[CompileReport]:
    bar = Progress(target, 0)

    def progress(done, total, rep):
        bar.total = total
        bar.update(done, rep.variant)
    if fla:
        from longmoe.ops.kernels.aot_fla import compile_fla
        reports = compile_fla(target, progress=progress)
    else:
        reports = compile_all(target, only=only, progress=progress)
    c = Counter(outcome(r) for r in reports)
    bar.finish(f"{len(reports)} configs: {c['ok']} ok, {c['spills']} spills, {c['failed']} failed")
    return reports


def _table(reports: list[CompileReport]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    table = Table(title="longmoe kernels compile")
    for col in ("target", "kernel", "config", "regs/VGPRs", "shared/LDS", "spills", "ok"):
        table.add_column(col)
    for r in reports:
        cfg = ", ".join(f"{k}={v}" for k, v in r.config.items())
        table.add_row(r.target, escape(r.variant), cfg, str(r.regs), str(r.shared), str(r.spills),
                      "yes" if r.ok else f"NO {r.error}")
    Console(width=160).print(table)


def run_kernels_cli(target: str, as_json: bool = False, fla: bool = False, verbose: bool = False,
                    only: str | None = None) -> int:
    """0 when every config compiled within budget (with --fla: when every one compiled, since
    fla's autotuner chooses among them at run time and a spilling one is a finding only)."""
    known = list(compile_targets())
    if target != "all" and target not in known:
        raise UserError(f"--target: unknown {target!r}; valid: all, {', '.join(known)}")
    if fla and only:
        raise UserError("--only: selects longmoe's own kernels; --fla compiles all of fla's")
    if fla:
        import importlib.util
        if importlib.util.find_spec("fla") is None:
            raise UserError("--fla: flash-linear-attention is not installed")
    targets = known if target == "all" else [target]
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    reports = [r for t in targets for r in _compile_target(t, fla, only)]
    if not reports:
        raise UserError(f"--only: no kernel variant starts with {only!r}" if only else
                        "no kernel configs found for " + ", ".join(targets))
    failed = [r for r in reports if r.regs is None] if fla else \
        [r for r in reports if not r.ok]
    summary = summary_line(reports, targets)
    if as_json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
        note(summary)
        return 0 if not failed else 1
    if verbose:
        _table(reports)
    else:
        for r in reports:
            if not r.ok:
                print(f"{outcome(r)}: {r.target} {r.variant} "
                      f"[{', '.join(f'{k}={v}' for k, v in r.config.items())}]: {r.error}")
    print(summary)
    return 0 if not failed else 1
