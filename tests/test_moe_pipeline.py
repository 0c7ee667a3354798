"""The pieces of the chunked EP pipeline that run without a process group: the weight-gradient
grouped GEMM, the SwiGLU backward, the transports' choice and the symmetric-memory copy plan.
(The pipeline itself runs on real gloo ranks in test_expert_parallel.py.)"""

import random

import pytest
import torch

from longmoe.backends.transports import push_plan
from longmoe.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
from longmoe.parallel.expert_parallel import check_expert_index, plan_routes
from longmoe.ops.moe_rows import swiglu, swiglu_backward
import longmoe.parallel.moe_pipeline as mp


def _sizes(g, groups, rows):
    cuts = sorted(random.Random(g).randrange(rows + 1) for _ in range(groups - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [rows])]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("groups,rows", [(5, 37), (3, 0), (4, 1), (1, 23)])
def test_wgrad_matches_autograd(dtype, tol, groups, rows):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    sizes = _sizes(seed, groups, rows)
    x = torch.randn(rows, 13, generator=g, dtype=dtype)
    w = torch.randn(groups, 13, 7, generator=g, dtype=dtype, requires_grad=True)
    dy = torch.randn(rows, 7, generator=g, dtype=dtype)
    grouped_mm(x, w, sizes, impl="reference").backward(dy) if rows else None
    expect = w.grad if rows else torch.zeros_like(w)
    got = grouped_mm_wgrad(x, dy, sizes, w.detach(), impl="reference")
    assert got.dtype == w.dtype and got.shape == w.shape
    torch.testing.assert_close(got, expect, rtol=tol, atol=tol, msg=f"seed {seed} sizes {sizes}")
    for gi, n in enumerate(sizes):
        if n == 0:
            assert torch.count_nonzero(got[gi]) == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_swiglu_backward_matches_autograd(dtype, tol):
    h = (3 * torch.randn(29, 2 * 11)).to(dtype).requires_grad_()
    ga = torch.randn(29, 11).to(dtype)
    a_ref = swiglu(h)
    a_ref.backward(ga)
    gh, a, dot = swiglu_backward(h.detach(), ga, with_dot=True, impl="reference")
    torch.testing.assert_close(a, a_ref.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(gh, h.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(dot, (ga.double() * a_ref.detach().double()).sum(-1).float(),
                               rtol=tol, atol=tol * 11)


def _simulate_push(matrix, rows_by_rank):
    """Run push_plan's copies between in-memory 'buffers' and return each rank's output."""
    S = len(matrix)
    bufs = [torch.full((sum(matrix[s][d] for s in range(S)),), -1) for d in range(S)]
    outs = [torch.full_like(b, -2) for b in bufs]
    plans = [push_plan(matrix, me) for me in range(S)]
    for me, (pushes, local, _) in enumerate(plans):
        for peer, src, n, dst in pushes:
            bufs[peer][dst:dst + n] = rows_by_rank[me][src:src + n]
        if local:
            src, n, dst = local
            outs[me][dst:dst + n] = rows_by_rank[me][src:src + n]
    for me, (_, _, pulls) in enumerate(plans):
        for lo, hi in pulls:
            outs[me][lo:hi] = bufs[me][lo:hi]
    return outs


@pytest.mark.parametrize("S", [2, 3, 4])
def test_push_plan_is_an_all_to_all(S):
    rng = random.Random()
    matrix = [[rng.choice([0, 0, 1, 3, 5]) for _ in range(S)] for _ in range(S)]
    # row value encodes (source, destination, index) so misplaced rows are visible
    rows = [torch.tensor([1000 * s + 100 * d + i for d in range(S) for i in range(matrix[s][d])])
            for s in range(S)]
    outs = _simulate_push(matrix, rows)
    for d in range(S):
        expect = [1000 * s + 100 * d + i for s in range(S) for i in range(matrix[s][d])]
        assert outs[d].tolist() == expect, (matrix, d)


def test_transport_choice_and_reasons():
    from longmoe.backends import get_backend
    from longmoe.backends.cuda.collective import NcclCollective
    from longmoe.backends.rocm.collective import RcclCollective
    cpu = get_backend("cpu")
    assert cpu.a2a("auto").name == "process_group"
    with pytest.raises(ValueError, match="does not offer 'symmetric_memory'"):
        cpu.a2a("symmetric_memory")
    with pytest.raises(ValueError, match="unknown transport 'nvshmem'"):
        cpu.a2a("nvshmem")
    with pytest.raises(ValueError, match="CPU device"):
        NcclCollective().a2a("symmetric_memory", torch.device("cpu"))
    with pytest.raises(ValueError, match="not validated on ROCm"):
        RcclCollective().a2a("symmetric_memory", torch.device("cuda", 0))
    assert RcclCollective().a2a("auto", torch.device("cuda", 0)).name == "process_group"


def test_route_plan_one_rank_counts():
    idx = torch.tensor([[0, 3], [3, 1], [2, 0], [1, 1]])
    plan = plan_routes(idx, 4, 2)
    assert plan.bounds == [(0, 2), (2, 4)]
    assert plan.expert_rows == [[1, 1, 0, 2], [1, 2, 1, 0]]
    assert plan.matrix == [[[4]], [[4]]]
    # assignments sorted by (chunk, expert)
    flat = idx.reshape(-1)[plan.order_A].tolist()
    assert flat == [0, 1, 3, 3, 0, 1, 1, 2]


def test_bad_expert_index_is_named():
    with pytest.raises(ValueError, match="expert index 9, outside"):
        check_expert_index(torch.tensor([[0, 9]]), 8)
    with pytest.raises(ValueError, match="expert index -1"):
        check_expert_index(torch.tensor([[-1, 2]]), 8)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_wgrad_on_gpu_matches_reference(impl):
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    sizes = [300, 0, 17, 512, 1]
    x = torch.randn(sum(sizes), 256, generator=g).cuda()
    dy = torch.randn(sum(sizes), 384, generator=g).cuda()
    w = torch.empty(len(sizes), 256, 384, device="cuda", dtype=torch.bfloat16)
    ref = grouped_mm_wgrad(x.double(), dy.double(), sizes, w.double(), impl="reference")
    got = grouped_mm_wgrad(x.bfloat16(), dy.bfloat16(), sizes, w, impl=impl)
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=0.3, msg=f"seed {seed}")


def test_moe_layer_bench_smoke_on_cpu_ranks(tmp_path):
    # The benchmark's whole path (2 gloo ranks, sweep, comm/GEMM alone, summary, traces) runs.
    import json
    import subprocess
    import sys
    out = tmp_path / "moe.json"
    p = subprocess.run([sys.executable, "-m", "longmoe", "bench", "moe-layer", "--smoke",
                        "--device", "cpu", "--out", str(out), "--trace-tokens", "64",
                        "--trace-dir", str(tmp_path / "tr"), "--trace-chunks", "2",
                        "--wgrad", "delayed", "--fp32-matmul", "highest",
                        "--router-matmul", "reference"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads(out.read_text())
    # the flags reach the run
    assert (rep["wgrad"], rep["fp32_matmul"], rep["router_matmul"]) == ("delayed", "highest", "reference")
    kinds = sorted({r["kind"] for r in rep["rows"]})
    assert kinds == ["comm", "gemm", "layer"]
    (s,) = rep["summary"]
    assert s["T"] == 64 and s["best_chunks"] in (1, 2) and s["comm_ms"] > 0 and s["gemm_ms"] > 0
    assert rep["traces"] == ["process_group_T64_C2_rank0.json.gz"] or \
        rep["traces"] == ["process_group_T64_C2_rank1.json.gz"]
    assert "| process_group |" in p.stdout


def test_route_plan_reports_a_bad_index_without_an_extra_sync():
    with pytest.raises(ValueError, match="expert index 8, outside"):
        plan_routes(torch.tensor([[0, 8], [1, 2]]), 8, 1)
    with pytest.raises(ValueError, match="expert index -3"):
        plan_routes(torch.tensor([[-3, 1]]), 8, 1)


@pytest.mark.parametrize("C,L", [(5, 3), (1, 4), (3, 1), (4, 6)])
def test_chunked_wgrad_matches_per_expert_sum(C, L):
    # The delayed weight gradient from chunk-major operands (gathered to expert-major order),
    # with an empty chunk and empty (chunk, expert) groups, against a plain per-segment sum.
    import longmoe.parallel.moe_pipeline as mp
    from longmoe.parallel.expert_parallel import RoutePlan
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    K, N = 7, 4
    rows_CL = torch.randint(0, 4, (C, L), generator=g)
    rows_CL[C // 2] = 0
    plan = RoutePlan([(0, 1)] * C, [], [], [], rows_CL.tolist(), [], torch.zeros(0), rows_CL,
                     list(rows_CL.cumsum(1).to(torch.int32).unbind(0)))
    Mt = int(rows_CL.sum())
    x = torch.randn(Mt, K, dtype=torch.float64, generator=g)
    dy = torch.randn(Mt, N, dtype=torch.float64, generator=g)
    w = torch.zeros(L, K, N, dtype=torch.float64)
    want = torch.zeros_like(w)
    r = 0
    for c in range(C):
        for e in range(L):
            n = int(rows_CL[c, e])
            want[e] += x[r:r + n].T @ dy[r:r + n]
            r += n
    pipe = mp.ChunkPipeline(plan, 1, None, None, None)
    operands = [x, dy]
    got = mp._chunked_wgrad(operands, pipe, w, "reference")
    assert operands == []  # taken over, so each is freed once read
    torch.testing.assert_close(got, want, msg=f"seed {seed}")


def _peak_bytes(fn) -> int:
    """Peak bytes of CPU tensors allocated inside fn and alive at once (the profiler's allocator
    events summed in time order; tensors that existed before fn do not count)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _backward_peak_moments(wgrad, chunks, by, T, K, H, F, E) -> dict[str, int]:
    """Bytes the one-rank fp32 pipeline's backward holds at the moments where it holds the most,
    from the buffer sizes (one rank receives all A = T*K rows). The CPU reference kernels add
    their own temporaries: a grouped GEMM keeps its per-expert products beside their
    concatenation (twice its output), and a combine gathers its rows (once more) and sums them
    (once more in token order), concatenating the chunks' row buffers first where there are
    several. Small per-assignment vectors (the router weights' gradient rows) are left out."""
    from longmoe.parallel.routing import chunk_bounds

    def rows(n, r=T * K):  # r rows of n fp32 columns
        return 4 * r * n

    tok = 4 * T * H         # dX in token order
    dw = 4 * E * 3 * H * F  # dW_in [E, H, 2F] and dW_out [E, F, H]
    operands = rows(H) + rows(2 * F) + rows(F)  # delayed: the layer's dY, dH and SwiGLU output
    if by == "tokens" and chunks > 1:  # dW at the end for either setting; C = 3 here
        r0, r1, r2 = (K * (e - s) for s, e in chunk_bounds(T, chunks))
        return {
            # step 1 combines chunk 0: chunks 0 and 1's dX rows, chunk 0's gathered rows and
            # their sum (every chunk's gradient rows were gathered into dY's operand buffer)
            "combine 0": operands + tok + rows(H, r0 + r1) + rows(H, r0) + 4 * (r0 // K) * H,
            # dW_out's expert-major gathers: the SwiGLU output's copy replaces its buffer, dY's
            # is made beside its buffer, both through one int64 index; chunk 2's dX rows wait
            # for their combine
            "dW_out": operands + rows(H) + 8 * T * K + tok + rows(H, r2)}
    # The combine at the end: every chunk's dX rows, dX, dW, the gathered rows and their sum
    end = rows(H) + tok + dw + rows(H) + tok + (rows(H) if chunks > 1 else 0)
    if chunks > 1:
        # Expert chunks: both settings peak there. A step holds less whatever the routing: at
        # most two row buffers of width H (dX rows, a GEMM's output beside its products, the
        # gradient rows sent ahead), dX, and the delayed operands or the in-chunk dH, SwiGLU
        # output, dW and a chunk's dW before its slice copy.
        step = 2 * rows(H) + tok + max(operands, rows(3 * F) + 2 * dw)
        assert step < end, (step, end)
        return {"combine": end}
    gemm = 2 * rows(H) + tok  # the dX GEMM (output and products) and dX
    gemm += rows(2 * F) + dw if wgrad == "in_chunks" else operands  # dY and a freed, dW made
    return {"combine": end, "dX GEMM": gemm}


@pytest.mark.parametrize("chunks,by", [(1, "experts"), (4, "experts"), (3, "tokens")])
def test_backward_peak_is_what_each_wgrad_schedule_must_hold(chunks, by):
    # In-chunk weight gradients (wgrad="in_chunks") free each chunk's dY rows and SwiGLU output at its
    # step; the delayed schedule holds them for the layer and frees each buffer once its last
    # read is issued. The measured peak of each, exact tensor bytes on one rank, is the larger of
    # the moments above, so a buffer held longer than its last read fails it. Measured (MiB;
    # T 2048, K 2, H 256, F 64, 8 experts): C = 1 in_chunks 13.52, delayed 17.02; C = 4 expert chunks
    # 17.52 both (the CPU combine's copies dominate); C = 3 token chunks 14.38 both (15.01 while
    # each chunk's gradient rows were gathered apart from dY's buffer and copied in). Keeping
    # dY's and the SwiGLU output's buffers to the end of the backward adds 5 MiB to the delayed
    # runs.
    from longmoe.backends.streams import HostStreams
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    T, K, H, F, E = 2048, 2, 256, 64, 8
    cfg = get_preset("tiny").replace(num_experts=E, top_k=K, hidden_size=H, moe_ffn_size=F,
                                     shared_expert_ffn_size=0)
    moe = MoE(cfg)
    init_params(moe, cfg, 0)
    x = torch.randn(1, T, H, requires_grad=True)
    g = torch.randn_like(x)
    peaks, grads = {}, {}
    for wgrad in ("in_chunks", "delayed"):
        # CPU tensors on any machine (the peak counted is the CPU allocator's), so host streams
        moe.dispatcher = ExpertDispatcher(E, None, chunks, None, HostStreams(), pipeline=True,
                                          chunk_by=by)
        moe.dispatcher.wgrad = wgrad
        moe.zero_grad(set_to_none=True)
        y, aux = moe(x)
        peaks[wgrad] = _peak_bytes(lambda: torch.autograd.backward([y, aux],
                                                                   [g, torch.ones_like(aux)]))
        grads[wgrad] = [p.grad.clone() for p in moe.experts.parameters()]
        moments = _backward_peak_moments(wgrad, chunks, by, T, K, H, F, E)
        # slack: the router weights' gradient rows and a few scalars (measured: 16 KiB + 4 B)
        assert 0 <= peaks[wgrad] - max(moments.values()) <= 8 * T * K, (wgrad, peaks, moments)
    if chunks == 1:  # the in-chunk schedule's point: dY's rows and a freed at each step
        assert peaks["in_chunks"] < peaks["delayed"], peaks
    for a, b in zip(grads["in_chunks"], grads["delayed"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _CountingA2A:
    """The process-group transport, counting the rows handed to it."""

    name = "process_group"

    def __init__(self):
        from longmoe.backends.transports import ProcessGroupA2A
        self.inner, self.rows = ProcessGroupA2A(), 0

    def __call__(self, out, inp, *args):
        self.rows += inp.shape[0]
        self.inner(out, inp, *args)


@pytest.mark.parametrize("chunks,by", [(1, "experts"), (3, "experts"), (2, "tokens")])
def test_one_rank_pipeline_moves_no_rows(chunks, by):
    # An EP group of one: no all-to-all has anything to move, so none reaches the transport (each
    # was a full pass over the rows, and the expert-order gathers around it two more); the layer
    # still matches the unpipelined one.
    from longmoe.backends.streams import HostStreams
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    cfg = get_preset("tiny").replace(num_experts=8, top_k=2, hidden_size=64, moe_ffn_size=32)
    moe = MoE(cfg)
    init_params(moe, cfg, 0)
    moe.double()
    seed = random.randrange(2**31)
    x = torch.randn(1, 53, cfg.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed), requires_grad=True)
    out = {}
    for name in ("direct", "pipeline"):
        tr = _CountingA2A()
        moe.dispatcher = (ExpertDispatcher(8) if name == "direct" else
                          ExpertDispatcher(8, None, chunks, tr, HostStreams(), pipeline=True,
                                           chunk_by=by))
        moe.zero_grad(set_to_none=True)
        x.grad = None
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [torch.ones_like(y), torch.ones_like(aux)])
        out[name] = [y.detach(), x.grad] + [p.grad for p in moe.parameters()]
        assert tr.rows == 0, (name, tr.rows)
    for a, b in zip(out["direct"], out["pipeline"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"seed {seed}")


def _one_rank_layer(route: str):
    """A tiny fp64 MoE layer whose router sends no token to experts 6 and 7 (so an expert chunk
    can be empty); route="underflow" also makes every token pick expert 0 with a weight that
    underflows to exactly 0 (the router-weight gradient's w = 0 case)."""
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    cfg = get_preset("tiny").replace(num_experts=8, top_k=2, hidden_size=64, moe_ffn_size=32,
                                     expert_bias_rate=1e-3)
    moe = MoE(cfg)
    init_params(moe, cfg, 0)
    moe.double()
    with torch.no_grad():
        moe.router.expert_bias[6:] = -10.0  # scores are probabilities plus this bias
        if route == "underflow":
            moe.router.weight[0] = -10.0    # with positive inputs: logit 0 is ~1e3 below logit 1
            moe.router.weight[1] = 10.0
            moe.router.expert_bias[0] = 10.0
    return moe


@pytest.mark.parametrize("chunks,by,wgrad,route", [
    (1, "experts", "auto", "spread"), (2, "experts", "in_chunks", "spread"),
    (3, "experts", "in_chunks", "spread"),  # unequal expert chunks (3, 3, 2): offsets apart
    (4, "experts", "in_chunks", "spread"), (4, "experts", "delayed", "spread"),
    (4, "experts", "auto", "spread"), (3, "tokens", "in_chunks", "spread"),
    (4, "experts", "in_chunks", "underflow")])
def test_one_rank_pipeline_matches_unpipelined_every_gradient(chunks, by, wgrad, route):
    # The one-rank pipeline (one gather for every chunk's expert inputs, per-chunk views from one
    # split, weight-gradient slice copies before the dX GEMM, the router weights' gradient rows
    # concatenated once) against the unpipelined layer: an odd token count, an expert chunk
    # without rows, output and every gradient in fp64.
    from longmoe.backends.streams import HostStreams
    from longmoe.parallel.expert_parallel import ExpertDispatcher
    moe = _one_rank_layer(route)
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 37, 64, dtype=torch.float64, generator=g)
    x = (x.abs() + 0.1 if route == "underflow" else x).requires_grad_()
    gy = torch.randn(1, 37, 64, dtype=torch.float64, generator=g)
    out = {}
    for name in ("direct", "pipeline"):
        moe.dispatcher = (ExpertDispatcher(8) if name == "direct" else
                          ExpertDispatcher(8, None, chunks, None, HostStreams(), pipeline=True,
                                           chunk_by=by))
        moe.dispatcher.wgrad = wgrad
        moe.zero_grad(set_to_none=True)
        x.grad = None
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [gy, torch.ones_like(aux)])
        out[name] = [y.detach(), x.grad] + [p.grad for p in moe.parameters()]
    idx = moe.router(x.detach().view(37, 64))[0]
    assert not (idx >= 6).any()
    if route == "underflow":
        w = moe.router(x.detach().view(37, 64))[1]
        assert (idx == 0).any(-1).all() and (w[idx == 0] == 0).all()
    assert all(t is not None and t.abs().sum() > 0 for t in out["pipeline"])
    for a, b in zip(out["direct"], out["pipeline"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=f"seed {seed}")


def test_one_rank_chunk_issues_few_host_ops():
    # Host time: what each extra chunk adds to a layer step (forward and backward), counted as
    # the torch operations issued, with the CPU reference kernels (several operations each where
    # a GPU launches one: 23.7 of the count). Measured: 32.0 per chunk with expert chunks (C = 1
    # 336 operations, C = 4 432; one chunk sorts its routes without chunk ids, so part of the
    # difference is C = 4's fixed work); 31.3 (349, 443) before the route plan and the last
    # combine lost their one-chunk and zero-fill work; 34.7 while each chunk gathered its own
    # gradient rows and one rank split per-chunk token and routing-weight lists it never read;
    # 48.7 when every chunk sliced its weights, offsets, row buffers and gradient rows itself.
    # test_one_rank_chunk_host_work_per_chunk counts the pipeline's own work apart.
    from torch.utils._python_dispatch import TorchDispatchMode
    from longmoe.backends.streams import HostStreams
    from longmoe.config import get_preset
    from longmoe.model.moe import MoE
    from longmoe.model.transformer import init_params
    from longmoe.parallel.expert_parallel import ExpertDispatcher

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    cfg = get_preset("tiny").replace(num_experts=8, top_k=2, hidden_size=16, moe_ffn_size=8,
                                     shared_expert_ffn_size=0)
    moe = MoE(cfg)
    init_params(moe, cfg, 0)
    x = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(0), requires_grad=True)
    ops = {}
    for C in (1, 4):
        moe.dispatcher = ExpertDispatcher(8, None, C, None, HostStreams(), pipeline=True)
        moe.dispatcher.wgrad = "in_chunks"
        with Count() as count:
            y, aux = moe(x)
            torch.autograd.backward([y, aux], [torch.ones_like(y), torch.ones_like(aux)])
        ops[C] = count.n
    assert (ops[4] - ops[1]) / 3 <= 33, ops


@pytest.mark.parametrize("ranks,chunks,by,expected", [
    (1, 1, "experts", True),    # one chunk writes all of dW: no slice copy, operands freed early
    (1, 4, "experts", False),   # one rank, several chunks: nothing runs under them, copies do
    (2, 4, "experts", True),    # the all-to-alls run beside them
    (2, 1, "tokens", True),
    (2, 3, "tokens", False),    # token chunks share every expert: never in the chunks
])
def test_auto_wgrad_schedule(ranks, chunks, by, expected):
    # The schedule "auto" picks from the plan's shape alone; the explicit settings are what
    # they say wherever the chunk owns its experts.
    from types import SimpleNamespace
    plan = SimpleNamespace(send=[[0] * ranks], bounds=[(0, 1)] * chunks,
                           expert_bounds=[(0, 1)] * chunks if by == "experts" else None)
    pick = {w: mp.ChunkPipeline(plan, 2, None, None, None, wgrad=w).wgrad_in_chunks()
            for w in mp.WGRAD}
    owns = by == "experts" or chunks == 1
    assert pick == {"auto": expected, "in_chunks": owns, "delayed": False}, pick


# What a layer step issues beyond the unpipelined layer, counted as launches: each grouped GEMM,
# weight gradient and row kernel call counts once (as a GPU launches it), every other torch
# operation (views included) once, and the stream calls apart (longmoe/bench/host_ops.py).
# Measured (one rank, wgrad in_chunks; T 64, top-2, 8 experts, H 16, F 8, and the same at T 2048,
# top-8, 64 experts, H 256, F 128): unpipelined 97; expert chunks C = 1 / 2 / 4: 118 / 147 / 167
# with 0 / 8 / 16 stream calls beside the backward's 3 fixed ones, so 10 per chunk (its four
# grouped GEMMs, two weight gradients, SwiGLU and its backward: the unpipelined layer's eight,
# and its two dW slice copies) and 4 stream calls (the copies' wait, two record_streams, the
# stream switch) over 30 fixed; the delayed schedule 120 / 143 / 155: 6 per chunk, its kernels
# alone, over 34 fixed (the end-of-layer weight gradients' gather index and offsets). Before:
# 131 / 156 / 178 with 11 per chunk (a slice of the offsets per chunk) and 6 stream calls (two
# waits per chunk on dispatch marks one rank never makes); delayed 7 per chunk.
# Per wgrad schedule: (operations, stream calls) per expert chunk, and the operations beyond the
# unpipelined layer at C >= 2 (splits, dW buffers, route keys, the router weights' cat).
# "auto" is the delayed schedule on one rank with several chunks (test_auto_wgrad_schedule).
PER_CHUNK = {"in_chunks": (10, 4, 30), "delayed": (6, 0, 34), "auto": (6, 0, 34)}


@pytest.mark.parametrize("wgrad", ["in_chunks", "delayed", "auto"])
def test_one_rank_chunk_host_work_per_chunk(wgrad):
    # A chunk issues its kernels, its dW slice copies and their stream calls, nothing else: each
    # further chunk adds PER_CHUNK's counts, and a chunked layer stays within its fixed count of
    # the unpipelined layer beyond that. Per-chunk host work brought back (a view, a small
    # tensor, a wait) fails it.
    from longmoe.bench.host_ops import count_case, cpu_dispatcher, tiny_layer
    moe, x, gy = tiny_layer(T=64, K=2, E=8, H=16, F=8)
    ops, calls = {}, {}
    for C in (0, 2, 4):
        moe.dispatcher = cpu_dispatcher(8, C, "experts", wgrad)
        counter, streams = count_case(moe, x, gy, fold_kernels=True)
        ops[C], calls[C] = counter.n, sum(streams.values())
        if C:
            # the kernels themselves: four grouped GEMMs and SwiGLU's two per chunk
            assert counter.ops["grouped_mm"] == 4 * C and counter.ops["swiglu"] == C, counter.ops
    per_op, per_call, fixed = PER_CHUNK[wgrad]
    assert ops[4] - ops[2] <= 2 * per_op, ops
    assert calls[4] - calls[2] <= 2 * per_call, calls
    for C in (2, 4):
        assert ops[C] <= ops[0] + fixed + per_op * C, ops
