"""What the distribution installs (every source folder as a package, every data file, nothing
else), and that `python -m longmoe`, its ranks and its benches' subprocesses import the same
longmoe from any working directory. The built wheel itself is checked by ci/check_wheel.py."""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup_module():
    spec = importlib.util.spec_from_file_location("longmoe_setup_py", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # not as __main__: setup() does not run
    return mod


def _glob_match(rel: str, pattern: str) -> bool:
    """setuptools' package-data match: `*` stays within one folder level."""
    a, b = rel.split("/"), pattern.split("/")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _source_files():
    """(installed package of the file's folder, file) for every file under the mapped folders."""
    for package, folder in _pyproject()["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                rel = path.relative_to(ROOT / folder)
                yield ".".join([package, *rel.parent.parts]), path


def test_packages_are_found_not_listed():
    tool = _pyproject()["tool"]["setuptools"]
    assert "packages" not in tool, "pyproject.toml lists packages by hand; setup.py finds them"
    assert tool["package-dir"] == {"longmoe": "longmoe", "longmoe.backends": "backends",
                                   "longmoe.tuning": "tuning"}


def test_every_folder_with_python_files_is_an_installed_package():
    found = set(_setup_module().discover_packages())
    folders = {package for package, path in _source_files() if path.suffix == ".py"}
    missing = sorted(folders - found)
    assert not missing, f"folders with .py files that would not be installed: {missing} " \
                        "(each needs an __init__.py)"
    assert "longmoe.api" in found and "longmoe.ops.kernels" in found
    stray = sorted(p for p in found if p != "longmoe" and not p.startswith("longmoe."))
    assert not stray, f"top-level packages besides longmoe: {stray}"


def test_every_data_file_is_package_data():
    globs = _pyproject()["tool"]["setuptools"]["package-data"]
    packages = set(_setup_module().discover_packages())
    left_out = []
    for package, path in _source_files():
        if path.suffix == ".py":
            continue
        # Shipped when a glob of the package or of one above it (or of "", every package)
        # matches the file's path below that package's folder.
        parts = package.split(".")
        ships = False
        for n in range(len(parts), 0, -1):
            owner = ".".join(parts[:n])
            rel = "/".join([*parts[n:], path.name])
            if owner in packages and any(_glob_match(rel, g) for g in
                                         globs.get(owner, []) + globs.get("", [])):
                ships = True
        if not ships:
            left_out.append(f"{package}: {path.name}")
    assert not left_out, f"data files no package-data glob ships: {left_out}"


def _clone_shape(parent: Path) -> Path:
    """A folder shaped like a clone named longmoe (no __init__.py; top-level bench/, backends/,
    tuning/ folders that are not longmoe's subpackages)."""
    clone = parent / "longmoe"
    for sub in ("bench", "backends", "tuning"):
        (clone / sub).mkdir(parents=True)
    (clone / "backends" / "__init__.py").write_text("raise ImportError('the clone folder')\n")
    (clone / "README.md").write_text("not a package\n")
    return clone


def test_python_m_longmoe_from_the_folder_holding_a_clone(tmp_path):
    _clone_shape(tmp_path)
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "--help"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "weight-sync" in p.stdout


PROBE = """
import json, os, sys


def report(rank, world, out, rendezvous):
    import longmoe.backends
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"executable": sys.executable, "path": sys.path,
                   "backends": longmoe.backends.__file__}, f)
"""


def test_spawned_ranks_use_the_parents_interpreter_and_import_path(tmp_path):
    """A program run from the folder holding a clone, with a module on a path entry it added
    itself, starts ranks through the launcher's supervisor: they import that module and the
    installed longmoe."""
    _clone_shape(tmp_path)
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "longmoe_probe_mod.py").write_text(PROBE)
    program = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = ["longmoe", "--help"]
        sys.path.insert(0, {str(extra)!r})
        # what `python -m longmoe` does first, then a launch of one rank
        try:
            runpy.run_module("longmoe", run_name="__main__")
        except SystemExit:
            pass
        import longmoe_probe_mod
        from longmoe.train.supervise import supervise
        sys.exit(supervise(longmoe_probe_mod.report, 1, ({str(tmp_path)!r},), {str(tmp_path)!r}))
    """)
    p = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    got = json.loads((tmp_path / "rank0.json").read_text())
    assert got["executable"] == sys.executable
    assert str(extra) in got["path"]
    assert not got["backends"].startswith(str(tmp_path)), got["backends"]


def test_subprocesses_get_the_parents_interpreter_and_import_path(tmp_path, monkeypatch):
    from longmoe.child import child_env, import_path, longmoe_command
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "longmoe_probe_mod2.py").write_text("VALUE = 7\n")
    _clone_shape(tmp_path)
    monkeypatch.syspath_prepend(str(extra))
    monkeypatch.syspath_prepend(str(tmp_path))  # an entry that would shadow the package
    path = import_path()
    assert str(extra) in path and str(tmp_path) not in path
    assert longmoe_command("doctor")[:3] == [sys.executable, "-m", "longmoe"]
    code = "import sys, longmoe_probe_mod2, longmoe.child; print(longmoe_probe_mod2.VALUE, sys.executable)"
    p = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(ROOT), env=child_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["7", sys.executable]


def test_bench_stages_run_through_the_child_helper(tmp_path, monkeypatch):
    from longmoe.bench import train_path
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(cmd=cmd, env=kw.get("env"))
        return subprocess.CompletedProcess(cmd, 1, "", "boom")
    monkeypatch.setattr(train_path.subprocess, "run", fake_run)
    monkeypatch.syspath_prepend(str(tmp_path))
    train_path._run("cpu_demo", 2, {}, 1, tmp_path / "m.jsonl", 10)
    assert seen["cmd"][:3] == [sys.executable, "-m", "longmoe"]
    assert str(tmp_path) in seen["env"]["PYTHONPATH"].split(os.pathsep)
