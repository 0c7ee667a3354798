"""Starting another Python process of longmoe (a bench's `longmoe train` stage): the parent's
interpreter and the parent's import path, so the child imports the same longmoe and the same
dependencies whatever its working directory and however the parent found them (PYTHONPATH,
entries a program added to sys.path, a virtual environment).

Ranks started with multiprocessing's spawn get both already (it runs sys.executable and hands the
parent's sys.path to the child); a plain subprocess gets neither, so it goes through here.
"""

from __future__ import annotations

import os
import site
import sys


def _own_entries() -> set[str]:
    """Folders every process of this interpreter puts on sys.path by itself."""
    roots = {os.path.abspath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                          sys.base_exec_prefix)}
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    return {p for p in map(os.path.abspath, filter(None, sys.path))
            if p == user or any(p == r or p.startswith(r + os.sep) for r in roots)}


def _shadows(entry: str) -> bool:
    """A folder holding a `longmoe` folder that is no regular package (a clone seen from the
    folder above it): as a path entry it would stand in for the installed package."""
    folder = os.path.join(entry, "longmoe")
    return os.path.isdir(folder) and not os.path.isfile(os.path.join(folder, "__init__.py"))


def import_path() -> list[str]:
    """The parent's sys.path entries a fresh interpreter would not have, absolute, in order."""
    own = _own_entries()
    out: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.getcwd())
        if path not in own and path not in out and os.path.isdir(path) and not _shadows(path):
            out.append(path)
    return out


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's environment) with PYTHONPATH set to the parent's import
    path, the entries PYTHONPATH already had kept after it."""
    env = dict(os.environ if env is None else env)
    entries = import_path()
    entries += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in entries]
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


def longmoe_command(*args: str) -> list[str]:
    """`python -m longmoe ARGS` with this process's interpreter."""
    return [sys.executable, "-m", "longmoe", *args]
