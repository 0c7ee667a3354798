"""`longmoe doctor`: what this machine offers longmoe, read-only.

Reports the backend that would run, its devices, package versions, the collective environment
the adapter would apply, and what is missing. It starts no process group and changes no
environment, so it is safe to run on a login node or inside a busy job.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from longmoe.backends import active_backend, availability, get_backend
from longmoe.backends.base import PEER_PACKAGES
from longmoe.ops.gated_delta import gated_delta_choice


def collect() -> dict[str, Any]:
    """The doctor report as one JSON-ready dict."""
    backend_error = None
    try:
        backend = active_backend()
    except (ValueError, RuntimeError) as e:  # bad LONGMOE_BACKEND: report it, describe auto
        backend_error = str(e)
        backend = get_backend("auto")
    report = backend.describe()
    versions = report["versions"]
    missing = [f"package {p} is not installed" for p in backend.packages if versions.get(p) is None]
    missing += [f"probe: {err}" for err in report["probe"]["errors"]]
    from longmoe.backends.collective import TRANSPORT_NAMES
    from longmoe.tuning import cache as tuning_cache
    dev = backend.device(0)
    transports = {t: backend.collective.a2a_unavailable(t, dev) or "available"
                  for t in TRANSPORT_NAMES}
    caches = {}
    for d in tuning_cache.search_dirs():
        f = d / tuning_cache.FILE_NAME
        caches[str(f)] = f"{len(tuning_cache.load(f))} entries" if f.exists() else "absent"
    report.update(
        gated_delta=gated_delta_choice(dev),
        a2a_transports=transports,
        tuning_caches=caches,
        backend_error=backend_error,
        memory_label=backend.memory_label,
        backends={n: why or "available" for n, why in availability().items()},
        missing=missing,
        # optional: only the paired tests and benchmarks that compare against them need them
        peers={p: versions.get(p) for p in PEER_PACKAGES},
    )
    return report


def _fmt_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _print_rich(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    probe = report["probe"]
    summary = Table(title="longmoe doctor", show_header=False)
    summary.add_row("backend", report["backend"])
    if report["backend_error"]:
        summary.add_row("backend error", f"[red]{report['backend_error']}[/red]")
    summary.add_row("torch device type", report["device_type"])
    summary.add_row("process group backend", report["dist_backend"])
    summary.add_row("comm stream priority", str(report["comm_stream_priority"]))
    summary.add_row("all-to-all transport", f"{report['a2a_transport']} (auto)")
    for name, state in report["a2a_transports"].items():
        summary.add_row(f"  transport {name}", state)
    for path, state in report["tuning_caches"].items():
        summary.add_row("chunk tuning cache", f"{path}: {state}")
    summary.add_row("memory figure", report["memory_label"])
    gd = report["gated_delta"]
    summary.add_row("Gated DeltaNet core (auto)",
                    f"{gd['core']}; plan with `recipe --linear-core {gd['recipe_linear_core']}`")
    for name, why in gd["skipped"].items():
        summary.add_row(f"  not {name}", why)
    summary.add_row("  state scan", gd["state_scan"])
    for name, state in report["backends"].items():
        summary.add_row(f"backend {name}", state)
    console.print(summary)

    devices = Table(title="devices", show_header=False)
    for key in ("arch", "device_count", "sm_count", "warp_size"):
        devices.add_row(key, str(probe.get(key)))
    devices.add_row("memory", _fmt_bytes(probe.get("memory_bytes")))
    for key, value in probe.get("interconnect", {}).items():
        devices.add_row(f"interconnect.{key}", str(value))
    console.print(devices)

    versions = Table("package", "version", title="versions")
    for pkg, ver in report["versions"].items():
        peer = " (peer)" if pkg in report["peers"] else ""
        versions.add_row(pkg + peer, ver or "[dim]not installed[/dim]")
    console.print(versions)
    absent = [p for p, v in report["peers"].items() if v is None]
    if absent:
        console.print(f"optional peers not installed: {', '.join(absent)} (pip install "
                      "'longmoe[peers]'; only the paired tests and benchmarks against them "
                      "need them)", markup=False)

    env = Table("variable", "default", "now", title="collective environment")
    for key, default in report["collective_env"].items():
        now = os.environ.get(key)
        env.add_row(key, default, "would set" if now is None else f"user set: {now}")
    if not report["collective_env"]:
        env.add_row("(none)", "", "")
    console.print(env)

    if report["missing"]:
        console.print("[yellow]missing:[/yellow]")
        for line in report["missing"]:
            console.print(f"  - {line}", markup=False)
    else:
        console.print("[green]missing: nothing[/green]")


def run_doctor(as_json: bool = False) -> int:
    """Print the report (rich tables, or one JSON object). 0 unless LONGMOE_BACKEND names a backend
    that cannot run, which would fail every training launch the same way."""
    report = collect()
    if as_json:
        print(json.dumps(report, default=str))
    else:
        _print_rich(report)
    return 1 if report["backend_error"] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="longmoe doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return run_doctor(as_json=parser.parse_args(argv).json)


if __name__ == "__main__":
    raise SystemExit(main())
