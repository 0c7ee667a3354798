"""`longmoe checkpoint verify DIR`: check checkpoints against their manifests without loading them.

DIR is a checkpoint directory (the step `latest` names is checked, or every published step with
--all) or one step directory. Per step: the manifest parses, every file it lists is there with its
size and sha256, nothing unlisted is there, meta.json parses, and DCP's `.metadata` parses with the
unpickler that resolves only DCP's own classes. Nothing is loaded into a model and nothing from the
checkpoint can run. Exit 0 when every checked step is whole, 1 otherwise (each damaged one named
on stderr in one line), 2 when DIR holds no checkpoint to check.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from longmoe.checkpoint.directory import (POINTER, is_step_dir_name, named_step, published_steps,
                                         step_name)
from longmoe.checkpoint.manifest import MANIFEST, read_meta, verify_step
from longmoe.errors import UserError


def check_step(step_dir: Path) -> dict:
    """One step directory's verdict: {"path", "ok", "error", "step", "files", "bytes",
    "identity"}."""
    from longmoe.checkpoint.safe import read_dcp_metadata  # torch: only when checking
    out = {"path": str(step_dir), "ok": False, "error": None, "step": None, "files": 0,
           "bytes": 0, "identity": None}
    try:
        m = verify_step(step_dir, full=True)
        read_meta(step_dir, m)
        read_dcp_metadata(step_dir, m)
    except UserError as e:
        out["error"] = str(e)
        return out
    except OSError as e:
        out["error"] = f"checkpoint {step_dir}: unreadable ({e})"
        return out
    out.update(ok=True, step=m["step"], files=len(m["files"]), identity=m["identity"],
               bytes=sum(f["size"] for f in m["files"].values()))
    return out


def verify(target: str | Path, all_steps: bool = False) -> dict:
    """The report for `target` (see the module docstring); UserError if there is nothing to
    check."""
    root = Path(target)
    if not root.is_dir():
        raise UserError(f"checkpoint verify: {root} is not a directory")
    if (root / MANIFEST).exists() or is_step_dir_name(root.name):
        return {"dir": str(root.parent), "latest": None, "checkpoints": [check_step(root)]}
    report = {"dir": str(root), "latest": None, "checkpoints": []}
    try:
        named = named_step(root)
        report["latest"] = named.name if named else None
    except UserError as e:
        if not all_steps:
            raise
        report["checkpoints"].append({"path": str(root / POINTER), "ok": False,
                                      "error": str(e), "step": None})
        named = None
    if all_steps:
        dirs = [root / step_name(s) for s in published_steps(root)]
    else:
        dirs = [named] if named else []
    if not dirs and not report["checkpoints"]:
        raise UserError(f"checkpoint verify: no checkpoint in {root} (no {POINTER} pointer"
                        f"{'' if all_steps else '; --all checks every step directory'})")
    report["checkpoints"] += [check_step(d) for d in dirs]
    return report


def _describe(c: dict) -> str:
    i = c["identity"]
    return (f"{c['files']} files, {c['bytes'] / 2**20:.1f} MiB; step {c['step']}, global batch "
            f"{i['global_batch']}, world {i['world']}, ep {i['ep']}, cp {i['cp']}")


def run_verify_cli(target: str, all_steps: bool, as_json: bool) -> int:
    report = verify(target, all_steps)
    checks = report["checkpoints"]
    good = sum(c["ok"] for c in checks)
    report["ok"] = good == len(checks)
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        for c in checks:
            print(f"{'ok' if c['ok'] else 'DAMAGED':8} {c['path']}"
                  + (f"  ({_describe(c)})" if c["ok"] else ""))
        latest = f"; latest names {report['latest']}" if report["latest"] else ""
        print(f"verify: {good} of {len(checks)} checkpoint(s) good{latest}")
    for c in checks:
        if not c["ok"]:
            print(f"error: {c['error']}", file=sys.stderr)
    return 0 if report["ok"] else 1


def add_parser(subparsers) -> argparse.ArgumentParser:
    c = subparsers.add_parser("checkpoint", help="check checkpoints without loading them")
    csub = c.add_subparsers(dest="ccmd", required=True)
    v = csub.add_parser("verify", help="sizes and sha256 of every file against its manifest")
    v.add_argument("dir", help="a --checkpoint-dir (checks what `latest` names) or a step dir")
    v.add_argument("--all", action="store_true", help="check every published step directory")
    v.add_argument("--json", action="store_true")
    v.set_defaults(fn=lambda a: run_verify_cli(a.dir, a.all, a.json))
    return c
