"""train.kernel_manifest: the variants a run compiled, recorded by the compilation listener, compile
again in spawned worker processes into another (empty) Triton cache, and the same compile in this
process then reads them from disk instead of compiling; a stale entry fails in its worker without
failing the run; bad manifests are refused by field before any process group starts. Compiled
for a GPU target without a GPU."""

import json
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")
if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
    pytest.skip("this Triton has no compilation listener", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longmoe.backends.aot import compile_targets  # noqa: E402
from longmoe.ops.kernels import precompile  # noqa: E402
from longmoe.ops.kernels.aot import _aligned_attrs, _l2norm_specs  # noqa: E402
from longmoe.ops.kernels.compile_watch import CompileWatch  # noqa: E402


def _compile_l2norm(block_rows: int, warps: int):
    """The Gated DeltaNet q/k norm's forward kernel as a launch on an aligned layer compiles it."""
    _, _, fn, sig, consts, _ = _l2norm_specs()[0]
    t = next(iter(compile_targets().values()))
    src = ASTSource(fn=fn, signature=sig, constexprs=consts({"BLOCK_ROWS": block_rows}),
                    attrs=_aligned_attrs(sig))
    return triton.compile(src, target=GPUTarget(t.triton_backend, t.arch, t.warp_size),
                          options={"num_warps": warps})


def test_recorded_variants_compile_in_workers_into_the_cache_the_launch_reads(tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "first"))
    watch = CompileWatch(record=True).start()
    try:
        _compile_l2norm(8, 8)
        _compile_l2norm(16, 4)  # the backend's default warps: not among the launch's options
        assert watch.take()["kernel_compiles"] == 2
        entries = list(watch.entries)
    finally:
        watch.stop()
    assert len(entries) == 2
    e = entries[0]
    assert e["module"] == "longmoe.ops.kernels.l2norm_rows" and e["options"] == {"num_warps": 8}
    assert entries[1]["options"] == {}
    assert json.loads(json.dumps(entries)) == entries  # plain JSON

    path = tmp_path / "kernels.json"
    assert precompile.merge(path, entries) == (2, 2)
    assert precompile.merge(path, entries[:1]) == (2, 0)  # each variant once
    # Another machine: an empty cache, the manifest compiled by two spawned workers
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "second"))
    stale = dict(e, name="no_such_kernel")
    r = precompile.start(precompile.load(path) + [stale], workers=2).wait()
    assert (r["entries"], r["failed"], r["workers"]) == (3, 1, 2) and r["compile_s"] > 0
    watch = CompileWatch(record=True).start()
    try:
        _compile_l2norm(8, 8)
        _compile_l2norm(16, 4)
        assert watch.take() == {"kernel_compiles": 0, "kernel_compile_s": 0.0,
                                "kernel_cache_loads": 2}
        # a variant read from the cache is recorded as the same entry as when it compiled, so
        # a run on a warm machine adds nothing to the manifest
        assert watch.entries == entries
        assert precompile.merge(path, watch.entries) == (2, 0)
    finally:
        watch.stop()


def test_entries_that_cannot_be_replayed_are_left_out():
    class Src:  # a kernel made inside a function: no module-level name to import it by
        def __init__(self, qualname, consts):
            self.fn = type("J", (), {"fn": type("F", (), {"__qualname__": qualname,
                                                           "__module__": "m"})})()
            self.signature, self.constants, self.attrs = {"x": "*fp32"}, consts, {}
    t = next(iter(compile_targets().values()))
    meta = {"target": {"backend": t.triton_backend, "arch": t.arch, "warp_size": t.warp_size},
            "num_warps": 8, "num_stages": None, "cluster_dims": [1, 1, 1]}
    assert precompile.entry(Src("outer.<locals>.k", {}), meta) is None
    assert precompile.entry(Src("k", {(1,): object()}), meta) is None
    assert precompile.entry(Src("k", {(1,): 64}), {"num_warps": 8}) is None  # no target
    e = precompile.entry(Src("k", {(1,): 64}), meta)
    assert e["target"] == [t.triton_backend, t.arch, t.warp_size]
    assert e["constexprs"] == [[[1], 64]]
    assert e["options"] == {"num_warps": 8}  # scalars that differ from the defaults only


def test_only_the_devices_target_is_compiled():
    from types import SimpleNamespace
    a = {"module": "m", "name": "k", "target": ["cuda", 90, 32]}
    b = dict(a, target=["hip", "gfx942", 64])
    assert precompile.for_target([a, b], SimpleNamespace(backend="hip", arch="gfx942",
                                                         warp_size=64)) == [b]
    assert precompile.for_target([a, b], ["cuda", 90, 32]) == [a]
    assert precompile.for_target([a, b], ["cuda", 100, 32]) == []


def test_precompile_with_nothing_to_do():
    r = precompile.start([]).wait()
    assert r["entries"] == 0 and r["failed"] == 0


@pytest.mark.parametrize("content, needle", [("{", "not a readable kernel manifest"),
                                             ('{"kind": "x"}', "not a longmoe kernel manifest")])
def test_a_bad_manifest_is_one_line_naming_the_field(tmp_path, content, needle):
    bad = tmp_path / "m.json"
    bad.write_text(content)
    for path in (str(bad), str(tmp_path / "no" / "dir" / "m.json")):
        p = subprocess.run([sys.executable, "-m", "longmoe", "train", "--config", "cpu_demo",
                            "--nproc", "1", "--set", "parallel.ep=1", "--steps", "1",
                            "--set", f"train.kernel_manifest={path}"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].count("train.kernel_manifest") == 1, p.stderr
        assert (needle if path == str(bad) else "its directory does not exist") in lines[0]
        assert not bad.with_name("m.json.tmp").exists()


def test_a_run_with_a_manifest_trains_and_leaves_it_whole_on_cpu(tmp_path):
    # On CPU no kernel compiles: the run trains as without the field and adds nothing.
    path = tmp_path / "kernels.json"
    precompile.merge(path, [])
    before = path.read_text()
    p = subprocess.run([sys.executable, "-m", "longmoe", "train", "--config", "cpu_demo",
                        "--nproc", "1", "--set", "parallel.ep=1", "--steps", "1",
                        "--set", f"train.kernel_manifest={path}", "--metrics-out", "m.jsonl"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert path.read_text() == before and precompile.load(path) == []
    row = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[0])
    assert "kernel_precompiled" not in row  # nothing precompiled on a CPU


class _Cpu:
    device_type = "cpu"


def test_a_manifest_run_records_each_calls_variants_and_counts_them(tmp_path, monkeypatch):
    # The drivers' side (the CLI's steps, the verl engine's calls): what a call compiles is
    # counted in its end(), and rank 0 adds the variants to the manifest, each once.
    from longmoe.train.kernel_manifest import ManifestRun
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "kernels.json"
    run = ManifestRun(str(path), _Cpu(), 0, "call")
    try:
        _compile_l2norm(8, 2)  # before the first call: not the call's
        run.begin()
        _compile_l2norm(8, 8)
        lines, compiles, first = run.end()
        assert compiles["kernel_compiles"] == 1 and first == {}
        assert lines == [f"train.kernel_manifest: 2 new variant(s) of call 1 added to {path} "
                         "(2 in all)"]
        run.begin()
        _compile_l2norm(8, 8)  # compiled in this process already: nothing new
        lines, compiles, _ = run.end(7)
        assert lines == [] and compiles["kernel_compiles"] == 0
    finally:
        run.close()
    assert len(precompile.load(path)) == 2
    other = ManifestRun(str(tmp_path / "other.json"), _Cpu(), 1)  # rank 1 records nothing
    try:
        other.begin()
        _compile_l2norm(32, 4)
        assert other.end()[0] == [] and not (tmp_path / "other.json").exists()
    finally:
        other.close()


def test_the_pool_is_collected_when_asked_or_found_finished(tmp_path):
    # A log-prob call (collect=False) does not wait for a pool still compiling the backward's
    # variants; one that finds it done, or the first training call, collects it.
    from concurrent.futures import Future

    from longmoe.train.kernel_manifest import ManifestRun
    run = ManifestRun("", _Cpu(), 0, "call")
    futures = [Future(), Future()]
    pre = precompile.Precompile(2, 2, futures=futures)
    for f in futures:
        f.add_done_callback(pre._finished)
    run.pre = pre
    try:
        assert run.end(collect=False)[2] == {} and run.pre is pre
        futures[0].set_result(0.5)
        futures[1].set_exception(RuntimeError("stale"))
        lines, _, first = run.end(collect=False)
        assert run.pre is None and first["kernel_precompiled"] == 1
        assert first["kernel_precompile_s"] == pytest.approx(pre.t_end - pre.t0)
        assert lines == [": ".join(["train.kernel_manifest", "2 variant(s) from  compiled by 2 "
                                    f"process(es) in {first['kernel_precompile_s']:.1f} s from "
                                    "the model build on; 1 failed (their launches compile them)"])]
    finally:
        run.close()


def test_one_pool_per_manifest_and_process(tmp_path, monkeypatch):
    # verl's actor and reference engines in one process: the second run of the same manifest
    # starts no second pool (it would compile the same variants again).
    from longmoe.train import kernel_manifest as km
    started = []
    monkeypatch.setattr(km, "_POOLS_STARTED", set())
    monkeypatch.setattr(km, "start_precompile",
                        lambda path, backend: started.append(path) or precompile.Precompile(0, 0))
    path = str(tmp_path / "k.json")
    runs = [km.ManifestRun(path, _Cpu(), 0, "call"), km.ManifestRun(path, _Cpu(), 0, "call"),
            km.ManifestRun(str(tmp_path / "other.json"), _Cpu(), 0, "call")]
    try:
        assert started == [path, str(tmp_path / "other.json")]
        assert runs[0].pre is not None and runs[1].pre is None
    finally:
        for r in runs:
            r.close()
