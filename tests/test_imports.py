"""The package's import graph: no cycles between files, and the core never names a vendor.

Every `import` and `from ... import` counts, including the ones inside functions: a function-level
import that closes a cycle hides a layering problem as surely as a module-level one, it only
moves the failure from import time to call time.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Source folder -> the package name it installs as (pyproject.toml's package-dir).
PACKAGE_DIRS = {"longmoe": "longmoe", "backends": "longmoe.backends", "tuning": "longmoe.tuning"}
VENDOR_PACKAGES = ("longmoe.backends.cuda", "longmoe.backends.rocm", "longmoe.backends.cpu")
# The `peers` extra: imported only inside the functions that compare against them.
PEERS = ("liger_kernel", "megatron", "cut_cross_entropy")


def _module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every .py of the three source folders."""
    modules: dict[str, Path] = {}
    for folder, package in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _resolve(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute module a (possibly relative) `from` names."""
    if level == 0:
        return name or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, name] if name else base)


def _targets(candidate: str, modules: dict[str, Path]) -> list[str]:
    """The files an import of `candidate` executes: the module itself, else its nearest package."""
    while candidate and candidate not in modules:
        candidate = candidate.rpartition(".")[0]
    return [candidate] if candidate else []


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (any scope, `TYPE_CHECKING` blocks excluded)."""
    modules = _module_files()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = set()
        for node in ast.walk(tree):
            # Imports only a type checker executes do not run and close no cycle.
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(n) for b in node.body for n in ast.walk(b))
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node.level, node.module)
                # `from pkg import sub` imports pkg and, when sub is a module, pkg.sub too.
                names = [base] + [f"{base}.{alias.name}" for alias in node.names
                                  if f"{base}.{alias.name}" in modules]
            for name in names:
                if name == "longmoe" or name.startswith("longmoe."):
                    for target in _targets(name, modules):
                        if target != module:
                            graph[module].add(target)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components with more than one member (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    components.append(sorted(members))
    return components


def test_no_import_cycles_between_files():
    # Every explicit import is an edge, a package's __init__ included: a package that re-exports
    # its submodules must not be imported back by them (vendors register through
    # backends/registry.py, not the package).
    cycles = _strongly_connected(import_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(
        "  " + " <-> ".join(c) for c in cycles)


def test_graph_sees_function_level_and_relative_imports():
    """The checker itself: a relative import inside a function must appear in the graph."""
    graph = import_graph()
    assert graph["longmoe.cli"], "longmoe.cli imports nothing? the parser missed its imports"
    assert any(t.startswith("longmoe.backends") for t in graph["longmoe.tuning.tuner"]), (
        "tuning/ maps to longmoe.tuning and imports backends")
    assert _resolve("longmoe.ops.kernels.aot", ROOT / "longmoe/ops/kernels/aot.py", 2,
                    "registry") == "longmoe.ops.registry"
    assert _resolve("longmoe.ops", ROOT / "longmoe/ops/__init__.py", 1,
                    "registry") == "longmoe.ops.registry"
    tree = ast.parse("def f():\n    from .x import y\n")
    assert any(isinstance(n, ast.ImportFrom) and n.level == 1 for n in ast.walk(tree))


# Package -> the packages above it, which it must not import (function-level imports count): the
# training loop and PolicyTrainer call checkpoint/, never the other way round.
LAYERS = {"longmoe.checkpoint": ("longmoe.train", "longmoe.api", "longmoe.integrations",
                                 "longmoe.cli", "longmoe.bench", "longmoe.paired", "longmoe.plan")}
# A sample's way to the loss only goes down (docs/architecture.md, "The walk of one sample"): data/
# builds the one batch type and calls nothing above it; parallel/ (which slices that batch) and
# rl/ (the objective the LM head calls back) know neither the data code nor the trainer.
_ABOVE_DATA = ("longmoe.train", "longmoe.api", "longmoe.integrations", "longmoe.cli",
               "longmoe.bench", "longmoe.paired", "longmoe.checkpoint")
LAYERS.update({
    "longmoe.data": _ABOVE_DATA + ("longmoe.parallel", "longmoe.model", "longmoe.rl",
                                   "longmoe.plan"),
    "longmoe.parallel": _ABOVE_DATA + ("longmoe.data",),
    "longmoe.rl": _ABOVE_DATA + ("longmoe.data",),
})


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_lower_packages_import_no_upper_one():
    graph = import_graph()
    assert any(_within(m, "longmoe.checkpoint") for m in graph), "longmoe.checkpoint not found"
    offenders = sorted(f"{m} -> {t}" for low, uppers in LAYERS.items()
                       for m, targets in graph.items() if _within(m, low)
                       for t in targets if any(_within(t, up) for up in uppers))
    assert not offenders, "imports against the layering:\n  " + "\n  ".join(offenders)


def test_core_imports_no_vendor_package():
    """`longmoe/` reaches vendor code only through the backend registry (longmoe.backends)."""
    graph = import_graph()
    offenders = sorted(f"{m} -> {t}" for m, targets in graph.items()
                       if not m.startswith(("longmoe.backends", "longmoe.tuning"))
                       for t in targets if t.startswith(VENDOR_PACKAGES))
    assert not offenders, "core modules import vendor backends:\n  " + "\n  ".join(offenders)


# Vendor-specific Triton launch options: backends/<vendor>/ turns a table entry into launch
# kwargs (Backend.launch_options); core kernel code passes the entry through.
VENDOR_LAUNCH_KEYS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")


def test_core_spells_no_vendor_launch_option():
    offenders = [f"{path.relative_to(ROOT)}: {key}" for path in sorted((ROOT / "longmoe").rglob("*.py"))
                 for key in VENDOR_LAUNCH_KEYS if key in path.read_text()]
    assert not offenders, "vendor launch options outside backends/: " + ", ".join(offenders)


def test_tuning_uses_no_private_helpers_of_other_modules():
    """tuning/ reaches the CLI and its own modules through public names only (the CLI's
    argument helpers live in longmoe/cli_args.py)."""
    modules = _module_files()
    offenders = []
    for module, path in modules.items():
        if not module.startswith("longmoe.tuning"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node.level, node.module)
                if base != module:
                    offenders += [f"{module}: {base}.{a.name}" for a in node.names
                                  if a.name.startswith("_")]
    assert not offenders, "tuning imports private helpers: " + ", ".join(offenders)


def test_peers_are_imported_only_where_they_are_compared():
    """A plain install (no `peers` extra) imports every module: no module-level peer import."""
    offenders = []
    for module, path in _module_files().items():
        for node in ast.parse(path.read_text()).body:  # module scope only
            if isinstance(node, (ast.If, ast.Try)):
                continue
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in PEERS]
    assert not offenders, offenders


def test_the_cli_and_trainer_load_no_peer():
    code = ("import sys, longmoe.cli, longmoe.train.trainer, longmoe.paired.cases, "
            "longmoe.bench.linear_ce, longmoe.bench.moe_layer, longmoe.doctor\n"
            "longmoe.cli.build_parser()\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PEERS!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", p.stdout
