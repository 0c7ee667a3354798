#!/usr/bin/env python
"""Build the wheel and use it as someone who installs the package would, away from the checkout.

    python ci/check_wheel.py [--deps host|install] [--keep DIR]

1. build     `pip wheel --no-deps` from a copy of the source tree (tracked and untracked files
             that git does not ignore), so a stale build/ folder cannot add files to it.
2. contents  the wheel holds every file of the mapped source folders (pyproject.toml's
             package-dir: every module and data file) under its installed name, and nothing else
             besides its .dist-info: no top-level tests/ or bench/.
3. install   a new virtual environment without the system site-packages; the wheel installed
             into it as a file (never editable). Its dependencies:
               host     (default) the running interpreter's site-packages folders go on the
                        environment's path through a plain .pth line: their packages import,
                        their own .pth hooks (an editable longmoe's import finder among them) do
                        not run. Every requirement of the wheel is checked to be met there.
               install  pip installs torch==2.13.0 (the CPU build CI tests against), then the
                        wheel with its requirements and the examples' transformers.
4. imports   from a folder outside the checkout: every module of the installed package
             (listed with pkgutil) is imported, each from the environment, and the list equals
             the source tree's; a module that needs an optional extra that is not installed is
             named and left out.
5. demo      `longmoe train --config cpu_demo --steps 2` (two gloo ranks) with the installed
             console script.
6. api       every code block of docs/api.md marked `<!-- run -->`.

Each step prints its wall time and the CPU seconds its processes used.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_TORCH = "2.13.0"  # ci/run.sh's CPU_TORCH


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Steps:
    """Prints each step's wall and CPU time; the failure names the step."""

    def __init__(self):
        self.times: dict[str, tuple[float, float]] = {}

    def run(self, name: str, fn, *args):
        print(f"--> wheel check: {name}", flush=True)
        t0, c0 = time.monotonic(), _cpu_s()
        try:
            return fn(*args)
        except Exception as e:
            print(f"<-- wheel check: {name} FAILED: {e}", file=sys.stderr, flush=True)
            raise SystemExit(1)
        finally:
            wall, cpu = time.monotonic() - t0, _cpu_s() - c0
            self.times[name] = (wall, cpu)
            print(f"<-- wheel check: {name}: {wall:.1f} s wall, {cpu:.1f} s CPU", flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        tail = (p.stdout + p.stderr).strip().splitlines()[-25:]
        shown = " ".join(str(c) if len(str(c)) < 200 else "<script>" for c in cmd)
        raise RuntimeError(f"{shown} exited {p.returncode}:\n" + "\n".join(tail))
    return p


# ---- what the source tree says the wheel must hold ---------------------------------------------

def package_dirs(root: Path = ROOT) -> dict[str, str]:
    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def source_files(root: Path = ROOT) -> list[str]:
    """Files the source tree would ship, relative to the root (git's view where there is one)."""
    p = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                       capture_output=True, text=True)
    if p.returncode == 0:
        files = [f for f in p.stdout.split("\0") if f]
    else:
        files = [str(f.relative_to(root)) for f in root.rglob("*") if f.is_file()]
    return sorted(f for f in files if "__pycache__" not in f and not f.endswith(".pyc")
                  and (root / f).is_file())


def expected_wheel_files(files: list[str], dirs: dict[str, str]) -> set[str]:
    """Installed paths of the files under the mapped folders (the longest mapping wins)."""
    out = set()
    for f in files:
        best = max((folder for folder in dirs.values() if f == folder or
                    f.startswith(folder.rstrip("/") + "/")), key=len, default=None)
        if best is None:
            continue
        package = next(name for name, folder in dirs.items() if folder == best)
        out.add("/".join([*package.split("."), f[len(best):].lstrip("/")]))
    return out


def source_modules(files: list[str], dirs: dict[str, str]) -> set[str]:
    mods = set()
    for path in expected_wheel_files([f for f in files if f.endswith(".py")], dirs):
        parts = path[:-3].split("/")
        mods.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return mods


def check_contents(wheel: Path, expected: set[str]):
    names = {n for n in zipfile.ZipFile(wheel).namelist() if not n.endswith("/")}
    dist_info = {n for n in names if n.split("/")[0].endswith(".dist-info")}
    missing = sorted(expected - names)
    extra = sorted(names - expected - dist_info)
    if missing or extra:
        raise RuntimeError(f"the wheel lacks {missing or 'nothing'}; it holds files the source "
                           f"folders do not: {extra or 'none'}")
    print(f"    {len(names - dist_info)} files, {sum(n.endswith('.py') for n in names)} modules")


# ---- steps -------------------------------------------------------------------------------------

def build(work: Path) -> Path:
    src = work / "src"
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work / "dist"),
        str(src)])
    (wheel,) = (work / "dist").glob("longmoe-*.whl")
    print(f"    {wheel.name} ({wheel.stat().st_size / 1024:.0f} KiB)")
    return wheel


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install(work: Path, wheel: Path, deps: str) -> Path:
    venv = work / "venv"
    py = venv_python(venv)
    if deps == "install":
        sh([sys.executable, "-m", "venv", str(venv)])
        sh([str(py), "-m", "pip", "install", "-q", f"torch=={CPU_TORCH}"])
        sh([str(py), "-m", "pip", "install", "-q", str(wheel), *_example_requirements()])
        return venv
    sh([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    sh([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
        "--no-index", str(wheel)])
    site = sh([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    host = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    # Plain path lines: a folder added this way has its packages importable but its .pth files
    # are never read, so the host's editable install cannot answer for a missing module.
    Path(site.stdout.strip(), "host-dependencies.pth").write_text("\n".join(host) + "\n")
    sh([str(py), "-c", REQUIREMENTS_MET])
    return venv


def _example_requirements() -> list[str]:
    """What docs/api.md's examples import beyond the package: transformers (the dev extra's
    pin), for the hand-off example."""
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["dev"]
    return [r for r in dev if re.match(r"transformers\b", r)]


# Run by the environment's interpreter: each requirement of the installed wheel is met.
REQUIREMENTS_MET = r"""
from importlib.metadata import PackageNotFoundError, distribution, version
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
unmet = []
for line in distribution("longmoe").requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        have = version(req.name)
    except PackageNotFoundError:
        unmet.append(f"{req} (not installed)")
        continue
    if not req.specifier.contains(have, prereleases=True):
        unmet.append(f"{req} (have {have})")
if unmet:
    raise SystemExit("unmet requirements: " + "; ".join(unmet))
"""

# Run by the environment's interpreter from outside the checkout: import every module.
IMPORT_ALL = r"""
import importlib, importlib.util, json, os, pkgutil, sys, sysconfig
from importlib.metadata import distribution
import longmoe
site = sysconfig.get_paths()["purelib"]
extras = {r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip()
          .lower().replace("-", "_") for r in distribution("longmoe").requires or []
          if "extra ==" in r}
names, needs_extra, outside = [], {}, []


def walk(package, folders):  # pkgutil's listing, without importing (a package may need an extra)
    names.append(package)
    for folder in folders:
        for info in pkgutil.iter_modules([folder], package + "."):
            if info.ispkg:
                walk(info.name, [os.path.join(folder, info.name.rpartition(".")[2])])
            else:
                names.append(info.name)


walk("longmoe", longmoe.__path__)
for name in names:
    if name.endswith(".__main__"):  # importing it runs the CLI: found is enough
        mod = importlib.util.find_spec(name)
        if not mod.origin.startswith(site):
            outside.append(f"{name}: {mod.origin}")
        continue
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top and top != "longmoe" and top.lower() in extras:
            needs_extra[name] = top
            continue
        raise
    if not (getattr(mod, "__file__", None) or "").startswith(site):
        outside.append(f"{name}: {getattr(mod, '__file__', None)}")
print(json.dumps({"modules": names, "needs_extra": needs_extra, "outside": outside}))
"""


def imports(venv: Path, work: Path, expected: set[str]):
    p = sh([str(venv_python(venv)), "-c", IMPORT_ALL], cwd=work, env=_clean_env())
    got = json.loads(p.stdout.strip().splitlines()[-1])
    walked = set(got["modules"])
    if walked != expected:
        raise RuntimeError(f"installed modules differ from the source tree's: missing "
                           f"{sorted(expected - walked)}, extra {sorted(walked - expected)}")
    if got["outside"]:
        raise RuntimeError(f"modules imported from outside the environment: {got['outside']}")
    print(f"    {len(walked) - len(got['needs_extra'])} modules imported" + "".join(
        f"\n    {m}: needs the optional {dist!r}, not installed" for m, dist
        in sorted(got["needs_extra"].items())))


def demo(venv: Path, work: Path):
    (work / "demo.jsonl").unlink(missing_ok=True)  # --keep reuses the folder
    sh([str(venv / "bin" / "longmoe"), "train", "--config", "cpu_demo", "--steps", "2",
        "--metrics-out", str(work / "demo.jsonl")], cwd=work, env=_clean_env(), timeout=600)
    rows = [json.loads(line) for line in (work / "demo.jsonl").read_text().splitlines()]
    print(f"    {len(rows)} steps, loss {rows[-1]['loss']:.4f}")
    if len(rows) != 2:
        raise RuntimeError(f"the demo wrote {len(rows)} metric rows, expected 2")


def runnable_blocks(text: str) -> list[str]:
    """The code blocks right after a `<!-- run -->` line."""
    return re.findall(r"^<!-- run -->\n```python\n(.*?)^```", text, re.S | re.M)


def api_examples(venv: Path, work: Path):
    blocks = runnable_blocks((ROOT / "docs" / "api.md").read_text())
    if not blocks:
        raise RuntimeError("docs/api.md has no code block marked <!-- run -->")
    for i, code in enumerate(blocks):
        script = work / f"api_example_{i}.py"
        script.write_text(code)
        p = sh([str(venv_python(venv)), str(script)], cwd=work, env=_clean_env(), timeout=600)
        print(f"    example {i + 1}: " + (p.stdout.strip().splitlines() or ["ran"])[-1])


def _clean_env() -> dict[str, str]:
    """Nothing from the checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--deps", choices=("host", "install"), default="host",
                    help="where the environment's dependencies come from (see above)")
    ap.add_argument("--keep", type=Path, help="work in this folder and leave it (default: a "
                    "temporary folder, removed)")
    args = ap.parse_args(argv)
    files, dirs = source_files(), package_dirs()
    steps = Steps()
    with tempfile.TemporaryDirectory(prefix="longmoe-wheel-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        outside = work / "elsewhere"  # the working directory of every run: not the checkout
        outside.mkdir(exist_ok=True)
        wheel = steps.run("build", build, work)
        steps.run("contents", check_contents, wheel, expected_wheel_files(files, dirs))
        venv = steps.run(f"install (dependencies: {args.deps})", install, work, wheel, args.deps)
        steps.run("imports", imports, venv, outside, source_modules(files, dirs))
        steps.run("demo", demo, venv, outside)
        steps.run("docs/api.md examples", api_examples, venv, outside)
    wall = sum(w for w, _ in steps.times.values())
    cpu = sum(c for _, c in steps.times.values())
    print(f"wheel check passed: {wall:.1f} s wall, {cpu:.1f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
