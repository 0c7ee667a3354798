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
