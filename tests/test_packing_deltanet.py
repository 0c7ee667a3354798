"""Gated DeltaNet over packed rows: every core that runs on CPU (the recurrent reference, the
chunked core, the compiled core through the partitioner inductor uses, the Triton state scan
under the interpreter) restarts its state where a sample begins, exactly: each sample's outputs
and gradients equal running it alone. So do the masked short convolution, fla's variable-length
plumbing (against an emulated kernel; fla itself needs a GPU) and the whole layer.

Legend: B rows, T tokens, Hk/Hv key/value heads, dk/dv head dims, C conv channels.
"""

import contextlib
import random

import pytest
import torch

from longmoe.model.packing import PackedRows
from longmoe.ops import gated_delta as gd
from longmoe.ops.compiled import forced
from longmoe.paired.harness import TOLERANCE, rel_err
from _packed_rows import samples_of as _samples
from _interpreter import last_json_line, run_interpreted

F32 = TOLERANCE[torch.float32]
T = 70
# Row 0: one-token sample, starts inside chunks and exactly at chunk boundaries (16, 32, 64),
# padding; row 1: one sample exactly the row length.
ROWS = [[1, 15, 16, 3, 29, 4], [T]]


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(random.randrange(2**31))



def _leaves(gen, B, T, Hk=2, Hv=4, dk=8, dv=6, dtype=torch.float32):
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g = -torch.rand(B, T, Hv, generator=gen, dtype=torch.float64) * 3
    beta = torch.rand(B, T, Hv, generator=gen, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (r(B, T, Hk, dk), r(B, T, Hk, dk),
                                                   r(B, T, Hv, dv), g, beta)]


def _alone_reference(leaves, w, rows, s0=None):
    """Each sample through the recurrent definition on its own, written into the packed
    layout: (o, d leaves..., final states per row); a row's first sample continues from s0[r]
    when given."""
    o = torch.zeros(w.shape, dtype=torch.float64)
    grads = [torch.zeros(x.shape, dtype=torch.float64) for x in leaves]
    finals = [None] * w.shape[0]
    for r, a, n in _samples(rows):
        sl = slice(a, a + n)
        part = [x.detach()[r:r + 1, sl].double().requires_grad_() for x in leaves]
        init = None if s0 is None or a else s0[r:r + 1].double()
        out, S = gd.gated_delta_rule(*part, initial_state=init, impl="reference")
        d = torch.autograd.grad((out * w[r:r + 1, sl]).sum(), part)
        for acc, t in zip([o, *grads], [out, *d]):
            acc[r:r + 1, sl] = t
        finals[r] = S[0]
    return o, grads, torch.stack(finals)


def _check(fn, gen, rows=ROWS, with_state=False, tol=F32):
    p = PackedRows.from_lengths(rows, T)
    leaves = _leaves(gen, 2, T)
    w = torch.randn(2, T, 4, 6, generator=gen, dtype=torch.float64)
    starts = p.starts.clone()
    s0 = None
    if with_state:  # pieces that begin mid-sample: each row's first sample continues a state
        starts[:, 0] = False
        s0 = torch.randn(2, 4, 8, 6, generator=gen)
    o, S = fn(*leaves, s0, starts)
    got = [o, *torch.autograd.grad((o.double() * w).sum(), leaves)]
    o_ref, g_ref, S_ref = _alone_reference(leaves, w, rows, s0 if with_state else None)
    real = ~p.padding
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, [o_ref, *g_ref]):
        assert rel_err(a[real], b[real]) < tol, (name, gen.initial_seed())
    if rows[-1] == [T]:
        assert rel_err(S[1], S_ref[1]) < tol, gen.initial_seed()  # a full row's final state


CORES = {
    "reference": lambda *a: gd.gated_delta_rule(*a[:5], initial_state=a[5], starts=a[6],
                                                impl="reference"),
    "chunked-64": lambda *a: gd._chunked(*a[:5], initial_state=a[5], starts=a[6]),
    "chunked-16": lambda *a: gd._chunked(*a[:5], initial_state=a[5], starts=a[6], chunk=16),
    "chunked-4": lambda *a: gd._chunked(*a[:5], initial_state=a[5], starts=a[6], chunk=4),
}


@pytest.mark.parametrize("core", list(CORES))
@pytest.mark.parametrize("with_state", [False, True])
def test_core_packed_equals_each_sample_alone(gen, core, with_state):
    _check(CORES[core], gen, with_state=with_state)


def test_compiled_core_packed_equals_alone(gen):
    # The GPU core's traced pieces (masks included) through the partitioner inductor uses.
    torch._dynamo.reset()
    with forced("aot_eager_decomp_partition"):
        assert gd.GATED_DELTA.why_not("chunked_compiled", *_leaves(gen, 1, 4)) is None
        _check(lambda *a: gd.gated_delta_rule(*a[:5], initial_state=a[5], starts=a[6],
                                              impl="chunked_compiled"), gen, with_state=True)


def test_a_leaking_state_is_caught(gen):
    # Without the resets the packed row's later samples read earlier ones: the check fails.
    with pytest.raises(AssertionError):
        _check(lambda *a: gd._chunked(*a[:5], initial_state=a[5]), gen)


def test_starts_are_checked():
    leaves = _leaves(torch.Generator().manual_seed(0), 1, 5)
    with pytest.raises(ValueError, match="starts must be bool"):
        gd.gated_delta_rule(*leaves, starts=torch.ones(1, 5, dtype=torch.long))


def test_triton_scan_with_resets_under_the_interpreter():
    """The chunked core with the one-launch Triton state scan (dk = 16) on packed rows, under
    TRITON_INTERPRET=1, against each sample alone through the recurrent definition in fp64."""
    code = (
        "import json, torch\n"
        "from longmoe.model.packing import PackedRows\n"
        "from longmoe.ops import gated_delta as gd\n"
        "torch.manual_seed(%d)\n"
        "rows = [[1, 20, 16, 30, 13], [80]]\n"
        "p = PackedRows.from_lengths(rows, 80)\n"
        "assert gd._scan_kernel(torch.zeros(1, 1, 16, 16)) is not None\n"
        "B, T = 2, 80\n"
        "mk = lambda *s: torch.randn(*s).requires_grad_()\n"
        "leaves = [mk(B, T, 1, 16), mk(B, T, 1, 16), mk(B, T, 2, 16),\n"
        "          (-torch.rand(B, T, 2) * 3).requires_grad_(),\n"
        "          torch.rand(B, T, 2).requires_grad_()]\n"
        "o, _ = gd._chunked(*leaves, starts=p.starts, chunk=16)\n"
        "w = torch.randn(o.shape)\n"
        "got = [o] + list(torch.autograd.grad((o * w).sum(), leaves))\n"
        "want = [torch.zeros(t.shape, dtype=torch.float64) for t in got]\n"
        "for r, lengths in enumerate(rows):\n"
        "    a = 0\n"
        "    for n in lengths:\n"
        "        part = [x.detach()[r:r+1, a:a+n].double().requires_grad_() for x in leaves]\n"
        "        out, _ = gd._recurrent(*part)\n"
        "        gs = torch.autograd.grad((out * w[r:r+1, a:a+n].double()).sum(), part)\n"
        "        for acc, t in zip(want, [out, *gs]):\n"
        "            acc[r:r+1, a:a+n] = t\n"
        "        a += n\n"
        "print(json.dumps([float((x.double() - y).abs().max() / y.abs().max())\n"
        "                  for x, y in zip(got, want)]))\n") % random.randrange(2**31)
    p = run_interpreted(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    errs = last_json_line(p.stdout)
    assert max(errs) < F32, errs


# ---- fla's variable-length form ----------------------------------------------------------------

def _emulated_fla(q, k, v, g, beta, initial_state=None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=None):
    """fla's chunk_gated_delta_rule contract for flattened rows (batch 1, every cu_seqlens run
    its own sequence with its own initial state), written with the recurrent definition:
    checks our flattening, initial and final states without fla's GPU kernels."""
    assert q.shape[0] == 1 and use_qk_l2norm_in_kernel and output_final_state
    outs, finals = [], []
    for i in range(cu_seqlens.numel() - 1):
        sl = slice(int(cu_seqlens[i]), int(cu_seqlens[i + 1]))
        h0 = None if initial_state is None else initial_state[i:i + 1]
        o, S = gd._recurrent(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], h0)
        outs.append(o)
        finals.append(S[0])
    return torch.cat(outs, 1), torch.stack(finals)


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("given_cu", [False, True])
def test_fla_varlen_plumbing(gen, with_state, given_cu):
    def fn(q, k, v, g, beta, s0, starts):
        rep = v.shape[2] // k.shape[2]
        q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))  # as _fla does
        b = starts.clone()
        b[:, 0] = True
        first = b.reshape(-1).nonzero()[:, 0]
        cu = torch.cat([first, first.new_full((1,), b.numel())]).to(torch.int32)
        return gd._fla_packed(_emulated_fla, q, k, v, g, beta, s0, starts, cu if given_cu else None)
    _check(fn, gen, with_state=with_state)


def test_fla_declines_cpu():
    assert "GPU" in gd.GATED_DELTA.why_not("fla", *_leaves(torch.Generator().manual_seed(0), 1, 4))


# ---- the short convolution and the layer -------------------------------------------------------

@pytest.mark.parametrize("halo", [False, True])
@pytest.mark.parametrize("traced", [False, True])
def test_masked_conv_equals_each_sample_alone(gen, halo, traced):
    from longmoe.model.deltanet import causal_conv_silu
    B, S, C, K = 2, 23, 5, 4
    rows = [[1, 2, 9, 7, 3], [S]]
    p = PackedRows.from_lengths(rows, S)
    x = torch.randn(B, S, C, generator=gen, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(C, K, generator=gen, dtype=torch.float64, requires_grad=True)
    h = torch.randn(B, K - 1, C, generator=gen, dtype=torch.float64, requires_grad=True)
    history = p.history.clone()
    if halo:  # the row continues a sample from before this piece: its first 4 tokens read the halo
        history[0, :1] += 10
        history[1] += 10
    fn = causal_conv_silu
    if traced:
        fn = torch.compile(causal_conv_silu, backend="aot_eager", fullgraph=True, dynamic=False)
    y = fn(x, wt, h if halo else None, history)
    dy = torch.randn(B, S, C, generator=gen, dtype=torch.float64)
    dy[p.padding] = 0
    got = torch.autograd.grad((y * dy).sum(), (x, wt, h) if halo else (x, wt))
    want_y = torch.zeros_like(y)
    for r, a, n in _samples(rows):
        # the sample alone, its conv history: the halo when it continues from before the row
        hist_in = h[r:r + 1] if halo and a == 0 else torch.zeros(1, K - 1, C, dtype=torch.float64)
        xi = torch.cat([hist_in, x[r:r + 1, a:a + n]], 1).transpose(1, 2)
        yi = torch.nn.functional.silu(torch.nn.functional.conv1d(xi, wt[:, None], groups=C))
        want_y[r:r + 1, a:a + n] = yi.transpose(1, 2)
    want = torch.autograd.grad((want_y * dy).sum(), (x, wt, h) if halo else (x, wt))
    assert rel_err(y[~p.padding], want_y[~p.padding]) < 1e-12
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-12


def test_a_leaking_conv_is_caught(gen):
    # The check above can fail: without the history mask a sample's first K-1 tokens read the
    # inputs before it; from the K-th token on every tap lies inside the sample again.
    from longmoe.model.deltanet import causal_conv_silu
    rows = [[5, 9, 3], [17]]
    p = PackedRows.from_lengths(rows, 17)
    x = torch.randn(2, 17, 5, generator=gen, dtype=torch.float64)
    wt = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    good, leaky = causal_conv_silu(x, wt, None, p.history), causal_conv_silu(x, wt)
    assert rel_err(good[1], leaky[1]) < 1e-12  # one sample per row: nothing to leak
    assert rel_err(leaky[0, :5], good[0, :5]) < 1e-12  # the row's first sample
    for start in (5, 14):  # the first K-1 = 3 tokens of each later sample
        assert rel_err(leaky[0, start:start + 3], good[0, start:start + 3]) > 1e-3
    assert rel_err(leaky[0, 8:14], good[0, 8:14]) < 1e-12  # the second sample's 4th token on


class _Leaky:
    """A packing that keeps one restart and drops the other: `conv` leaks the short convolution
    across sample boundaries (history of unpacked rows), `state` the recurrent state (starts of
    unpacked rows). Everything else is the real packing's."""

    def __init__(self, p, leak):
        plain = PackedRows.unpacked(*p.shape)
        self.history = plain.history if leak == "conv" else p.history
        self.starts = plain.starts if leak == "state" else p.starts
        self.cu_seqlens = plain.cu_seqlens if leak == "state" else p.cu_seqlens


@pytest.mark.parametrize("impl,compiled_path", [("reference", False), ("chunked", False),
                                                ("chunked_compiled", True)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layer_packed_equals_each_sample_alone(gen, impl, compiled_path, dtype):
    errs = _layer_check(gen, impl, compiled_path, dtype)
    # the core computes in fp32 whatever the layer's dtype
    assert max(errs.values()) < LAYER_TOL, (errs, gen.initial_seed())


@pytest.mark.parametrize("leak", ["conv", "state"])
@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_a_layer_leaking_conv_or_state_is_caught(gen, impl, leak):
    # Each restart alone is needed: dropping either one fails the layer's check, outputs and
    # input gradients alike. Mild decay (A in [0.1, 1), the low end of the range checkpoints
    # hold): under the default init's A of up to 16 a leaked state fades within a few tokens.
    errs = _layer_check(gen, impl, False, torch.float32, leak=leak, mild_decay=True)
    assert min(errs["y"], errs["dx"]) > 10 * LAYER_TOL, (errs, gen.initial_seed())


LAYER_TOL = 5 * F32


def _layer_check(gen, impl, compiled_path, dtype, leak=None, mild_decay=False):
    """Relative errors of the layer on packed rows (`leak`: a _Leaky packing) against each
    sample alone: output, input gradient, every parameter gradient."""
    from longmoe.config import get_preset
    from longmoe.model.deltanet import GatedDeltaNet
    if compiled_path:
        torch._dynamo.reset()
    cfg = get_preset("tiny-hybrid")
    layer = GatedDeltaNet(cfg).to(dtype)
    with torch.no_grad():
        for prm in layer.parameters():
            prm.copy_(torch.randn(prm.shape, generator=gen, dtype=torch.float64) * 0.3)
    layer.reset_parameters(gen)
    if mild_decay:
        with torch.no_grad():
            layer.A_log.copy_((torch.rand(layer.A_log.shape, generator=gen) * 0.9 + 0.1).log())
    layer.impl = impl
    S = 45
    rows = [[1, 14, 3, 20], [S]]
    p = PackedRows.from_lengths(rows, S)
    x = torch.randn(2, S, cfg.hidden_size, generator=gen, dtype=torch.float64)
    w = torch.randn(2, S, cfg.hidden_size, generator=gen, dtype=torch.float64)
    w[p.padding] = 0  # padding carries no loss
    params = list(layer.parameters())

    def run(xin, packing=None):
        xi = xin.to(dtype).requires_grad_()
        y = layer(xi, packing=packing)
        return y, torch.autograd.grad((y.double() * w_now).sum(), [xi] + params)

    with forced("aot_eager_decomp_partition") if compiled_path else contextlib.nullcontext():
        w_now = w
        y, grads = run(x, p if leak is None else _Leaky(p, leak))
        want = [torch.zeros(t.shape, dtype=torch.float64) for t in (y, x, *grads[1:])]
        for r, a, n in _samples(rows):
            w_now = w[r:r + 1, a:a + n]
            ya, ga = run(x[r:r + 1, a:a + n])
            want[0][r:r + 1, a:a + n], want[1][r:r + 1, a:a + n] = ya.detach(), ga[0]
            for acc, g in zip(want[2:], ga[1:]):
                acc += g.double()
    real = ~p.padding
    errs = {"y": rel_err(y[real], want[0][real]), "dx": rel_err(grads[0][real], want[1][real])}
    for (name, _), g, gr in zip(layer.named_parameters(), grads[1:], want[2:]):
        errs[name] = rel_err(g, gr)
    return errs


# ---- GPUs --------------------------------------------------------------------------------------

@pytest.mark.needs_cuda
@pytest.mark.parametrize("impl,tol", [("fla", 2e-3), ("chunked_compiled", 2e-4), ("chunked", 2e-4)])
@pytest.mark.parametrize("with_state", [False, True])
def test_gpu_cores_on_packed_rows_match_the_recurrent_reference(impl, tol, with_state):
    """fla's variable-length kernels and the compiled core (with the Triton state scan) on
    packed rows of the model's head dims, fp32 (IEEE matmuls), against the recurrent definition
    with the same resets on CPU (itself checked against each sample alone above)."""
    from longmoe.backends import active_backend
    if impl == "fla":
        pytest.importorskip("fla.ops.gated_delta_rule")
    dev = active_backend().device(0)
    rows = [[1, 200, 64, 77, 130], [600]]
    p = PackedRows.from_lengths(rows, 600)
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    cpu = _leaves(gen, 2, 600, Hk=2, Hv=4, dk=128, dv=128)
    starts = p.starts.clone()
    s0 = None
    if with_state:
        starts[:, 0] = False
        s0 = torch.randn(2, 4, 128, 128, generator=gen) * 0.1
    w = torch.randn(2, 600, 4, 128, generator=gen)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        leaves = [x.detach().to(dev).requires_grad_() for x in cpu]
        o, S = gd.gated_delta_rule(*leaves, initial_state=None if s0 is None else s0.to(dev),
                                   impl=impl, starts=starts.to(dev))
        got = [o, S, *torch.autograd.grad((o * w.to(dev)).sum(), leaves)]
    finally:
        torch.set_float32_matmul_precision(old)
    ref_in = [x.detach().double().requires_grad_() for x in cpu]
    o, S = gd.gated_delta_rule(*ref_in, initial_state=None if s0 is None else s0.double(),
                               impl="reference", starts=starts)
    want = [o, S, *torch.autograd.grad((o * w.double()).sum(), ref_in)]
    for name, a, b in zip(("o", "S", "dq", "dk", "dv", "dg", "dbeta"), got, want):
        assert rel_err(a, b) < tol, (impl, name)
