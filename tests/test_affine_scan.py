"""AffineScan (the chunked Gated DeltaNet core's state recurrence, with a hand-written backward)
against the plain autograd loop: states and the gradients of M, N and the initial state."""

import pytest
import torch

from longmoe.ops.gated_delta import AffineScan, affine_scan_reference
from _interpreter import last_json_line, run_interpreted


@pytest.mark.parametrize("n,b,dk,dv", [(1, 1, 3, 2), (7, 3, 5, 4), (33, 2, 16, 9)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_affine_scan_matches_loop(n, b, dk, dv, dtype, tol):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    # Transitions like the delta rule's: a decay times identity minus a small rank update,
    # so the states neither vanish nor blow up over 33 steps.
    decay = torch.rand(n, b, 1, 1, generator=g, dtype=dtype) * 0.5 + 0.5
    low = torch.randn(n, b, dk, dk, generator=g, dtype=dtype) * (0.3 / dk)
    leaves = [decay * torch.eye(dk, dtype=dtype) - low,
              torch.randn(n, b, dk, dv, generator=g, dtype=dtype),
              torch.randn(b, dk, dv, generator=g, dtype=dtype)]
    upstream = torch.randn(n + 1, b, dk, dv, generator=g, dtype=dtype)
    outs, grads = [], []
    for fn in (AffineScan.apply, affine_scan_reference):
        xs = [x.clone().requires_grad_() for x in leaves]
        y = fn(*xs)
        (y * upstream).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad for x in xs])
    scale = outs[1].abs().max()
    assert (outs[0] - outs[1]).abs().max() <= tol * scale
    for a, r in zip(*grads):
        assert (a - r).abs().max() <= tol * r.abs().max() * n, (a - r).abs().max()


def test_affine_scan_gradcheck():
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 2, 3, 3, generator=g, dtype=torch.float64) * 0.5,
          torch.randn(4, 2, 3, 2, generator=g, dtype=torch.float64),
          torch.randn(2, 3, 2, generator=g, dtype=torch.float64)]
    assert torch.autograd.gradcheck(AffineScan.apply, [x.requires_grad_() for x in xs])


def test_triton_scan_matches_the_loop_under_the_interpreter():
    """The one-launch Triton scan (forward and adjoint) on CPU under TRITON_INTERPRET=1 against
    the plain loop in fp64: odd step counts and column counts (partial column tiles), one step,
    dk 16..64; outputs and the gradients of M, N and S0."""
    code = (
        "import json, torch\n"
        "from longmoe.ops.gated_delta import AffineScan, affine_scan_reference, _scan_kernel\n"
        "torch.manual_seed(1)\n"
        "out = []\n"
        "for n, B, D, V in ((5, 3, 16, 20), (1, 2, 16, 16), (7, 2, 32, 33), (3, 1, 64, 7)):\n"
        "    M = (torch.randn(n, B, D, D) / D ** 0.5).requires_grad_()\n"
        "    N = torch.randn(n, B, D, V, requires_grad=True)\n"
        "    s0 = torch.randn(B, D, V, requires_grad=True)\n"
        "    assert _scan_kernel(M) is not None\n"
        "    S = AffineScan.apply(M, N, s0)\n"
        "    g = torch.randn_like(S)\n"
        "    got = [S] + list(torch.autograd.grad(S, [M, N, s0], g))\n"
        "    ref_in = [x.detach().double().requires_grad_() for x in (M, N, s0)]\n"
        "    R = affine_scan_reference(*ref_in)\n"
        "    want = [R] + list(torch.autograd.grad(R, ref_in, g.double()))\n"
        "    out.append([float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want)])\n"
        "print(json.dumps(out))\n")
    p = run_interpreted(["-c", code])
    assert p.returncode == 0, p.stderr[-2000:]
    for errs in last_json_line(p.stdout):
        assert max(errs) < 1e-5, errs


def test_scan_kernel_declines_what_it_does_not_run():
    from longmoe.ops.gated_delta import _scan_kernel
    assert _scan_kernel(torch.zeros(2, 1, 16, 16)) is None            # CPU without the interpreter
