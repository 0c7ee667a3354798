"""The compiled Gated DeltaNet core (`chunked_compiled`) runs the eager chunked form's pieces under
torch.compile. On CPU: both pieces trace as single graphs (no graph breaks, so inductor can fuse
all of each on a GPU) and, run through those graphs, give the eager outputs and gradients
exactly; the impl declines CPU tensors and auto falls back to the eager form."""

import pytest
import torch

from longmoe.ops import gated_delta as gd


def _leaves(B, T, Hk, Hv, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return [x.requires_grad_() for x in (r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv),
                                         -torch.rand(B, T, Hv, generator=g) * 3,
                                         torch.rand(B, T, Hv, generator=g))]


@pytest.mark.parametrize("T,chunk,with_state", [(150, 64, False), (37, 16, True)])
def test_traced_pieces_match_eager(T, chunk, with_state):
    torch._dynamo.reset()
    leaves = _leaves(2, T, 2, 4, 16, 12, seed=T)
    s0 = torch.randn(2, 4, 16, 12, requires_grad=True) if with_state else None
    kw = dict(backend="aot_eager", fullgraph=True, dynamic=False)
    terms = torch.compile(gd._chunk_terms, **kw)
    output = torch.compile(gd._chunk_output, **kw)
    o1, S1 = gd._chunked_with(terms, output, *leaves, s0, chunk)
    o2, S2 = gd._chunked(*leaves, initial_state=s0, chunk=chunk)
    w = torch.randn(o1.shape)
    inputs = leaves + ([s0] if with_state else [])
    g1 = torch.autograd.grad((o1 * w).sum() + S1.sum(), inputs)
    g2 = torch.autograd.grad((o2 * w).sum() + S2.sum(), inputs)
    assert o1.shape == (2, T, 4, 12)
    torch.testing.assert_close(o1, o2, rtol=0, atol=1e-6)
    torch.testing.assert_close(S1, S2, rtol=0, atol=1e-6)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_declines_cpu_and_auto_falls_back():
    leaves = _leaves(1, 8, 1, 1, 4, 4, seed=0)
    assert "GPU" in gd.GATED_DELTA.why_not("chunked_compiled", *leaves)
    assert gd.GATED_DELTA.select("auto", *leaves).name == "chunked"


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("halo", [False, True])
def test_causal_conv_matches_conv1d(dtype, tol, halo):
    """The shifted multiply-add conv (and its traced graph) against F.conv1d on the transposed
    input: outputs and gradients of input, weight and halo."""
    from longmoe.model.deltanet import causal_conv_silu
    g = torch.Generator().manual_seed(7)
    B, S, C, K = 2, 29, 6, 4
    x = torch.randn(B, S, C, generator=g).to(dtype).requires_grad_()
    w = torch.randn(C, K, generator=g).to(dtype).requires_grad_()
    h = torch.randn(B, K - 1, C, generator=g).to(dtype).requires_grad_() if halo else None

    def ref(x, w, h):
        xt = torch.cat([h if h is not None else x.new_zeros(B, K - 1, C), x], 1).transpose(1, 2)
        y = torch.nn.functional.conv1d(xt.double(), w.double()[:, None], groups=C)
        return torch.nn.functional.silu(y).transpose(1, 2)

    leaves = [x, w] + ([h] if halo else [])
    dy = torch.randn(B, S, C, generator=g, dtype=torch.float64)
    want = ref(x, w, h)
    want_grads = [t.double() for t in torch.autograd.grad(want, leaves, dy)]
    traced = torch.compile(causal_conv_silu, backend="aot_eager", fullgraph=True, dynamic=False)
    for fn in (causal_conv_silu, traced):
        got = fn(x, w, h)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
        for a, b in zip(torch.autograd.grad(got.double(), leaves, dy), want_grads):
            torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * 4)


def test_gated_norm_traces_and_matches():
    from longmoe.model.deltanet import gated_rms_norm
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 3, 16, generator=g, requires_grad=True)           # the core's fp32 output
    z = torch.randn(2, 9, 3, 16, generator=g).bfloat16().requires_grad_()
    w = torch.rand(16, generator=g, requires_grad=True)
    traced = torch.compile(gated_rms_norm, backend="aot_eager", fullgraph=True, dynamic=False)
    a = traced(x, z, w, 1e-6, torch.bfloat16)
    b = gated_rms_norm(x.bfloat16(), z, w, 1e-6)
    assert a.dtype == torch.bfloat16
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    for ga, gb in zip(torch.autograd.grad(a.float().sum(), (x, z, w)),
                      torch.autograd.grad(b.float().sum(), (x, z, w))):
        torch.testing.assert_close(ga, gb)


@pytest.mark.needs_cuda
@pytest.mark.parametrize("precision,tol", [("highest", 2e-4), ("high", 2e-2)])
def test_compiled_core_on_gpu_matches_recurrent(precision, tol):
    """On a GPU: the compiled core (fp32, and with TF32 matmuls) against the one-token-at-a-time
    definition, odd length, GQA heads, an initial state; outputs and every gradient."""
    from longmoe.backends import active_backend
    dev = active_backend().device(0)
    cpu = _leaves(2, 203, 2, 4, 32, 24, seed=11)
    leaves = [x.detach().to(dev).requires_grad_() for x in cpu]
    s0 = torch.randn(2, 4, 32, 24, device=dev, requires_grad=True)
    w = torch.randn(2, 203, 4, 24, device=dev)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        o, S = gd.gated_delta_rule(*leaves, initial_state=s0, impl="chunked_compiled")
        got = [o, S, *torch.autograd.grad((o * w).sum() + S.sum(), leaves + [s0])]
    finally:
        torch.set_float32_matmul_precision(old)
    ref_in = [x.detach().double().requires_grad_() for x in leaves + [s0]]
    o, S = gd.gated_delta_rule(*ref_in[:5], initial_state=ref_in[5], impl="reference")
    want = [o, S, *torch.autograd.grad((o * w.double()).sum() + S.sum(), ref_in)]
    for a, b in zip(got, want):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < tol, (precision, err)


@pytest.mark.needs_cuda
def test_fused_layer_on_gpu_matches_eager():
    """A Gated DeltaNet layer in bf16 on a GPU: the compiled conv, core and gated norm, and the
    eager path (F.conv1d, eager core, eager norm), each against the same layer in fp32. Both
    round differently in bf16 (on an H200 they differ by up to 5.6% of the conv-weight
    gradient's largest entry), so the fused path must be about as close to fp32 as the eager
    one, not equal to it."""
    import copy

    from longmoe.backends import active_backend
    from longmoe.config import get_preset
    from longmoe.model.deltanet import GatedDeltaNet
    dev = active_backend().device(0)
    cfg = get_preset("tiny-hybrid")
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg).to(dev)
    layer.reset_parameters(torch.Generator(device=dev).manual_seed(0))
    x = torch.randn(2, 131, cfg.hidden_size, device=dev)

    def run(mod, impl, dtype):
        mod.impl = impl
        xi = x.to(dtype).requires_grad_()
        y = mod(xi)
        grads = torch.autograd.grad(y.float().square().sum(),
                                    [xi, mod.conv1d.weight, mod.norm.weight])
        return [y.detach().float(), *[t.float() for t in grads]]

    truth = run(copy.deepcopy(layer).float(), "chunked", torch.float32)
    bf16 = copy.deepcopy(layer).to(torch.bfloat16)
    fused, eager = run(bf16, "auto", torch.bfloat16), run(bf16, "chunked", torch.bfloat16)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    for name, f, e, t in zip(("y", "dx", "dconv", "dnorm"), fused, eager, truth):
        assert rel(f, t) <= max(2 * rel(e, t), 1e-2), (name, rel(f, t), rel(e, t))
