"""The step log's kernel-compile fields: CompileWatch counts each Triton kernel variant compiled
(with the compiler's seconds) and each one read back from the on-disk cache, through Triton's
compilation listener, compiled here for a GPU target without a GPU."""

import pytest

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")
if not hasattr(knobs, "compilation") or not hasattr(knobs.compilation, "listener"):
    pytest.skip("this Triton has no compilation listener", allow_module_level=True)

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from longmoe.backends.aot import compile_targets  # noqa: E402
from longmoe.ops.kernels.compile_watch import CompileWatch  # noqa: E402


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, s, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * s, mask=i < n)


def _compile(block: int):
    t = next(iter(compile_targets().values()))
    src = ASTSource(fn=_scale_kernel, constexprs={"BLOCK": block},
                    signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "s": "fp32",
                               "BLOCK": "constexpr"})
    return triton.compile(src, target=GPUTarget(t.triton_backend, t.arch, t.warp_size))


def test_the_watch_counts_compiles_and_cache_loads_between_takes(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    seen = []  # a listener set before the watch still hears every compile

    def earlier(**kw):
        seen.append(kw["cache_hit"])
    monkeypatch.setattr(knobs.compilation, "listener", earlier)
    watch = CompileWatch().start()
    try:
        assert watch.take() == {"kernel_compiles": 0, "kernel_compile_s": 0.0,
                                "kernel_cache_loads": 0}
        _compile(64)
        _compile(128)  # another constexpr: another variant
        got = watch.take()
        assert got["kernel_compiles"] == 2 and got["kernel_cache_loads"] == 0
        assert got["kernel_compile_s"] > 0
        _compile(64)  # the same variant again: read from the on-disk cache
        assert watch.take() == {"kernel_compiles": 0, "kernel_compile_s": 0.0,
                                "kernel_cache_loads": 1}
    finally:
        watch.stop()
    assert knobs.compilation.listener is earlier and seen == [False, False, True]
    assert watch.take() is None  # stopped: inactive


def test_without_a_listener_the_watch_is_inactive(monkeypatch):
    monkeypatch.delattr(knobs.compilation.__class__, "listener", raising=False)
    monkeypatch.delattr(knobs, "compilation")
    watch = CompileWatch().start()
    assert not watch.active and watch.take() is None
    watch.stop()


def test_the_step_line_says_what_the_step_compiled():
    from longmoe.train.progress import _compile_note
    assert _compile_note({"kernel_compiles": 26, "kernel_compile_s": 15.45}) == \
        "  compiled 26 kernel(s) in 15.4 s"
    assert _compile_note({"kernel_compiles": 0, "kernel_compile_s": 0.0}) == ""
    assert _compile_note({}) == ""
