"""What the host issues for one MoE layer step (forward and backward): the torch operations
dispatched (a TorchDispatchMode sees every ATen op, views included) and, with `fold_kernels`,
the same count with each call of a row kernel or grouped GEMM counted once; and the CPU host
time of a step with tiny tensors, the kernels computing or stubbed (`kernels("stub")`).

The CPU reference kernels are several operations each (a grouped GEMM is a matmul per expert
and a cat) where a GPU launches one kernel, so the raw count on CPU mostly measures the
references; the folded count is the host's own work on a GPU (every ATen op outside a kernel
is a launch or a view, each kernel one launch). Stream calls (events, waits) are counted apart
(`StreamCalls`): on a CPU they are no-ops, on a GPU each is a host call. Folding and stubbing
swap the reference implementations in longmoe's own registries for the block and put them back.

    python -m longmoe.bench.host_ops    # CPU: counts and host µs per chunk count (0: unpipelined)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts ATen ops by name; `kernel(name)` counts a kernel call as one op named `name`."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def kernel(self, name: str):
        if not self._inside:
            self.ops[name] += 1
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    @property
    def n(self) -> int:
        return sum(self.ops.values())


_ACTIVE: list[OpCounter] = []


def _in_kernel(name: str):
    return _ACTIVE[-1].kernel(name) if _ACTIVE else contextlib.nullcontext()


class _FoldedGroupedMM(torch.autograd.Function):
    """The reference grouped GEMM as one kernel; its backward as two (dX and dW), as
    torch._grouped_mm's autograd launches."""

    @staticmethod
    def forward(ctx, x, w, sizes, offs, ref):
        ctx.save_for_backward(x, w)
        ctx.sizes, ctx.offs, ctx.ref = sizes, offs, ref
        with _in_kernel("grouped_mm"):
            return ref(x, w, sizes, offs)

    @staticmethod
    def backward(ctx, g):
        from longmoe.ops.grouped_mm import _wgrad_reference
        x, w = ctx.saved_tensors
        with _in_kernel("grouped_mm"):
            dx = ctx.ref(g.contiguous(), w.transpose(1, 2), ctx.sizes, ctx.offs)
        with _in_kernel("grouped_mm_wgrad"):
            dw = _wgrad_reference(x, g, ctx.sizes, ctx.offs) if ctx.sizes is not None else None
        return dx, dw, None, None, None


def _fold_rows(cls):
    """TorchRows with each method one kernel."""
    names = ("gather_sum", "gather_sum_parts", "gather_scale", "swiglu", "swiglu_backward")

    def wrap(name):
        f = getattr(cls, name)

        def run(*a, **k):
            with _in_kernel(name):
                return f(*a, **k)
        return staticmethod(run)
    return type("FoldedRows", (), {n: wrap(n) for n in names})


class _StubGroupedMM(torch.autograd.Function):
    """A grouped GEMM's shape and nothing else: one allocation forward, two backward."""

    @staticmethod
    def forward(ctx, x, w, sizes, offs, ref):
        ctx.shapes = x.shape, w.shape
        return x.new_zeros((x.shape[0], w.shape[2]))

    @staticmethod
    def backward(ctx, g):
        xs, ws = ctx.shapes
        return g.new_zeros(xs), g.new_zeros(ws), None, None, None


class _StubRows:
    """The row kernels' outputs, allocated (or zeroed in place) without the work: one op each,
    standing for a GPU launch."""

    @staticmethod
    def gather_sum(src, idx, w, K, out, accumulate):
        return out.zero_()

    @staticmethod
    def gather_sum_parts(parts, idx, w, K, out, accumulate):
        return out.zero_()

    @staticmethod
    def gather_scale(src, idx, w, y):
        dot = None if y is None else src.new_zeros(idx.numel(), dtype=torch.float32)
        return src.new_zeros((idx.numel(), src.shape[1])), dot

    @staticmethod
    def swiglu(h):
        return h.new_zeros((h.shape[0], h.shape[1] // 2))

    @staticmethod
    def swiglu_backward(h, ga, out, with_dot):
        gh, a = out if out is not None else (torch.zeros_like(h), h.new_zeros(ga.shape))
        return gh, a, (h.new_zeros(h.shape[0], dtype=torch.float32) if with_dot else None)


@contextlib.contextmanager
def kernels(mode: str):
    """Within the block the reference grouped GEMM (forward, autograd backward, weight
    gradient) and row kernels are "fold": counted as one op per call by an active OpCounter,
    computing as before; or "stub": one allocation per call, nothing computed (host time with
    kernels as cheap to issue as a GPU launch; the results are meaningless)."""
    import importlib
    gm = importlib.import_module("longmoe.ops.grouped_mm")  # the modules, not their functions
    mr = importlib.import_module("longmoe.ops.moe_rows")
    ref_mm, ref_rows = gm.GROUPED_MM._impls["reference"], mr.MOE_ROWS._impls["reference"]
    ref_wgrad, ref_cls = gm._WGRAD["reference"], mr.TorchRows
    fn = _FoldedGroupedMM if mode == "fold" else _StubGroupedMM

    def mm(x, w, sizes, offs=None):
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return fn.apply(x, w, sizes, offs, ref_mm.fn)
        if mode == "stub":
            return x.new_zeros((x.shape[0], w.shape[2]))
        with _in_kernel("grouped_mm"):
            return ref_mm.fn(x, w, sizes, offs)

    def wgrad(x, dy, sizes, offs=None):
        if mode == "stub":
            return x.new_zeros((len(sizes), x.shape[1], dy.shape[1]))
        with _in_kernel("grouped_mm_wgrad"):
            return ref_wgrad(x, dy, sizes, offs)
    rows = _fold_rows(ref_cls) if mode == "fold" else _StubRows
    gm.GROUPED_MM._impls["reference"] = dataclasses.replace(ref_mm, fn=mm)
    mr.MOE_ROWS._impls["reference"] = dataclasses.replace(ref_rows, fn=rows)
    mr.TorchRows = rows  # the row functions' fallback for non-row-major tensors
    gm._WGRAD["reference"] = wgrad
    try:
        yield
    finally:
        gm.GROUPED_MM._impls["reference"], mr.MOE_ROWS._impls["reference"] = ref_mm, ref_rows
        gm._WGRAD["reference"], mr.TorchRows = ref_wgrad, ref_cls


@contextlib.contextmanager
def count_ops(fold_kernels: bool = False):
    """An OpCounter over the block; with fold_kernels the reference grouped GEMM (forward,
    autograd backward and weight gradient) and row kernels count one op per call."""
    counter = OpCounter()
    _ACTIVE.append(counter)
    try:
        with kernels("fold") if fold_kernels else contextlib.nullcontext(), counter:
            yield counter
    finally:
        _ACTIVE.pop()


class StreamCalls:
    """Wraps a streams object (backends/streams.py), counting its calls by name: each is a host
    call on a GPU (an event record, a stream wait, a record_stream) and nothing on a CPU."""

    CALLS = ("comm", "comm_waits_compute", "mark_comm", "compute_waits", "comm_uses",
             "flush_pending")

    def __init__(self, inner):
        self.inner, self.calls = inner, collections.Counter()
        self.overlaps = inner.overlaps

    @property
    def pending(self):
        return self.inner.pending

    def __getattr__(self, name):
        f = getattr(self.inner, name)
        if name not in self.CALLS:
            return f

        def call(*a, **k):
            self.calls[name] += 1
            return f(*a, **k)
        return call


def layer_step(moe, x, gy):
    """One forward and backward of the layer (the aux loss's gradient 1)."""
    y, aux = moe(x)
    torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])


def tiny_layer(T=2048, K=8, E=64, H=256, F=128, dtype=torch.float32, seed=0):
    """(MoE layer without a shared expert, input, output gradient) on the CPU."""
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    cfg = get_preset("tiny").replace(num_experts=E, top_k=K, hidden_size=H, moe_ffn_size=F,
                                     shared_expert_ffn_size=0)
    moe = MoE(cfg)
    init_params(moe, cfg, seed)
    moe.to(dtype)
    # Named, not "auto": auto walks the GPU implementations' checks first on a CPU, host time a
    # GPU, where the first one runs, does not spend.
    moe.experts.impl = moe.experts.rows_impl = "reference"
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, T, H, generator=g, dtype=dtype, requires_grad=True)
    return moe, x, torch.randn(1, T, H, generator=g, dtype=dtype)


def cpu_dispatcher(E, chunks, by="experts", wgrad="auto", streams=None):
    """chunks = 0: the unpipelined layer; else the one-rank chunk pipeline on host streams."""
    from longmoe.backends.streams import HostStreams
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    if chunks == 0:
        d = ExpertDispatcher(E)
    else:
        d = ExpertDispatcher(E, None, chunks, None, streams or HostStreams(), pipeline=True,
                             chunk_by=by)
        d.wgrad = wgrad
    d.rows_impl = "reference"  # as tiny_layer's experts
    return d


def count_case(moe, x, gy, fold_kernels: bool):
    """(op counter, stream calls) of one layer step with moe's current dispatcher."""
    d = moe.dispatcher
    if d.pipeline:
        d.streams = StreamCalls(d.streams)
    try:
        with count_ops(fold_kernels) as c:
            layer_step(moe, x, gy)
    finally:
        calls = d.streams.calls if d.pipeline else collections.Counter()
        if d.pipeline:
            d.streams = d.streams.inner
    return c, calls


def best_host_us(moe, x, gy, iters: int) -> int:
    """The fastest of `iters` layer steps (after 3 untimed), in microseconds."""
    import time
    for _ in range(3):
        layer_step(moe, x, gy)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        layer_step(moe, x, gy)
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6)


def main():
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="0,1,2,4", help="0: the unpipelined layer")
    ap.add_argument("--by", default="experts", help="chunks of experts or of tokens")
    ap.add_argument("--wgrad", default="auto", help="the weight-gradient schedule")
    ap.add_argument("--shape", default="2048,8,64,256,128", help="T,K,E,H,F for the counts")
    ap.add_argument("--time-shape", default="64,2,8,16,8",
                    help="T,K,E,H,F for the host time (tiny: kernel time negligible)")
    ap.add_argument("--iters", type=int, default=30, help="timed steps per case (the best)")
    ap.add_argument("--top", type=int, default=0, help="print the N most frequent ops per case")
    a = ap.parse_args()
    torch.set_num_threads(1)
    T, K, E, H, F = (int(v) for v in a.shape.split(","))
    moe, x, gy = tiny_layer(T, K, E, H, F)
    tT, tK, tE, tH, tF = (int(v) for v in a.time_shape.split(","))
    tmoe, tx, tgy = tiny_layer(tT, tK, tE, tH, tF)
    for C in (int(c) for c in a.chunks.split(",")):
        moe.dispatcher = cpu_dispatcher(E, C, a.by, a.wgrad)
        raw, _ = count_case(moe, x, gy, False)
        folded, calls = count_case(moe, x, gy, True)
        tmoe.dispatcher = cpu_dispatcher(tE, C, a.by, a.wgrad)
        best = best_host_us(tmoe, tx, tgy, a.iters)
        with kernels("stub"):
            stub = best_host_us(tmoe, tx, tgy, a.iters)
        print(json.dumps({"chunks": C, "aten_ops": raw.n, "ops_kernels_folded": folded.n,
                          "stream_calls": sum(calls.values()), "host_us_best": best,
                          "host_us_stub_kernels": stub, "time_shape": a.time_shape,
                          "shape": a.shape}), flush=True)
        if a.top:
            print("  ", dict(folded.ops.most_common(a.top)), dict(calls))


if __name__ == "__main__":
    main()
