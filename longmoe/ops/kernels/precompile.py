"""Kernel variants compiled ahead, in parallel, from a manifest of an earlier run.

Triton compiles each kernel variant (a kernel with one set of constexprs and argument
specialisations) on its first launch, one after another on the host, so a run on a machine with
an empty cache pays every compile inside its first step. The on-disk cache does not travel
between machines, but the list of variants does: `record` turns what Triton's compilation
listener saw (longmoe.ops.kernels.compile_watch) into manifest entries, and `start` compiles a
manifest's entries in a pool of processes into this machine's cache, from the model build on;
the first launch of each variant then reads it from disk (the entries go in the order an earlier
run first launched them, so the pool stays ahead of the launches; one that gets ahead compiles
its variant itself, and the cache keeps one copy).

An entry names the kernel by module and name (imported again in the worker), with the signature,
constexprs and specialisation attributes Triton was given and the launch options that shape the
binary (those that differ from the target backend's defaults: the warps and stages of a tile
config, for instance). Compiled with those, the cache key is the one the launch
computes for the same Triton, source and environment. An entry that no longer matches (the kernel
changed, another Triton) is compiled for nothing or fails in its worker; the launch then compiles
as it would have: a stale manifest costs host time, never correctness.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

_PLAIN = (int, float, str, bool, type(None))
_DEFAULTS: dict[tuple, dict] = {}


def _defaults(target: list) -> dict:
    """The options the target's Triton backend fills in when a launch passes none: a launch's
    own options (num_warps, num_stages, whatever the vendor's backend takes) are those that
    differ from these."""
    key = tuple(target)
    if key not in _DEFAULTS:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        _DEFAULTS[key] = dict(make_backend(GPUTarget(*target)).parse_options({}).__dict__)
    return _DEFAULTS[key]


def _target(t) -> list | None:
    """[backend, arch, warp_size] of a listener's metadata target (an object or a stored list)."""
    if t is None:
        return None
    if isinstance(t, dict):
        return [t.get("backend"), t.get("arch"), t.get("warp_size")]
    if isinstance(t, (list, tuple)):
        return list(t)[:3]
    return [getattr(t, "backend", None), getattr(t, "arch", None), getattr(t, "warp_size", None)]


def entry(src, metadata: dict) -> dict | None:
    """A manifest entry for one compiled variant (the listener's `src` and `metadata`); None for
    one that cannot be replayed (not a module-level kernel, or constexprs that are not plain
    values)."""
    jit = getattr(src, "fn", None)
    fn = getattr(jit, "fn", None)
    if fn is None or "<" in getattr(fn, "__qualname__", "<"):
        return None
    consts = getattr(src, "constants", {}) or {}
    if not all(isinstance(v, _PLAIN) for v in consts.values()):
        return None
    target = _target(metadata.get("target"))
    if target is None or None in target:
        return None
    return {"module": fn.__module__, "name": fn.__qualname__, "target": target,
            "signature": dict(src.signature),
            "constexprs": [[list(k), v] for k, v in consts.items()],
            "attrs": [[list(k), v] for k, v in (getattr(src, "attrs", {}) or {}).items()],
            "options": _launch_options(metadata, _defaults(target))}


def _launch_options(metadata: dict, defaults: dict) -> dict:
    """The scalar options of a compiled variant that differ from its backend's defaults (what
    the launch passed). Sequences are left out: a cached variant's metadata holds them as JSON
    lists where the backend keeps tuples, the same options in another spelling."""
    return {k: v for k, v in metadata.items()
            if k in defaults and isinstance(v, (int, float, str, bool)) and v != defaults[k]}


def _key(e: dict) -> str:
    return json.dumps(e, sort_keys=True)


def merge(path: str | Path, entries: list[dict]) -> tuple[int, int]:
    """Add `entries` to the manifest at `path` (made if missing), each variant once; written
    whole to a temporary file and renamed, so a reader never sees half a manifest. Returns
    (entries the manifest holds, entries added); nothing new: the file is left as it was."""
    path = Path(path)
    have = load(path) if path.exists() else []
    before = len(have)
    seen = {_key(e) for e in have}
    for e in entries:
        if _key(e) not in seen:
            have.append(e)
            seen.add(_key(e))
    if len(have) == before and path.exists():
        return before, 0
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"kind": "longmoe-kernel-manifest", "entries": have}, indent=0))
    tmp.replace(path)
    return len(have), len(have) - before


def load(path: str | Path) -> list[dict]:
    """The entries of a manifest file; a file that is not one is a ValueError naming it."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable kernel manifest ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != "longmoe-kernel-manifest" \
            or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: not a longmoe kernel manifest")
    return data["entries"]


def for_target(entries: list[dict], target) -> list[dict]:
    """The entries compiled for `target` (the device this process launches on: a GPUTarget, or
    [backend, arch, warp_size]); a manifest written on another kind of GPU can hold others."""
    want = _target(target)
    return [e for e in entries if list(e["target"]) == want]


def current_target():
    """This process's launch target (Triton's active driver), None where there is none."""
    try:
        from triton.runtime import driver
        return driver.active.get_current_target()
    except Exception:  # no driver for this machine: nothing of the manifest can be used here
        return None


def compile_entry(e: dict) -> float:
    """Compile one entry into this process's Triton cache; returns the seconds it took (a cache
    hit is fast). Runs in a pool worker."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    t0 = time.perf_counter()
    fn = importlib.import_module(e["module"])
    for part in e["name"].split("."):
        fn = getattr(fn, part)
    src = ASTSource(fn=fn, signature=e["signature"],
                    constexprs={tuple(k): v for k, v in e["constexprs"]},
                    attrs={tuple(k): v for k, v in e["attrs"]})
    triton.compile(src, target=GPUTarget(*e["target"]), options=dict(e["options"]))
    return time.perf_counter() - t0


@dataclass
class Precompile:
    """A manifest being compiled by a pool of worker processes."""
    entries: int
    workers: int
    t0: float = field(default_factory=time.perf_counter)
    futures: list[Future] = field(default_factory=list)
    pool: ProcessPoolExecutor | None = None
    t_end: float = 0.0  # when the last entry finished (set as each one does)
    finished: int = 0   # entries whose done callback has run

    def _finished(self, _future):
        self.t_end = max(self.t_end, time.perf_counter())
        self.finished += 1

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self) -> dict:
        """Block until every entry is done: {entries, failed, workers, wall_s, compile_s}."""
        failed, spent = 0, 0.0
        for f in self.futures:
            try:
                spent += f.result()
            except Exception:  # a stale entry: the launch compiles that variant itself
                failed += 1
        if self.pool is not None:
            self.pool.shutdown()
        # A future's result can be read before its done callback has run: until every
        # callback has, the last entry finished just now.
        done = self.futures and self.finished == len(self.futures)
        end = self.t_end if done else time.perf_counter()
        return {"entries": self.entries, "failed": failed, "workers": self.workers,
                "wall_s": end - self.t0, "compile_s": spent}


def start(entries: list[dict], workers: int | None = None) -> Precompile:
    """Compile `entries` in `workers` spawned processes (default: the host's cores, at most one
    per entry) and return at once; `wait()` collects them."""
    if not entries:
        return Precompile(0, 0)
    workers = max(1, min(workers or os.cpu_count() or 1, len(entries)))
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
    job = Precompile(len(entries), workers, pool=pool)
    job.futures = [pool.submit(compile_entry, e) for e in entries]
    for f in job.futures:
        f.add_done_callback(job._finished)
    return job
