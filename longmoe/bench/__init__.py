"""Benchmarks behind `longmoe bench`.

Every report carries where it came from: `date` (UTC), `commit` (the source tree's git revision,
or null), `device` (the backend probe's device name), `versions` (torch, triton and the peers a
comparison may import) and `command`. `write_json_and_table` fills whichever of these a bench did
not set and writes the JSON with its markdown table beside it (`FILE.md` next to `FILE.json`), so
`results/<device>/<bench>.json` and its table always travel together.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

# Packages a bench may compare against; their versions are recorded whether or not the run used
# them (None: not installed), so a result says which peer release it was measured against.
PEERS: dict[str, tuple[str, ...]] = {
    "liger-kernel": ("liger-kernel", "liger-kernel-nightly"),
    "cut-cross-entropy": ("cut-cross-entropy",),
    "megatron-core": ("megatron-core",),
    "flash-linear-attention": ("flash-linear-attention", "fla-core"),
}

PROVENANCE = ("date", "commit", "device", "versions")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def source_commit() -> str | None:
    """The git revision of the tree longmoe runs from; LONGMOE_COMMIT wins (a copy of the tree
    without .git, e.g. on a remote machine); None when neither says. A tree with uncommitted
    changes gets a "+dirty" suffix: the numbers then belong to no commit exactly."""
    if os.environ.get("LONGMOE_COMMIT"):
        return os.environ["LONGMOE_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + "+dirty" if dirty else rev) or None


def peer_version(dists: tuple[str, ...]) -> str | None:
    from importlib import metadata
    for dist in dists:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def all_versions(backend) -> dict[str, str | None]:
    out = dict(backend.versions())
    for name, dists in PEERS.items():
        if out.get(name) is None:
            out[name] = peer_version(dists)
    return out


def _command() -> str | None:
    """The command line that produced the report: a `longmoe` call or a script under bench/;
    None inside another program (a test calling the CLI in process)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    argv0 = Path(sys.argv[0])
    if argv0.name == "longmoe" or (spec is not None and spec.name == "longmoe.__main__"):
        return shlex.join(["longmoe", *sys.argv[1:]])
    if spec is None and argv0.suffix == ".py":
        return shlex.join(["python", str(argv0), *sys.argv[1:]])
    return None


def stamp(report: dict, backend=None) -> dict:
    """Fill date, commit, device, versions and command where the bench left them out. A probe
    dict in `device` (older reports) moves to `probe`, and `device` becomes its name."""
    if backend is None:
        from longmoe.backends import active_backend
        backend = active_backend()
    dev = report.get("device")
    if isinstance(dev, dict):
        report["probe"] = dev
        report["device"] = dev.get("device_name") or dev.get("name") or backend.name
    elif not dev:
        report["device"] = backend.probe().get("device_name") or backend.name
    report.setdefault("date", utc_now())
    if not report.get("commit"):
        report["commit"] = source_commit()
    versions = report.get("versions") or {}
    report["versions"] = {**all_versions(backend), **versions}
    if not report.get("command") and _command():
        report["command"] = _command()
    return report


def provenance_lines(report: dict) -> list[str]:
    """The header of a results table: each field as recorded, or said to be missing."""
    missing = "not recorded"
    dev = report.get("device")
    if isinstance(dev, dict):
        dev = dev.get("device_name") or dev.get("name")
    if dev and report.get("nproc"):
        dev = f"{dev} x {report['nproc']} rank(s)"
    versions = report.get("versions")
    ver = (", ".join(f"{k} {v}" for k, v in versions.items() if v) if versions else "") or missing
    name = report.get("bench") or report.get("benchmark") or "benchmark"
    lines = [f"# {name}", "",
             f"- date: {report.get('date') or missing}",
             f"- commit: {report.get('commit') or missing}",
             f"- device: {dev or missing}",
             f"- versions: {ver}"]
    if report.get("command"):
        lines.append(f"- command: `{report['command']}`")
    return lines


def markdown(report: dict, table) -> str:
    return "\n".join([*provenance_lines(report), "", table(report), ""])


def table_path(out: str | Path) -> Path:
    return Path(out).with_suffix(".md")


def write_json_and_table(report: dict, out: str | None, table, backend=None) -> None:
    """Stamp `report`, write it as JSON to `out` and its table to `out` with `.md` (when `out`
    is given), and print the table."""
    stamp(report, backend)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
        table_path(out).write_text(markdown(report, table))
    print(table(report))


def parse_configs(text: str | None) -> list[dict]:
    """--configs: a JSON list of kernel tile overrides; none means the shipped config only."""
    if not text:
        return [{}]
    cfgs = json.loads(text)
    if not isinstance(cfgs, list) or not all(isinstance(c, dict) for c in cfgs):
        raise ValueError("must be a JSON list of objects")
    return cfgs


def median_ms(backend, fn, iters: int, warmup: int = 2) -> float:
    """Median device time of fn() over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    backend.synchronize()
    times = []
    for _ in range(iters):
        with backend.timer() as t:
            fn()
        times.append(t.elapsed_ms)
    return statistics.median(times)
